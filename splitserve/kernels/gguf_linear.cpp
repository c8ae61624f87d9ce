// y = x @ W^T with W kept in a GGUF block format (Q4_1 or Q8_0: 32 weights per block, fp32
// scale d, and for Q4_1 an fp32 offset m), dequantized in registers and accumulated in fp32.
//
// Each weight is rebuilt exactly as gguf-py's dequantize does it (Q4_1: d * q + m, a multiply
// then an add, never fused; Q8_0: q * d), so the weights equal the fp32 path's bit for bit and
// only the order of the fp32 sums differs. Built with -ffp-contract=off for that reason.
// The instruction set (AVX-512, AVX2+FMA, or plain C++) is chosen once at run time.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

constexpr int kBlock = 32;
// kPanel: rows already dequantized to fp32 (by the same functions), 32 floats a block; the tile
// kernels then only load them, and do the same FMAs in the same order.
enum Format : int { kQ4_1 = 0, kQ8_0 = 1, kPanel = 2 };

constexpr int64_t bytes_per_block(int fmt) { return fmt == kQ4_1 ? 16 : fmt == kQ8_0 ? 32 : 128; }

// Weights of one tile: rows [n, n + NR) of W; qs rows are `ldq` bytes apart, d/m rows `nb` apart.
struct WeightTile {
  const uint8_t* qs;
  int64_t ldq;
  const float* d;
  const float* m;
  int64_t nb;  // blocks per row = K / 32
};

// All of W [N, K] as both linears read it; rows_from(n) is the tile starting at row n.
struct BlockMatrix {
  const uint8_t* qs;
  const float* d;
  const float* m;  // Q4_1 only, else nullptr
  int64_t ldq, nb, N;

  BlockMatrix(const torch::Tensor& qs_, const torch::Tensor& d_, const torch::Tensor& m_, int fmt)
      : qs(qs_.data_ptr<uint8_t>()), d(d_.data_ptr<float>()), m(fmt == kQ4_1 ? m_.data_ptr<float>() : nullptr),
        ldq(qs_.size(1)), nb(d_.size(1)), N(qs_.size(0)) {}

  WeightTile rows_from(int64_t n) const { return {qs + n * ldq, ldq, d + n * nb, m ? m + n * nb : nullptr, nb}; }

  // Tiles of `nr` rows per parallel task: enough that one task's weights are worth a thread;
  // small matrices run inline.
  int64_t grain(int nr) const { return std::max<int64_t>(1, 16384 / std::max<int64_t>(1, nb * kBlock * nr / 8)); }
};

// ---------------------------------------------------------------- AVX-512 (16 floats a vector)
template <int FMT>
__attribute__((target("avx512f,avx512bw,avx512vl"))) inline void dequant16x2(
    const uint8_t* q, float d, float m, __m512& w0, __m512& w1) {
  if (FMT == kPanel) {
    w0 = _mm512_loadu_ps(reinterpret_cast<const float*>(q));
    w1 = _mm512_loadu_ps(reinterpret_cast<const float*>(q) + 16);
    return;
  }
  const __m512 vd = _mm512_set1_ps(d);
  if (FMT == kQ4_1) {
    // A 4-bit weight has 16 possible values: compute d * q + m once for q = 0..15 and look each
    // weight up (vpermps reads only an index's low 4 bits, so neither nibble needs masking).
    // The same multiply and add on the same operands: the same bits as converting each weight.
    const __m512 table = _mm512_add_ps(
        _mm512_mul_ps(vd, _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)), _mm512_set1_ps(m));
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
    w0 = _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(raw), table);                       // weights 0..15
    w1 = _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(_mm_srli_epi16(raw, 4)), table);  // weights 16..31
  } else {
    const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16));
    w0 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(a)), vd);
    w1 = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b)), vd);
  }
}

