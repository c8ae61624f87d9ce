// The elementwise work between a layer's matmuls, each in one pass over its rows instead of the
// four to eight ATen ops (and temporaries) the torch path takes:
//   add_rms_norm   x += delta (the residual, in place), then h = x / rms(x) * weight
//   rope_kv_write  rotary embedding of q and k in place inside the fused qkv row, and the new
//                  k and v written to their paged cache slots
//   silu_mul       silu(gate) * up from the fused gate/up row
// Rows are independent, so each op is parallel over tokens. Like the attention kernel, each loop
// is compiled for AVX-512, AVX2 and baseline x86-64, and the ISA chosen in gguf_linear.cpp picks.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "vec_math.h"

namespace {

#define AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma,avx2")))
#define AVX2 __attribute__((target("avx2,fma")))

ALWAYS_INLINE void add_rms_norm_row(float* x, const float* delta, const float* w, float* h, int64_t n, float eps) {
  float ss = 0.f;
  if (delta) {
#pragma omp simd reduction(+ : ss)
    for (int64_t i = 0; i < n; ++i) {
      x[i] += delta[i];
      ss += x[i] * x[i];
    }
  } else {
#pragma omp simd reduction(+ : ss)
    for (int64_t i = 0; i < n; ++i) ss += x[i] * x[i];
  }
  const float inv = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) h[i] = x[i] * inv * w[i];
}

// One token: rotate heads [0, num_rotated) of its qkv row (HF's rotate_half layout) in place.
ALWAYS_INLINE void rope_row(float* row, int64_t num_rotated, int64_t hd, const float* cos, const float* sin) {
  const int64_t half = hd / 2;
  for (int64_t head = 0; head < num_rotated; ++head) {
    float* x1 = row + head * hd;
    float* x2 = x1 + half;
#pragma omp simd
    for (int64_t i = 0; i < half; ++i) {
      const float a = x1[i], b = x2[i];
      x1[i] = a * cos[i] - b * sin[i];
      x2[i] = b * cos[i] + a * sin[i];
    }
  }
}

// W floats at a time: 16 (zmm) for AVX-512 and the baseline build, 8 for AVX2, whose 16 ymm
// registers hold an 8-wide exp's temporaries but spill a 16-wide one's (pairs of ymm). The lanes
// compute the same operations either way, so the two widths give the same bits.
template <typename F, typename I>
ALWAYS_INLINE void silu_mul_lanes(const float* gate_up, float* out, int64_t n) {
  constexpr int64_t W = sizeof(F) / sizeof(float);
  const float* up = gate_up + n;
  int64_t i = 0;
  for (; i + W <= n; i += W) {
    F g, u;
    __builtin_memcpy(&g, gate_up + i, sizeof g);
    __builtin_memcpy(&u, up + i, sizeof u);
    const F o = g / (1.f + exp_lanes<F, I>(F{} - g)) * u;
    __builtin_memcpy(out + i, &o, sizeof o);
  }
  for (; i < n; ++i) {
    const float g = gate_up[i];
    out[i] = g / (1.f + exp_lanes<F, I>(F{} - g)[0]) * up[i];
  }
}

ALWAYS_INLINE void silu_mul_row(const float* gate_up, float* out, int64_t n) {
  silu_mul_lanes<v16f, v16i>(gate_up, out, n);
}

ALWAYS_INLINE void silu_mul8_row(const float* gate_up, float* out, int64_t n) {
  silu_mul_lanes<v8f, v8i>(gate_up, out, n);
}

// Three builds of each row function; the ISA level (2 avx512, 1 avx2, 0 scalar) picks one.
#define THREE_WAYS(name, params, args)                     \
  AVX512 void name##_avx512 params { name##_row args; }    \
  AVX2 void name##_avx2 params { name##_row args; }        \
  void name##_base params { name##_row args; }             \
  using name##_fn = void(*) params;                        \
  name##_fn pick_##name(int level) { return level == 2 ? name##_avx512 : level == 1 ? name##_avx2 : name##_base; }

THREE_WAYS(add_rms_norm, (float* x, const float* delta, const float* w, float* h, int64_t n, float eps),
           (x, delta, w, h, n, eps))
THREE_WAYS(rope, (float* row, int64_t num_rotated, int64_t hd, const float* cos, const float* sin),
           (row, num_rotated, hd, cos, sin))
AVX512 void silu_mul_avx512(const float* gate_up, float* out, int64_t n) { silu_mul_row(gate_up, out, n); }
AVX2 void silu_mul_avx2(const float* gate_up, float* out, int64_t n) { silu_mul8_row(gate_up, out, n); }
void silu_mul_base(const float* gate_up, float* out, int64_t n) { silu_mul_row(gate_up, out, n); }
using silu_mul_fn = void (*)(const float*, float*, int64_t);
silu_mul_fn pick_silu_mul(int level) { return level == 2 ? silu_mul_avx512 : level == 1 ? silu_mul_avx2 : silu_mul_base; }

