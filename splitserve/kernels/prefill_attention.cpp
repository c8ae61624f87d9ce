// Causal prefill attention read in place from the paged KV cache, flash-style: a chunk's t queries
// sit at positions ctx - t .. ctx - 1 and query i sees keys 0 .. ctx - t + i, so one kernel covers
// a whole prompt (ctx == t) and a chunk after cached context, with no gather and no mask tensor.
//
// Per task (one KV head, a tile of query tokens with all `group` query heads of that KV head as
// rows, so each key is read once for the group), keys are walked 16 at a time with an online
// softmax (running max and sum per row; the accumulator is rescaled as the max grows). Tiles past
// the diagonal are skipped; only tiles that cross it are masked. Query rows live in vector lanes
// (q, scores and the output are kept transposed per task), so the softmax's row maxima and sums
// are plain vector ops, and keys and values are read in place as broadcasts, never copied.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

#include "vec_math.h"

namespace {

constexpr int64_t kKeys = 16;  // keys per tile (one block of the default cache layout)
constexpr int64_t kVecs = 3;   // row vectors per register tile: 24 query rows in the lanes
constexpr int64_t kRows = 8 * kVecs;
constexpr int64_t kCols = 4;   // keys (S) or head dims (O) per register tile, each a broadcast
constexpr int64_t kTaskRows = 2 * kRows;  // query rows per task tile: tokens x group, padded

ALWAYS_INLINE v8f load8(const float* p) {
  v8f v;
  __builtin_memcpy(&v, p, sizeof v);
  return v;
}

ALWAYS_INLINE void store8(float* p, v8f v) { __builtin_memcpy(p, &v, sizeof v); }

// FMA: the helpers are instantiated in the AVX2 and AVX-512 tiles (true) or the baseline one. The
// instructions are written out because intrinsics may not be inlined into these generic helpers
// (GCC refuses the target mismatch before they are inlined into the AVX2 and AVX-512 tiles).

// *p in every lane, one vbroadcastss from memory (GCC builds the generic splat from scalar inserts).
template <bool FMA>
ALWAYS_INLINE v8f broadcast(const float* p) {
  if constexpr (FMA) {
    v8f r;
    asm("vbroadcastss %[p], %[r]" : [r] "=x"(r) : [p] "m"(*p));
    return r;
  } else {
    return v8f{} + *p;
  }
}

// a * b + c; one rounding with FMA (the build's -ffp-contract=off keeps a * b + c two otherwise).
template <bool FMA>
ALWAYS_INLINE v8f madd(v8f a, v8f b, v8f c) {
  if constexpr (FMA) {
    asm("vfmadd231ps %[b], %[a], %[c]" : [c] "+x"(c) : [a] "x"(a), [b] "x"(b));
    return c;
  } else {
    return a * b + c;
  }
}

// 2^x for x <= 0 (scores come scaled by log2 e): 2^n from the exponent bits, 2^f on [-1/2, 1/2] by
// Cephes' exp2f polynomial (within 2 ulp). Below 2^-125 (nothing next to the row's maximum of 1) it
// stays there, so -inf and the first tile's correction are finite and no result is subnormal.
template <bool FMA>
ALWAYS_INLINE v8f exp2_nonpositive(v8f x) {
  const v8f lo = v8f{} - 125.f, shifter = v8f{} + 12582912.f;  // 1.5 * 2^23: adding it rounds to an integer
  x = x < lo ? lo : x;
  const v8f big = x + shifter;
  const v8f f = x - (big - shifter);
  v8f p = madd<FMA>(v8f{} + 1.535336188319500e-4f, f, v8f{} + 1.339887440266574e-3f);
  p = madd<FMA>(p, f, v8f{} + 9.618437357674640e-3f);
  p = madd<FMA>(p, f, v8f{} + 5.550332471162809e-2f);
  p = madd<FMA>(p, f, v8f{} + 2.402264791363012e-1f);
  p = madd<FMA>(p, f, v8f{} + 6.931472028550421e-1f);
  p = madd<FMA>(p, f, v8f{} + 1.f);
  // big's low mantissa bits hold the integer n (two's complement): shifted into the exponent field
  return (v8f)((v8i)p + ((v8i)big << 23));
}

// Register tiles keep 24 query rows in the lanes of three vectors and take 4 columns as broadcasts:
// 12 accumulators, 3 row vectors and a broadcast are AVX2's 16 registers.
//
// st[c][0:24] = sum_d qt[d][0:24] * key_c[d] for 4 keys
template <bool FMA>
ALWAYS_INLINE void score_tile(const float* qt, int64_t ldq, const float* const* keys, int64_t hd, float* st,
                              int64_t lds) {
  v8f acc[kCols][kVecs] = {};
  const float *k0 = keys[0], *k1 = keys[1], *k2 = keys[2], *k3 = keys[3];
  for (int64_t d = 0; d < hd; ++d, qt += ldq) {
    const v8f q0 = load8(qt), q1 = load8(qt + 8), q2 = load8(qt + 16);
    const float* kc[kCols] = {k0 + d, k1 + d, k2 + d, k3 + d};
#pragma GCC unroll 4
    for (int c = 0; c < kCols; ++c) {
      const v8f kb = broadcast<FMA>(kc[c]);
      acc[c][0] = madd<FMA>(q0, kb, acc[c][0]);
      acc[c][1] = madd<FMA>(q1, kb, acc[c][1]);
      acc[c][2] = madd<FMA>(q2, kb, acc[c][2]);
    }
  }
#pragma GCC unroll 4
  for (int c = 0; c < kCols; ++c)
    for (int i = 0; i < kVecs; ++i) store8(st + c * lds + 8 * i, acc[c][i]);
}

// ot[c][0:24] = ot[c][0:24] * corr[0:24] + sum_j pt[j][0:24] * value_j[col + c] for C head dims, n keys
template <bool FMA, int C>
ALWAYS_INLINE void value_tile(const float* pt, int64_t ldp, const float* const* values, int64_t col, int64_t n,
                              const float* corr, float* ot, int64_t ldo) {
  v8f acc[C][kVecs];
  const v8f c0 = load8(corr), c1 = load8(corr + 8), c2 = load8(corr + 16);
#pragma GCC unroll 4
  for (int c = 0; c < C; ++c) {
    acc[c][0] = load8(ot + c * ldo) * c0;
    acc[c][1] = load8(ot + c * ldo + 8) * c1;
    acc[c][2] = load8(ot + c * ldo + 16) * c2;
  }
  for (int64_t j = 0; j < n; ++j, pt += ldp) {
    const v8f p0 = load8(pt), p1 = load8(pt + 8), p2 = load8(pt + 16);
    const float* v = values[j] + col;
#pragma GCC unroll 4
    for (int c = 0; c < C; ++c) {
      const v8f vb = broadcast<FMA>(v + c);
      acc[c][0] = madd<FMA>(p0, vb, acc[c][0]);
      acc[c][1] = madd<FMA>(p1, vb, acc[c][1]);
      acc[c][2] = madd<FMA>(p2, vb, acc[c][2]);
    }
  }
#pragma GCC unroll 4
  for (int c = 0; c < C; ++c)
    for (int i = 0; i < kVecs; ++i) store8(ot + c * ldo + 8 * i, acc[c][i]);
}

struct Problem {
  const float* q;  // [t, nq, hd] with row strides q_token, q_head
  int64_t q_token, q_head;
  const float* keys;  // [nkv, num_blocks, block_size, hd]
  const float* values;
  int64_t head_stride;
  const int64_t* blocks;
  int64_t block_size;
  int64_t t, ctx, group, nkv, hd;
  int64_t tokens_per_tile;
  float scale;
  float* out;  // [t, nq, hd]
};

struct Scratch {
  std::vector<float> qt, ot, st, pos, m, l, corr;
  std::vector<const float*> krows, vrows;
};

// Query tokens i0 .. i0 + n - 1 of KV head h. Row r = token * group + g sits in lane r of the
// transposed tiles ([hd][rows] for q and the output, [keys][rows] for scores); rows past n * group
// pad to a multiple of 24 and repeat the last token's position (their results are dropped).
template <bool FMA>
ALWAYS_INLINE void attend_tile(const Problem& pb, int64_t h, int64_t i0, int64_t n, Scratch& sc) {
  const int64_t G = pb.group, hd = pb.hd;
  const int64_t rows = n * G, M = (rows + kRows - 1) / kRows * kRows;
  sc.qt.assign(hd * M, 0.f);
  sc.ot.assign(hd * M, 0.f);
  sc.st.resize(kKeys * M);
  sc.pos.resize(M);
  sc.m.assign(M, -std::numeric_limits<float>::infinity());
  sc.l.assign(M, 0.f);
  sc.corr.resize(M);
  sc.krows.resize(kKeys);
  sc.vrows.resize(kKeys);
  float *qt = sc.qt.data(), *ot = sc.ot.data(), *st = sc.st.data(), *pos = sc.pos.data();
  float *m = sc.m.data(), *l = sc.l.data(), *corr = sc.corr.data();
  const float** krows = sc.krows.data();
  const float** vrows = sc.vrows.data();
  const int64_t first_pos = pb.ctx - pb.t + i0, last_pos = first_pos + n - 1;
  for (int64_t r = 0; r < M; ++r) pos[r] = static_cast<float>(first_pos + std::min(r / G, n - 1));
  const float scale = pb.scale * 1.44269504088896341f;  // log2 e: the softmax runs in powers of 2
  for (int64_t r = 0; r < rows; ++r) {
    const float* src = pb.q + (i0 + r / G) * pb.q_token + (h * G + r % G) * pb.q_head;
    for (int64_t d = 0; d < hd; ++d) qt[d * M + r] = src[d] * scale;
  }
  const float* key_base = pb.keys + h * pb.head_stride;
  const float* value_base = pb.values + h * pb.head_stride;
  const float neg_inf = -std::numeric_limits<float>::infinity();
  for (int64_t k0 = 0; k0 <= last_pos; k0 += kKeys) {
    // keys past the last visible one point at it: every read stays inside the context, and the
    // mask drops them
    const int64_t num_keys = std::min(kKeys, last_pos + 1 - k0);
    for (int64_t j = 0, b = k0 / pb.block_size, o = k0 % pb.block_size; j < kKeys; ++j) {
      if (j < num_keys) {
        const int64_t offset = (pb.blocks[b] * pb.block_size + o) * hd;
        krows[j] = key_base + offset;
        vrows[j] = value_base + offset;
        if (++o == pb.block_size) o = 0, ++b;
      } else {
        krows[j] = krows[num_keys - 1];
        vrows[j] = vrows[num_keys - 1];
      }
    }
    for (int64_t j = 0; j < kKeys; j += kCols)
      for (int64_t r = 0; r < M; r += kRows) score_tile<FMA>(qt + r, M, krows + j, hd, st + j * M + r, M);
    const bool diagonal = k0 + kKeys - 1 > first_pos;  // some key here is past some row's position
    for (int64_t r = 0; r < M; r += 8) {
      const v8f row_pos = load8(pos + r);
      v8f best = load8(m + r);
      for (int64_t j = 0; j < kKeys; ++j) {
        v8f s = load8(st + j * M + r);
        if (diagonal) {
          s = static_cast<float>(k0 + j) <= row_pos ? s : neg_inf;
          store8(st + j * M + r, s);
        }
        best = s > best ? s : best;  // finite: every row sees key 0 in the first tile
      }
      const v8f c = exp2_nonpositive<FMA>(load8(m + r) - best);  // first tile: ~2^-125 times zeros
      store8(corr + r, c);
      store8(m + r, best);
      v8f sum = {};
      for (int64_t j = 0; j < kKeys; ++j) {
        const v8f s = load8(st + j * M + r);
        v8f p = exp2_nonpositive<FMA>(s - best);
        if (diagonal) p = s == neg_inf ? 0.f : p;
        store8(st + j * M + r, p);
        sum += p;
      }
      store8(l + r, load8(l + r) * c + sum);
    }
    for (int64_t r = 0; r < M; r += kRows) {
      int64_t d = 0;
      for (; d + kCols <= hd; d += kCols)
        value_tile<FMA, kCols>(st + r, M, vrows, d, num_keys, corr + r, ot + d * M + r, M);
      for (; d < hd; ++d)  // the remaining head dims, one at a time
        value_tile<FMA, 1>(st + r, M, vrows, d, num_keys, corr + r, ot + d * M + r, M);
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    const float inv = 1.f / l[r];
    float* dst = pb.out + ((i0 + r / G) * pb.nkv * G + h * G + r % G) * hd;
    for (int64_t d = 0; d < hd; ++d) dst[d] = ot[d * M + r] * inv;
  }
}

// The same tile compiled three times; gguf_linear.cpp's ISA choice (set_isa) picks one.
using TileFn = void (*)(const Problem&, int64_t, int64_t, int64_t, Scratch&);

__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma,avx2"))) void tile_avx512(
    const Problem& pb, int64_t h, int64_t i0, int64_t n, Scratch& sc) {
  attend_tile<true>(pb, h, i0, n, sc);
}

__attribute__((target("avx2,fma"))) void tile_avx2(const Problem& pb, int64_t h, int64_t i0, int64_t n,
                                                   Scratch& sc) {
  attend_tile<true>(pb, h, i0, n, sc);
}

void tile_scalar(const Problem& pb, int64_t h, int64_t i0, int64_t n, Scratch& sc) {
  attend_tile<false>(pb, h, i0, n, sc);
}

// Tasks pair query tile j with tile (count - 1 - j), so under the causal mask every task costs
// about the same and at::parallel_for's equal split of the task range balances the threads.
void attend(const Problem& pb, TileFn tile_fn) {
  const int64_t tt = pb.tokens_per_tile, tiles = (pb.t + tt - 1) / tt, pairs = (tiles + 1) / 2;
  at::parallel_for(0, pb.nkv * pairs, 1, [&](int64_t begin, int64_t end) {
    Scratch sc;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t h = task / pairs, j = task % pairs;
      const int64_t a = j * tt, b = (tiles - 1 - j) * tt;
      tile_fn(pb, h, a, std::min(tt, pb.t - a), sc);
      if (b != a) tile_fn(pb, h, b, std::min(tt, pb.t - b), sc);
    }
  });
}

}  // namespace