// ACC = 2 gives each row pair two accumulators (first and second half of a block): with one or two
// rows of x a single chain of FMAs per output would wait on its own latency every block.
template <int FMT, int MR, int NR, int ACC>
__attribute__((target("avx512f,avx512bw,avx512vl"))) void tile_avx512(
    const float* x, int64_t ldx, const WeightTile& w, float* y, int64_t ldy) {
  __m512 acc[ACC][MR][NR];
  for (int a = 0; a < ACC; ++a)
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < NR; ++j) acc[a][i][j] = _mm512_setzero_ps();
  for (int64_t b = 0; b < w.nb; ++b) {
    __m512 w0[NR], w1[NR];
    for (int j = 0; j < NR; ++j)
      dequant16x2<FMT>(w.qs + j * w.ldq + b * bytes_per_block(FMT), w.d[j * w.nb + b],
                       FMT == kQ4_1 ? w.m[j * w.nb + b] : 0.f, w0[j], w1[j]);
    for (int i = 0; i < MR; ++i) {
      const __m512 x0 = _mm512_loadu_ps(x + i * ldx + b * kBlock);
      const __m512 x1 = _mm512_loadu_ps(x + i * ldx + b * kBlock + 16);
      for (int j = 0; j < NR; ++j) {
        acc[0][i][j] = _mm512_fmadd_ps(w0[j], x0, acc[0][i][j]);
        acc[ACC - 1][i][j] = _mm512_fmadd_ps(w1[j], x1, acc[ACC - 1][i][j]);
      }
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j)
      y[i * ldy + j] = _mm512_reduce_add_ps(ACC == 2 ? _mm512_add_ps(acc[0][i][j], acc[ACC - 1][i][j]) : acc[0][i][j]);
}

// ---------------------------------------------------------------- AVX2 + FMA (8 floats a vector)
__attribute__((target("avx2,fma"))) inline float hsum256(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

template <int FMT>
__attribute__((target("avx2,fma"))) inline void dequant8x4(const uint8_t* q, float d, float m,
                                                           __m256 w[4]) {
  if (FMT == kPanel) {
    for (int k = 0; k < 4; ++k) w[k] = _mm256_loadu_ps(reinterpret_cast<const float*>(q) + 8 * k);
    return;
  }
  const __m256 vd = _mm256_set1_ps(d);
  if (FMT == kQ4_1) {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
    const __m128i mask = _mm_set1_epi8(0x0F);
    const __m128i lo = _mm_and_si128(raw, mask);
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(raw, 4), mask);
    const __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
    const __m256 vm = _mm256_set1_ps(m);
    for (int k = 0; k < 4; ++k)
      w[k] = _mm256_add_ps(_mm256_mul_ps(vd, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[k]))), vm);
  } else {
    for (int k = 0; k < 4; ++k) {
      const __m128i part = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8 * k));
      w[k] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(part)), vd);
    }
  }
}

template <int FMT, int MR, int NR, int ACC>
__attribute__((target("avx2,fma"))) void tile_avx2(const float* x, int64_t ldx, const WeightTile& w,
                                                   float* y, int64_t ldy) {
  __m256 acc[ACC][MR][NR];
  for (int a = 0; a < ACC; ++a)
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < NR; ++j) acc[a][i][j] = _mm256_setzero_ps();
  for (int64_t b = 0; b < w.nb; ++b) {
    __m256 wv[NR][4];
    for (int j = 0; j < NR; ++j)
      dequant8x4<FMT>(w.qs + j * w.ldq + b * bytes_per_block(FMT), w.d[j * w.nb + b],
                      FMT == kQ4_1 ? w.m[j * w.nb + b] : 0.f, wv[j]);
    for (int i = 0; i < MR; ++i) {
      for (int k = 0; k < 4; ++k) {
        const __m256 xv = _mm256_loadu_ps(x + i * ldx + b * kBlock + 8 * k);
        for (int j = 0; j < NR; ++j) acc[k % ACC][i][j] = _mm256_fmadd_ps(wv[j][k], xv, acc[k % ACC][i][j]);
      }
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j)
      y[i * ldy + j] = hsum256(ACC == 2 ? _mm256_add_ps(acc[0][i][j], acc[ACC - 1][i][j]) : acc[0][i][j]);
}

// ---------------------------------------------------------------- plain C++ (any x86-64)
template <int FMT>
inline float dequant_one(const uint8_t* q, float d, float m, int k) {
  if (FMT == kPanel) return reinterpret_cast<const float*>(q)[k];
  if (FMT == kQ4_1) {
    const int v = k < 16 ? (q[k] & 0x0F) : (q[k - 16] >> 4);
    return d * static_cast<float>(v) + m;
  }
  return static_cast<float>(static_cast<int8_t>(q[k])) * d;
}

