// Decode attention read straight from the paged KV cache: one query token per sequence attends
// to its own blocks, up to its own context length, so nothing is gathered into a contiguous
// copy and no sequence pays for the padding of a longer one.
//
// kv_layer: [2 (k, v), num_kv_heads, num_blocks, block_size, head_dim] (one layer of the pool)
// Loops are written for the compiler to vectorize, compiled for AVX-512 and baseline x86-64, and by
// hand for AVX2 (below); the instruction set chosen for the matmul kernels picks one at run time.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "vec_math.h"

namespace {

// Horizontal sums as a tree (4 dependent adds, not 16): the lanes are summed in another order
// than a sequential loop, which fp32 tolerance covers.
ALWAYS_INLINE float hsum16(v16f v) {
  typedef float v8f __attribute__((vector_size(32)));
  typedef float v4f __attribute__((vector_size(16)));
  const v8f a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const v4f b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
}

ALWAYS_INLINE float dot(const float* a, const float* b, int64_t n) {
  int64_t i = 0;
  float acc = 0.f;
  if (n >= 16) {
    v16f sum = load16(a) * load16(b);
    for (i = 16; i + 16 <= n; i += 16) sum += load16(a + i) * load16(b + i);
    acc = hsum16(sum);
  }
  for (; i < n; ++i) acc += a[i] * b[i];
  return acc;
}

// Sixteen vectors in, one out: lane j holds the sum of v[j]'s lanes. Each level adds halves of
// two vectors into one (8 + 4 + 2 + 1 two-source shuffles and adds for 16 sums, against 16
// separate horizontal sums); the lanes come out in bit-reversed order and one permute fixes it.
ALWAYS_INLINE v16f transpose_sum16(v16f* v) {
  for (int i = 0; i < 8; ++i)
    v[i] = __builtin_shufflevector(v[2 * i], v[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           __builtin_shufflevector(v[2 * i], v[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  for (int i = 0; i < 4; ++i)
    v[i] = __builtin_shufflevector(v[2 * i], v[2 * i + 1], 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27) +
           __builtin_shufflevector(v[2 * i], v[2 * i + 1], 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int i = 0; i < 2; ++i)
    v[i] = __builtin_shufflevector(v[2 * i], v[2 * i + 1], 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29) +
           __builtin_shufflevector(v[2 * i], v[2 * i + 1], 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
  const v16f r = __builtin_shufflevector(v[0], v[1], 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30) +
                 __builtin_shufflevector(v[0], v[1], 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31);
  return __builtin_shufflevector(r, r, 0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15);
}

// scores[j] = scale * q . k_j for up to 16 consecutive keys (rows hd apart); hd a multiple of 16.
ALWAYS_INLINE void scores16(const float* q, const float* k, int64_t n, int64_t hd, float scale, float* scores) {
  v16f part[16];
  for (int64_t j = 0; j < 16; ++j) {
    v16f sum = {};
    if (j < n)
      for (int64_t c = 0; c < hd; c += 16) sum += load16(q + c) * load16(k + j * hd + c);
    part[j] = sum;
  }
  const v16f s = transpose_sum16(part) * scale;
  for (int64_t j = 0; j < n; ++j) scores[j] = s[j];
}

ALWAYS_INLINE void axpy(float alpha, const float* x, float* y, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const v16f r = load16(y + i) + alpha * load16(x + i);
    __builtin_memcpy(y + i, &r, sizeof r);
  }
  for (; i < n; ++i) y[i] += alpha * x[i];
}

// One (sequence, kv head): `group` query heads share its keys and values.
ALWAYS_INLINE void attend_one(const float* q, int64_t group, int64_t hd, const float* keys, const float* values,
                const int64_t* blocks, int64_t block_size, int64_t ctx, float scale, float* out,
                float* scores) {
  // scores: [group, ctx]; keys are read once for all the group's query heads
  for (int64_t start = 0; start < ctx; start += block_size) {
    const float* k = keys + blocks[start / block_size] * block_size * hd;
    const int64_t n = ctx - start < block_size ? ctx - start : block_size;
    if (hd % 16 == 0) {
      for (int64_t j = 0; j < n; j += 16)
        for (int64_t g = 0; g < group; ++g)
          scores16(q + g * hd, k + j * hd, n - j < 16 ? n - j : 16, hd, scale, scores + g * ctx + start + j);
    } else {
      for (int64_t j = 0; j < n; ++j, k += hd)
        for (int64_t g = 0; g < group; ++g) scores[g * ctx + start + j] = dot(q + g * hd, k, hd) * scale;
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    float* s = scores + g * ctx;
    float best = s[0];
    for (int64_t t = 1; t < ctx; ++t) best = s[t] > best ? s[t] : best;
    v16f sum16 = {};
    int64_t t = 0;
    for (; t + 16 <= ctx; t += 16) {
      const v16f e = exp16(load16(s + t) - best);
      store16(s + t, e);
      sum16 += e;
    }
    float total = hsum16(sum16);
    for (; t < ctx; ++t) {
      s[t] = exp16(v16f{} + (s[t] - best))[0];
      total += s[t];
    }
    const float inv = 1.f / total;
    for (t = 0; t + 16 <= ctx; t += 16) store16(s + t, load16(s + t) * inv);
    for (; t < ctx; ++t) s[t] *= inv;
  }
  for (int64_t i = 0; i < group * hd; ++i) out[i] = 0.f;
  for (int64_t start = 0; start < ctx; start += block_size) {
    const float* v = values + blocks[start / block_size] * block_size * hd;
    const int64_t n = ctx - start < block_size ? ctx - start : block_size;
    for (int64_t j = 0; j < n; ++j, v += hd)
      for (int64_t g = 0; g < group; ++g) axpy(scores[g * ctx + start + j], v, out + g * hd, hd);
  }
}

// The same loops compiled three times; gguf_linear.cpp's ISA choice (set_isa) picks one.
using AttendFn = void (*)(const float*, int64_t, int64_t, const float*, const float*, const int64_t*, int64_t,
                          int64_t, float, float*, float*);

__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma,avx2"))) void attend_avx512(
    const float* q, int64_t group, int64_t hd, const float* keys, const float* values, const int64_t* blocks,
    int64_t block_size, int64_t ctx, float scale, float* out, float* scores) {
  attend_one(q, group, hd, keys, values, blocks, block_size, ctx, scale, out, scores);
}

// AVX2 has 16 ymm registers, and GCC splits the 16-float vectors above into ymm pairs: the 16-key
// score tile (32 halves) then lives on the stack, with store-forwarding stalls in the inner loop,
// and the AVX2 build ran slower than the baseline one. Here everything is 8 floats wide: 8 keys
// per score tile, 8 accumulators per value tile, explicit FMAs (the build's -ffp-contract=off keeps
// a * b + c two instructions otherwise).
#define AVX2_INLINE inline __attribute__((always_inline, target("avx2,fma")))

// Lane j of the result: the sum of a[j]'s 8 lanes.
AVX2_INLINE __m256 transpose_sum8(const __m256* a) {
  const __m256 t0 = _mm256_hadd_ps(a[0], a[1]), t1 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 t2 = _mm256_hadd_ps(a[4], a[5]), t3 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);  // [a0..a3 low halves | high]
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// q . k_j for 8 keys (rows hd apart, hd a multiple of 8); past the n-th key the last one is read
// again so every load stays inside the block, and those lanes are dropped by the caller.
AVX2_INLINE __m256 scores8(const float* q, const float* k, int64_t n, int64_t hd) {
  const float* rows[8];
  for (int j = 0; j < 8; ++j) rows[j] = k + (j < n ? j : n - 1) * hd;
  __m256 acc[8];
  for (int j = 0; j < 8; ++j) acc[j] = _mm256_setzero_ps();
  for (int64_t c = 0; c < hd; c += 8) {
    const __m256 qc = _mm256_loadu_ps(q + c);
    for (int j = 0; j < 8; ++j) acc[j] = _mm256_fmadd_ps(qc, _mm256_loadu_ps(rows[j] + c), acc[j]);
  }
  return transpose_sum8(acc);
}

// out[0:8C] += sum_j p[j] * v_j[0:8C] over n value rows hd apart: C chains of FMAs, one per 8 lanes.
template <int C>
AVX2_INLINE void weighted_sum8(const float* p, const float* v, int64_t n, int64_t hd, float* out) {
  __m256 acc[C];
  for (int i = 0; i < C; ++i) acc[i] = _mm256_loadu_ps(out + 8 * i);
  for (int64_t j = 0; j < n; ++j, v += hd) {
    const __m256 pj = _mm256_broadcast_ss(p + j);
    for (int i = 0; i < C; ++i) acc[i] = _mm256_fmadd_ps(pj, _mm256_loadu_ps(v + 8 * i), acc[i]);
  }
  for (int i = 0; i < C; ++i) _mm256_storeu_ps(out + 8 * i, acc[i]);
}

AVX2_INLINE void weighted_sum(const float* p, const float* v, int64_t n, int64_t hd, float* out) {
  for (int64_t c = 0; c < hd; c += 64, v += 64, out += 64) switch (hd - c >= 64 ? 8 : (hd - c) / 8) {
      case 8: weighted_sum8<8>(p, v, n, hd, out); break;
      case 7: weighted_sum8<7>(p, v, n, hd, out); break;
      case 6: weighted_sum8<6>(p, v, n, hd, out); break;
      case 5: weighted_sum8<5>(p, v, n, hd, out); break;
      case 4: weighted_sum8<4>(p, v, n, hd, out); break;
      case 3: weighted_sum8<3>(p, v, n, hd, out); break;
      case 2: weighted_sum8<2>(p, v, n, hd, out); break;
      default: weighted_sum8<1>(p, v, n, hd, out);
    }
}

// s[0:n] = softmax(s[0:n]), in place.
AVX2_INLINE void softmax(float* s, int64_t n) {
  __m256 best8 = _mm256_set1_ps(s[0]);
  int64_t t = 0;
  for (; t + 8 <= n; t += 8) best8 = _mm256_max_ps(best8, _mm256_loadu_ps(s + t));
  float best = s[0];
  for (int64_t i = t; i < n; ++i) best = s[i] > best ? s[i] : best;
  for (int i = 0; i < 8; ++i) best = best8[i] > best ? best8[i] : best;
  v8f sum8 = {};
  for (t = 0; t + 8 <= n; t += 8) {
    v8f x;
    __builtin_memcpy(&x, s + t, sizeof x);
    x = exp8(x - best);
    __builtin_memcpy(s + t, &x, sizeof x);
    sum8 += x;
  }
  float total = (sum8[0] + sum8[4]) + (sum8[1] + sum8[5]) + ((sum8[2] + sum8[6]) + (sum8[3] + sum8[7]));
  if (t < n) {
    v8f x = {};
    __builtin_memcpy(&x, s + t, (n - t) * sizeof(float));
    x = exp8(x - best);
    __builtin_memcpy(s + t, &x, (n - t) * sizeof(float));
    for (int64_t i = 0; i < n - t; ++i) total += x[i];
  }
  const float inv = 1.f / total;
  for (t = 0; t + 8 <= n; t += 8) _mm256_storeu_ps(s + t, _mm256_mul_ps(_mm256_loadu_ps(s + t), _mm256_set1_ps(inv)));
  for (; t < n; ++t) s[t] *= inv;
}

// Each block is its own 4 KB (at 16 x 64 floats) somewhere in the pool, so the hardware
// prefetchers, which do not cross pages, start every block on demand misses; ask for the next
// block while this one is computed.
AVX2_INLINE void prefetch(const float* p, int64_t num_floats) {
  for (int64_t i = 0; i < num_floats; i += 16) _mm_prefetch(reinterpret_cast<const char*>(p + i), _MM_HINT_T0);
}

__attribute__((target("avx2,fma"))) void attend_avx2(
    const float* q, int64_t group, int64_t hd, const float* keys, const float* values, const int64_t* blocks,
    int64_t block_size, int64_t ctx, float scale, float* out, float* scores) {
  if (hd % 8 != 0) return attend_one(q, group, hd, keys, values, blocks, block_size, ctx, scale, out, scores);
  // scores: [group, ctx]; each 8-key tile is read from memory once, then from L1 for the group
  const __m256 vscale = _mm256_set1_ps(scale);
  for (int64_t start = 0; start < ctx; start += block_size) {
    const float* k = keys + blocks[start / block_size] * block_size * hd;
    const int64_t n = std::min(ctx - start, block_size);
    if (start + n < ctx)
      prefetch(keys + blocks[start / block_size + 1] * block_size * hd, std::min(ctx - start - n, block_size) * hd);
    for (int64_t j = 0; j < n; j += 8)
      for (int64_t g = 0; g < group; ++g) {
        const __m256 s = _mm256_mul_ps(scores8(q + g * hd, k + j * hd, n - j, hd), vscale);
        float* dst = scores + g * ctx + start + j;
        if (n - j >= 8) {
          _mm256_storeu_ps(dst, s);
        } else {
          float lanes[8];
          _mm256_storeu_ps(lanes, s);
          for (int64_t i = 0; i < n - j; ++i) dst[i] = lanes[i];
        }
      }
  }
  prefetch(values + blocks[0] * block_size * hd, std::min(ctx, block_size) * hd);
  for (int64_t g = 0; g < group; ++g) softmax(scores + g * ctx, ctx);
  for (int64_t i = 0; i < group * hd; ++i) out[i] = 0.f;
  for (int64_t start = 0; start < ctx; start += block_size) {
    const float* v = values + blocks[start / block_size] * block_size * hd;
    const int64_t n = std::min(ctx - start, block_size);
    if (start + n < ctx)
      prefetch(values + blocks[start / block_size + 1] * block_size * hd, std::min(ctx - start - n, block_size) * hd);
    for (int64_t g = 0; g < group; ++g) weighted_sum(scores + g * ctx + start, v, n, hd, out + g * hd);
  }
}

void attend_scalar(const float* q, int64_t group, int64_t hd, const float* keys, const float* values,
                   const int64_t* blocks, int64_t block_size, int64_t ctx, float scale, float* out,
                   float* scores) {
  attend_one(q, group, hd, keys, values, blocks, block_size, ctx, scale, out, scores);
}

}  // namespace

int splitserve_isa_level();  // gguf_linear.cpp: 2 avx512, 1 avx2, 0 scalar

torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor kv_layer, torch::Tensor block_tables,
                                     torch::Tensor context_lens, double scale) {
  // q: [b, nq, hd]; block_tables: [b, max_blocks] int64; context_lens: [b] int64 -> [b, nq, hd]
  TORCH_CHECK(q.dtype() == torch::kFloat && kv_layer.dtype() == torch::kFloat, "float32 q and cache only");
  TORCH_CHECK(kv_layer.dim() == 5 && kv_layer.is_contiguous(), "kv_layer: contiguous [2, nkv, blocks, bs, hd]");
  TORCH_CHECK(block_tables.dtype() == torch::kLong && context_lens.dtype() == torch::kLong, "int64 tables");
  q = q.contiguous();
  block_tables = block_tables.contiguous();
  context_lens = context_lens.contiguous();
  const int64_t b = q.size(0), nq = q.size(1), hd = q.size(2);
  const int64_t nkv = kv_layer.size(1), num_blocks = kv_layer.size(2), block_size = kv_layer.size(3);
  TORCH_CHECK(kv_layer.size(4) == hd && nq % nkv == 0, "q and cache disagree on heads or head_dim");
  const int64_t group = nq / nkv, max_blocks = block_tables.size(1);
  const int64_t head_stride = num_blocks * block_size * hd;
  const float* kp = kv_layer.data_ptr<float>();
  const float* vp = kp + nkv * head_stride;
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  for (int64_t i = 0; i < b; ++i)
    TORCH_CHECK(lens[i] >= 1 && lens[i] <= max_blocks * block_size, "context length outside its block table");
  auto out = torch::empty_like(q);
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int level = splitserve_isa_level();
  const AttendFn attend = level == 2 ? attend_avx512 : level == 1 ? attend_avx2 : attend_scalar;
  at::parallel_for(0, b * nkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t i = task / nkv, h = task % nkv;
      scores.resize(static_cast<size_t>(group * lens[i]));
      attend(qp + (i * nq + h * group) * hd, group, hd, kp + h * head_stride, vp + h * head_stride,
                 tables + i * max_blocks, block_size, lens[i], static_cast<float>(scale),
                 op + (i * nq + h * group) * hd, scores.data());
    }
  });
  return out;
}