void check_rows(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.dtype() == torch::kFloat && t.dim() == 2 && t.is_contiguous(), name,
              ": contiguous float32 [tokens, features]");
}

// Rows per parallel task: enough work that a thread is worth waking.
int64_t grain(int64_t row_floats) { return std::max<int64_t>(1, 8192 / std::max<int64_t>(1, row_floats)); }

}  // namespace

int splitserve_isa_level();  // gguf_linear.cpp: 2 avx512, 1 avx2, 0 scalar

torch::Tensor add_rms_norm(torch::Tensor x, torch::Tensor delta, torch::Tensor weight, double eps) {
  // x: [n, hidden], updated in place when delta [n, hidden] is given (numel 0: none); -> h [n, hidden]
  check_rows(x, "x");
  const bool has_delta = delta.numel() > 0;
  if (has_delta) {
    check_rows(delta, "delta");
    TORCH_CHECK(delta.sizes() == x.sizes(), "delta and x disagree on shape");
  }
  TORCH_CHECK(weight.dtype() == torch::kFloat && weight.is_contiguous() && weight.numel() == x.size(1),
              "weight: float32 [hidden]");
  auto h = torch::empty_like(x);
  const int64_t n = x.size(1);
  float* xp = x.data_ptr<float>();
  const float* dp = has_delta ? delta.data_ptr<float>() : nullptr;
  const float* wp = weight.data_ptr<float>();
  float* hp = h.data_ptr<float>();
  const auto fn = pick_add_rms_norm(splitserve_isa_level());
  at::parallel_for(0, x.size(0), grain(n), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      fn(xp + t * n, dp ? dp + t * n : nullptr, wp, hp + t * n, n, static_cast<float>(eps));
  });
  return h;
}

void rope_kv_write(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, torch::Tensor positions,
                   torch::Tensor kv_layer, torch::Tensor slot_mapping, int64_t nq, int64_t nkv) {
  // qkv: [n, (nq + 2 nkv) * hd], rotated in place; cos/sin: [max_pos, hd / 2]; positions and
  // slot_mapping: [n] int64; kv_layer: [2, nkv, num_blocks, block_size, hd]
  check_rows(qkv, "qkv");
  check_rows(cos, "cos");
  check_rows(sin, "sin");
  TORCH_CHECK(kv_layer.dtype() == torch::kFloat && kv_layer.dim() == 5 && kv_layer.is_contiguous(),
              "kv_layer: contiguous float32 [2, nkv, blocks, block_size, hd]");
  TORCH_CHECK(positions.dtype() == torch::kLong && slot_mapping.dtype() == torch::kLong &&
              positions.is_contiguous() && slot_mapping.is_contiguous(), "positions, slot_mapping: int64");
  const int64_t n = qkv.size(0), hd = kv_layer.size(4), half = hd / 2;
  TORCH_CHECK(kv_layer.size(1) == nkv && qkv.size(1) == (nq + 2 * nkv) * hd && cos.size(1) == half &&
              sin.sizes() == cos.sizes(), "qkv, cos/sin and the cache disagree on heads or head_dim");
  TORCH_CHECK(positions.numel() == n && slot_mapping.numel() == n, "one position and one slot per token");
  const int64_t num_slots = kv_layer.size(2) * kv_layer.size(3), head_stride = num_slots * hd;
  const int64_t* pos = positions.data_ptr<int64_t>();
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < n; ++t)
    TORCH_CHECK(pos[t] >= 0 && pos[t] < cos.size(0) && slots[t] >= 0 && slots[t] < num_slots,
                "position or cache slot out of range at token ", t);
  float* qp = qkv.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  float* kp = kv_layer.data_ptr<float>();
  float* vp = kp + nkv * head_stride;
  const int64_t width = qkv.size(1);
  const auto rope = pick_rope(splitserve_isa_level());
  at::parallel_for(0, n, grain(width), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      float* row = qp + t * width;
      rope(row, nq + nkv, hd, cp + pos[t] * half, sp + pos[t] * half);
      for (int64_t h = 0; h < nkv; ++h) {
        std::memcpy(kp + h * head_stride + slots[t] * hd, row + (nq + h) * hd, hd * sizeof(float));
        std::memcpy(vp + h * head_stride + slots[t] * hd, row + (nq + nkv + h) * hd, hd * sizeof(float));
      }
    }
  });
}

torch::Tensor silu_mul(torch::Tensor gate_up) {
  // gate_up: [n, 2 * intermediate] -> [n, intermediate]
  check_rows(gate_up, "gate_up");
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "gate_up needs an even number of columns");
  const int64_t n = gate_up.size(1) / 2;
  auto out = torch::empty({gate_up.size(0), n}, gate_up.options());
  const float* gp = gate_up.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const auto fn = pick_silu_mul(splitserve_isa_level());
  at::parallel_for(0, gate_up.size(0), grain(2 * n), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) fn(gp + t * 2 * n, op + t * n, n);
  });
  return out;
}