template <int FMT, int MR, int NR>
void tile_scalar(const float* x, int64_t ldx, const WeightTile& w, float* y, int64_t ldy) {
  float acc[MR][NR] = {};
  for (int64_t b = 0; b < w.nb; ++b)
    for (int j = 0; j < NR; ++j) {
      const uint8_t* q = w.qs + j * w.ldq + b * bytes_per_block(FMT);
      const float d = w.d[j * w.nb + b], m = FMT == kQ4_1 ? w.m[j * w.nb + b] : 0.f;
      for (int k = 0; k < kBlock; ++k) {
        const float wk = dequant_one<FMT>(q, d, m, k);
        for (int i = 0; i < MR; ++i) acc[i][j] += wk * x[i * ldx + b * kBlock + k];
      }
    }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) y[i * ldy + j] = acc[i][j];
}

// ---------------------------------------------------------------- tiling and dispatch
enum class Isa { kScalar, kAvx2, kAvx512 };

Isa detect_isa() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl"))
    return Isa::kAvx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return Isa::kAvx2;
  return Isa::kScalar;
}

Isa g_isa = detect_isa();  // may be lowered by set_isa() (tests exercise every path)

template <int FMT, int MR, int NR>
void run_tile(const float* x, int64_t ldx, const WeightTile& w, float* y, int64_t ldy) {
  switch (g_isa) {
    case Isa::kAvx512: return tile_avx512<FMT, MR, NR, (MR <= 2 ? 2 : 1)>(x, ldx, w, y, ldy);
    case Isa::kAvx2: return tile_avx2<FMT, MR, NR, (MR <= 2 ? 2 : 1)>(x, ldx, w, y, ldy);
    default: return tile_scalar<FMT, MR, NR>(x, ldx, w, y, ldy);
  }
}

// MR rows of x times NR rows of W per tile; 8 x 2 keeps AVX-512's 16 accumulators plus the
// dequantized weights in registers, and reuses each dequantized block for 8 rows of x.
constexpr int kMR = 8;
constexpr int kNR = 2;

template <int FMT, int NR>
void rows_of_x(const float* x, int64_t M, int64_t ldx, const WeightTile& w, float* y, int64_t ldy) {
  int64_t i = 0;
  for (; i + kMR <= M; i += kMR) run_tile<FMT, kMR, NR>(x + i * ldx, ldx, w, y + i * ldy, ldy);
  const float* xr = x + i * ldx;
  float* yr = y + i * ldy;
  switch (M - i) {
    case 7: return run_tile<FMT, 7, NR>(xr, ldx, w, yr, ldy);
    case 6: return run_tile<FMT, 6, NR>(xr, ldx, w, yr, ldy);
    case 5: return run_tile<FMT, 5, NR>(xr, ldx, w, yr, ldy);
    case 4: return run_tile<FMT, 4, NR>(xr, ldx, w, yr, ldy);
    case 3: return run_tile<FMT, 3, NR>(xr, ldx, w, yr, ldy);
    case 2: return run_tile<FMT, 2, NR>(xr, ldx, w, yr, ldy);
    case 1: return run_tile<FMT, 1, NR>(xr, ldx, w, yr, ldy);
    default: return;
  }
}

// One row of W as fp32 (nb blocks), in the ISA's registers: the same values as dequant_one.
template <int FMT>
__attribute__((target("avx512f,avx512bw,avx512vl"))) void dequant_row_avx512(
    const uint8_t* q, const float* d, const float* m, int64_t nb, float* out) {
  for (int64_t b = 0; b < nb; ++b, out += kBlock) {
    __m512 w0, w1;
    dequant16x2<FMT>(q + b * bytes_per_block(FMT), d[b], m ? m[b] : 0.f, w0, w1);
    _mm512_storeu_ps(out, w0);
    _mm512_storeu_ps(out + 16, w1);
  }
}