int splitserve_isa_level();  // gguf_linear.cpp: 2 avx512, 1 avx2, 0 scalar

torch::Tensor paged_prefill_attention(torch::Tensor q, torch::Tensor kv_layer, torch::Tensor block_ids,
                                      int64_t num_context_tokens, double scale) {
  // q: [t, nq, hd] (rows may be strided, as views of the fused qkv rows are); kv_layer:
  // [2, nkv, num_blocks, block_size, hd]; block_ids: [>= ceil(ctx / block_size)] int64 -> [t, nq, hd]
  TORCH_CHECK(q.dtype() == torch::kFloat && kv_layer.dtype() == torch::kFloat, "float32 q and cache only");
  TORCH_CHECK(kv_layer.dim() == 5 && kv_layer.is_contiguous(), "kv_layer: contiguous [2, nkv, blocks, bs, hd]");
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "q: [t, nq, hd] with unit stride along hd");
  TORCH_CHECK(block_ids.dtype() == torch::kLong && block_ids.dim() == 1, "block_ids: int64 [n]");
  block_ids = block_ids.contiguous();
  const int64_t t = q.size(0), nq = q.size(1), hd = q.size(2), ctx = num_context_tokens;
  const int64_t nkv = kv_layer.size(1), num_blocks = kv_layer.size(2), block_size = kv_layer.size(3);
  TORCH_CHECK(kv_layer.size(4) == hd && nq % nkv == 0, "q and cache disagree on heads or head_dim");
  TORCH_CHECK(t >= 1 && ctx >= t, "need 1 <= t <= num_context_tokens");
  TORCH_CHECK(block_ids.size(0) * block_size >= ctx, "block_ids do not cover num_context_tokens");
  const int64_t* blocks = block_ids.data_ptr<int64_t>();
  const int64_t used_blocks = (ctx + block_size - 1) / block_size;
  for (int64_t b = 0; b < used_blocks; ++b)
    TORCH_CHECK(blocks[b] >= 0 && blocks[b] < num_blocks, "block id out of range");
  auto out = torch::empty({t, nq, hd}, q.options());
  const int64_t group = nq / nkv;
  const float* kp = kv_layer.data_ptr<float>();
  const int64_t head_stride = num_blocks * block_size * hd;
  Problem pb{q.data_ptr<float>(), q.stride(0), q.stride(1), kp, kp + nkv * head_stride, head_stride, blocks,
             block_size, t, ctx, group, nkv, hd, std::max<int64_t>(1, kTaskRows / group),
             static_cast<float>(scale), out.data_ptr<float>()};
  const int level = splitserve_isa_level();
  attend(pb, level == 2 ? tile_avx512 : level == 1 ? tile_avx2 : tile_scalar);
  return out;
}