template <int FMT>
__attribute__((target("avx2,fma"))) void dequant_row_avx2(const uint8_t* q, const float* d, const float* m,
                                                          int64_t nb, float* out) {
  for (int64_t b = 0; b < nb; ++b, out += kBlock) {
    __m256 w[4];
    dequant8x4<FMT>(q + b * bytes_per_block(FMT), d[b], m ? m[b] : 0.f, w);
    for (int k = 0; k < 4; ++k) _mm256_storeu_ps(out + 8 * k, w[k]);
  }
}

template <int FMT>
void dequant_row_scalar(const uint8_t* q, const float* d, const float* m, int64_t nb, float* out) {
  for (int64_t b = 0; b < nb; ++b, out += kBlock)
    for (int k = 0; k < kBlock; ++k)
      out[k] = dequant_one<FMT>(q + b * bytes_per_block(FMT), d[b], m ? m[b] : 0.f, k);
}

template <int FMT>
void dequant_row(const uint8_t* q, const float* d, const float* m, int64_t nb, float* out) {
  switch (g_isa) {
    case Isa::kAvx512: return dequant_row_avx512<FMT>(q, d, m, nb, out);
    case Isa::kAvx2: return dequant_row_avx2<FMT>(q, d, m, nb, out);
    default: return dequant_row_scalar<FMT>(q, d, m, nb, out);
  }
}

void check_inputs(const torch::Tensor& qs, const torch::Tensor& d, const torch::Tensor& m, int fmt) {
  TORCH_CHECK(fmt == kQ4_1 || fmt == kQ8_0, "unknown GGUF block format ", fmt);
  TORCH_CHECK(qs.dtype() == torch::kUInt8 && qs.dim() == 2 && qs.is_contiguous(), "qs: contiguous uint8 [N, bytes]");
  TORCH_CHECK(d.dtype() == torch::kFloat && d.dim() == 2 && d.is_contiguous(), "d: contiguous float32 [N, K/32]");
  TORCH_CHECK(qs.size(0) == d.size(0) && qs.size(1) == d.size(1) * bytes_per_block(fmt), "qs and d disagree");
  if (fmt == kQ4_1)
    TORCH_CHECK(m.sizes() == d.sizes() && m.dtype() == torch::kFloat && m.is_contiguous(), "m must match d");
}

template <int FMT>
void linear_impl(const torch::Tensor& x, const torch::Tensor& qs, const torch::Tensor& d,
                 const torch::Tensor& m, torch::Tensor& y) {
  const BlockMatrix W(qs, d, m, FMT);
  const int64_t M = x.size(0), N = W.N, nb = W.nb;
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  // Above one tile of x rows, each weight row would be dequantized once per tile: dequantize the
  // tile's NR rows once into an fp32 panel (L1-sized) and let every x tile read it instead.
  const bool panel = M > kMR;
  at::parallel_for(0, (N + kNR - 1) / kNR, W.grain(kNR), [&](int64_t begin, int64_t end) {
    std::vector<float> buf(panel ? kNR * nb * kBlock : 0);
    const uint8_t* bp = reinterpret_cast<const uint8_t*>(buf.data());
    const int64_t ldb = nb * bytes_per_block(kPanel);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n = t * kNR, rows = std::min<int64_t>(kNR, N - n);
      if (panel)
        for (int64_t r = 0; r < rows; ++r) {
          const WeightTile row = W.rows_from(n + r);
          dequant_row<FMT>(row.qs, row.d, row.m, nb, buf.data() + r * nb * kBlock);
        }
      for (int64_t r = 0; r < rows; r += (rows == kNR ? kNR : 1)) {
        const WeightTile w = W.rows_from(n + r);
        const WeightTile wp{bp + r * ldb, ldb, w.d, nullptr, nb};
        if (rows == kNR)
          panel ? rows_of_x<kPanel, kNR>(xp, M, x.size(1), wp, yp + n, N)
                : rows_of_x<FMT, kNR>(xp, M, x.size(1), w, yp + n, N);
        else
          panel ? rows_of_x<kPanel, 1>(xp, M, x.size(1), wp, yp + n + r, N)
                : rows_of_x<FMT, 1>(xp, M, x.size(1), w, yp + n + r, N);
      }
    }
  });
}

// x [M, K] against W's blocks: checked, made contiguous, and y [M, N] to write (both linears).
torch::Tensor checked_output(torch::Tensor& x, const torch::Tensor& qs, const torch::Tensor& d,
                             const torch::Tensor& m, int64_t fmt) {
  check_inputs(qs, d, m, fmt);
  TORCH_CHECK(x.dtype() == torch::kFloat && x.dim() == 2, "x: float32 [M, K]");
  TORCH_CHECK(x.size(1) == d.size(1) * kBlock, "x has ", x.size(1), " columns, W has ", d.size(1) * kBlock);
  x = x.contiguous();
  return torch::empty({x.size(0), qs.size(0)}, x.options());
}

torch::Tensor gguf_linear(torch::Tensor x, torch::Tensor qs, torch::Tensor d, torch::Tensor m, int64_t fmt) {
  auto y = checked_output(x, qs, d, m, fmt);
  if (x.size(0) == 0) return y;
  if (fmt == kQ4_1) linear_impl<kQ4_1>(x, qs, d, m, y);
  else linear_impl<kQ8_0>(x, qs, d, m, y);
  return y;
}

template <int FMT>
void dequantize_impl(const torch::Tensor& qs, const torch::Tensor& d, const torch::Tensor& m, torch::Tensor& w) {
  const int64_t N = qs.size(0), nb = d.size(1), ldq = qs.size(1);
  const uint8_t* qp = qs.data_ptr<uint8_t>();
  const float* dp = d.data_ptr<float>();
  const float* mp = FMT == kQ4_1 ? m.data_ptr<float>() : nullptr;
  float* wp = w.data_ptr<float>();
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const uint8_t* q = qp + r * ldq;
      const float* d = dp + r * nb;
      const float* m = mp ? mp + r * nb : nullptr;
      dequant_row<FMT>(q, d, m, nb, wp + r * nb * kBlock);
    }
  });
}

torch::Tensor gguf_dequantize(torch::Tensor qs, torch::Tensor d, torch::Tensor m, int64_t fmt) {
  check_inputs(qs, d, m, fmt);
  auto w = torch::empty({qs.size(0), d.size(1) * kBlock}, d.options());
  if (fmt == kQ4_1) dequantize_impl<kQ4_1>(qs, d, m, w);
  else dequantize_impl<kQ8_0>(qs, d, m, w);
  return w;
}

// ---------------------------------------------------------------- 8-bit activations (decode rows)
// llama.cpp's method for a few rows of x: each row is quantized per 32-block (Q8_1: dx = max|x| /
// 127, qx = round(x / dx), sx = dx * sum(qx)), and a block's products are integer dot products:
// Q4_1: d dx sum(q qx) + m sx; Q8_0: d dx sum(q qx). A quarter of the instructions of the fp32
// path per weight on AVX2 (vpmaddubsw does 32 multiplies), at the cost of rounding x to 8 bits: the
// results are not the fp32 path's, and greedy tokens may differ (docs/benchmarks.md, "Engine").
void quantize_row_q8(const float* x, int64_t nb, int8_t* q, float* d, float* s) {
  for (int64_t b = 0; b < nb; ++b, x += kBlock, q += kBlock) {
    float amax = 0.f;
    for (int k = 0; k < kBlock; ++k) amax = std::max(amax, std::fabs(x[k]));
    const float dx = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
    int sum = 0;
    for (int k = 0; k < kBlock; ++k) {
      const int v = static_cast<int>(std::nearbyint(x[k] * inv));
      q[k] = static_cast<int8_t>(v);
      sum += v;
    }
    d[b] = dx;
    s[b] = dx * static_cast<float>(sum);
  }
}

struct QuantX {
  const int8_t* q;  // rows of nb * 32 int8
  const float* d;   // rows of nb
  const float* s;
  int64_t nb;
};

__attribute__((target("avx2,fma"))) inline __m256i weight_bytes_q4(const uint8_t* q) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
  const __m128i mask = _mm_set1_epi8(0x0F);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), mask), _mm_and_si128(raw, mask));
}

template <int FMT, int MR, int NR>
__attribute__((target("avx2,fma"))) void tile_q8_avx2(const QuantX& x, const WeightTile& w, float* y, int64_t ldy) {
  __m256 acc[MR][NR];
  float macc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm256_setzero_ps(), macc[i][j] = 0.f;
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t b = 0; b < w.nb; ++b) {
    __m256i xv[MR];
    for (int i = 0; i < MR; ++i)
      xv[i] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.q + (i * x.nb + b) * kBlock));
    for (int j = 0; j < NR; ++j) {
      const uint8_t* q = w.qs + j * w.ldq + b * bytes_per_block(FMT);
      __m256i wv = FMT == kQ4_1 ? weight_bytes_q4(q) : _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q));
      const float dw = w.d[j * w.nb + b];
      for (int i = 0; i < MR; ++i) {
        // vpmaddubsw multiplies unsigned by signed bytes: Q4_1's 0..15 are unsigned already; a
        // signed Q8_0 weight moves its sign onto x (|w| * sign(w) x)
        const __m256i p16 = FMT == kQ4_1 ? _mm256_maddubs_epi16(wv, xv[i])
                                         : _mm256_maddubs_epi16(_mm256_sign_epi8(wv, wv), _mm256_sign_epi8(xv[i], wv));
        const __m256 p = _mm256_cvtepi32_ps(_mm256_madd_epi16(p16, ones));
        acc[i][j] = _mm256_fmadd_ps(_mm256_set1_ps(dw * x.d[i * x.nb + b]), p, acc[i][j]);
        if (FMT == kQ4_1) macc[i][j] += w.m[j * w.nb + b] * x.s[i * x.nb + b];
      }
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) y[i * ldy + j] = hsum256(acc[i][j]) + macc[i][j];
}

template <int FMT, int MR, int NR>
void tile_q8_scalar(const QuantX& x, const WeightTile& w, float* y, int64_t ldy) {
  float acc[MR][NR] = {};
  for (int64_t b = 0; b < w.nb; ++b)
    for (int j = 0; j < NR; ++j) {
      const uint8_t* q = w.qs + j * w.ldq + b * bytes_per_block(FMT);
      for (int i = 0; i < MR; ++i) {
        const int8_t* xq = x.q + (i * x.nb + b) * kBlock;
        int sum = 0;
        for (int k = 0; k < kBlock; ++k) {
          const int wk = FMT == kQ4_1 ? (k < 16 ? (q[k] & 0x0F) : (q[k - 16] >> 4)) : static_cast<int8_t>(q[k]);
          sum += wk * xq[k];
        }
        acc[i][j] += w.d[j * w.nb + b] * x.d[i * x.nb + b] * static_cast<float>(sum);
        if (FMT == kQ4_1) acc[i][j] += w.m[j * w.nb + b] * x.s[i * x.nb + b];
      }
    }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) y[i * ldy + j] = acc[i][j];
}

template <int FMT, int MR, int NR>
void run_tile_q8(const QuantX& x, const WeightTile& w, float* y, int64_t ldy) {
  if (g_isa == Isa::kScalar) return tile_q8_scalar<FMT, MR, NR>(x, w, y, ldy);
  return tile_q8_avx2<FMT, MR, NR>(x, w, y, ldy);  // AVX-512 CPUs run the AVX2 code
}

constexpr int kNRq8 = 4;

template <int FMT, int NR>
void rows_of_qx(const QuantX& x, int64_t M, const WeightTile& w, float* y, int64_t ldy) {
  int64_t i = 0;
  for (; i + 2 <= M; i += 2) {
    const QuantX xi{x.q + i * x.nb * kBlock, x.d + i * x.nb, x.s + i * x.nb, x.nb};
    run_tile_q8<FMT, 2, NR>(xi, w, y + i * ldy, ldy);
  }
  if (i < M) {
    const QuantX xi{x.q + i * x.nb * kBlock, x.d + i * x.nb, x.s + i * x.nb, x.nb};
    run_tile_q8<FMT, 1, NR>(xi, w, y + i * ldy, ldy);
  }
}

template <int FMT>
void linear_q8_impl(const torch::Tensor& x, const torch::Tensor& qs, const torch::Tensor& d,
                    const torch::Tensor& m, torch::Tensor& y) {
  const int64_t M = x.size(0), N = qs.size(0), nb = d.size(1);
  std::vector<int8_t> xq(M * nb * kBlock);
  std::vector<float> xd(M * nb), xs(M * nb);
  for (int64_t i = 0; i < M; ++i)
    quantize_row_q8(x.data_ptr<float>() + i * nb * kBlock, nb, xq.data() + i * nb * kBlock, xd.data() + i * nb,
                    xs.data() + i * nb);
  const QuantX qx{xq.data(), xd.data(), xs.data(), nb};
  const BlockMatrix W(qs, d, m, FMT);
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, (N + kNRq8 - 1) / kNRq8, W.grain(kNRq8), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n = t * kNRq8, rows = std::min<int64_t>(kNRq8, N - n);
      if (rows == kNRq8) {
        rows_of_qx<FMT, kNRq8>(qx, M, W.rows_from(n), yp + n, N);
      } else {
        for (int64_t r = 0; r < rows; ++r) rows_of_qx<FMT, 1>(qx, M, W.rows_from(n + r), yp + n + r, N);
      }
    }
  });
}

torch::Tensor gguf_linear_q8(torch::Tensor x, torch::Tensor qs, torch::Tensor d, torch::Tensor m, int64_t fmt) {
  auto y = checked_output(x, qs, d, m, fmt);
  if (x.size(0) == 0) return y;
  if (fmt == kQ4_1) linear_q8_impl<kQ4_1>(x, qs, d, m, y);
  else linear_q8_impl<kQ8_0>(x, qs, d, m, y);
  return y;
}

std::string isa_name() {
  return g_isa == Isa::kAvx512 ? "avx512" : g_isa == Isa::kAvx2 ? "avx2" : "scalar";
}

// Lower the instruction set (never raise it past what the CPU has); returns the one in use.
std::string set_isa(const std::string& name) {
  const Isa best = detect_isa();
  const Isa want = name == "avx512" ? Isa::kAvx512 : name == "avx2" ? Isa::kAvx2 : Isa::kScalar;
  TORCH_CHECK(name == "avx512" || name == "avx2" || name == "scalar", "isa must be avx512, avx2 or scalar");
  g_isa = static_cast<int>(want) <= static_cast<int>(best) ? want : best;
  return isa_name();
}

}  // namespace

int splitserve_isa_level() { return g_isa == Isa::kAvx512 ? 2 : g_isa == Isa::kAvx2 ? 1 : 0; }

torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor kv_layer, torch::Tensor block_tables,
                                     torch::Tensor context_lens, double scale);  // paged_attention.cpp
torch::Tensor paged_prefill_attention(torch::Tensor q, torch::Tensor kv_layer, torch::Tensor block_ids,
                                      int64_t num_context_tokens, double scale);  // prefill_attention.cpp
// fused_ops.cpp
torch::Tensor add_rms_norm(torch::Tensor x, torch::Tensor delta, torch::Tensor weight, double eps);
void rope_kv_write(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, torch::Tensor positions,
                   torch::Tensor kv_layer, torch::Tensor slot_mapping, int64_t nq, int64_t nkv);
torch::Tensor silu_mul(torch::Tensor gate_up);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  module.def("linear", &gguf_linear, "x [M, K] @ dequant(W [N, K])^T -> [M, N], fp32 accumulation");
  module.def("linear_q8", &gguf_linear_q8,
             "x [M, K] quantized to 8 bits per 32-block (Q8_1), times W's blocks in integers -> [M, N] (llama.cpp's method)");
  module.def("dequantize", &gguf_dequantize, "W [N, K] as fp32, exactly as gguf-py dequantizes it");
  module.def("paged_decode_attention", &paged_decode_attention,
             "one query per sequence over its own KV blocks: q [b, nq, hd] -> [b, nq, hd]");
  module.def("paged_prefill_attention", &paged_prefill_attention,
             "a chunk's t queries (the last t of num_context_tokens) causally over its KV blocks: q [t, nq, hd] -> [t, nq, hd]");
  module.def("add_rms_norm", &add_rms_norm, "x += delta in place (if given), then RMSNorm(x) * weight");
  module.def("rope_kv_write", &rope_kv_write, "rotary q/k in place in the qkv rows; k/v into their cache slots");
  module.def("silu_mul", &silu_mul, "silu(gate) * up from [n, 2 * intermediate] rows");
  module.def("isa", &isa_name);
  module.def("set_isa", &set_isa);
}
