// Causal prefill attention read in place from the paged KV cache, flash-style: a chunk's t queries
// sit at positions ctx - t .. ctx - 1 and query i sees keys 0 .. ctx - t + i, so one kernel covers
// a whole prompt (ctx == t) and a chunk after cached context, with no gather and no mask tensor.
//
// Per task (one KV head, a tile of query tokens with all `group` query heads of that KV head as
// rows, so each key tile is read once for the group), keys are walked 16 at a time with an online
// softmax (running max and sum per row; the accumulator is rescaled as the max grows). Tiles past
// the diagonal are skipped; only tiles that cross it are masked. S = Q K^T and O += P V are 6 x 16
// register tiles: 12 accumulators, two 8-float loads and one broadcast fit AVX2's 16 registers.
// The keys are first packed transposed ([hd][16] per tile) so S's tile reads whole vectors.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

#include "vec_math.h"

namespace {

constexpr int64_t kKeys = 16;   // keys per tile (one block of the default cache layout)
constexpr int64_t kRows = 6;    // query rows per register tile
constexpr int64_t kTokens = 16;  // query tokens per task tile (times `group` rows)

ALWAYS_INLINE v8f load8(const float* p) {
  v8f v;
  __builtin_memcpy(&v, p, sizeof v);
  return v;
}

ALWAYS_INLINE void store8(float* p, v8f v) { __builtin_memcpy(p, &v, sizeof v); }

ALWAYS_INLINE v8f splat(float x) { return v8f{} + x; }

// a * b + c; one rounding with FMA (the build's -ffp-contract=off keeps a * b + c two otherwise).
// The instructions are written out because intrinsics may not be inlined into these generic helpers
// (GCC refuses the target mismatch before they are inlined into the AVX2 and AVX-512 tiles).
// *p in every lane; one vbroadcastss from memory (GCC builds the generic splat from scalar inserts).
template <bool FMA>
ALWAYS_INLINE v8f broadcast(const float* p) {
  if constexpr (FMA) {
    v8f r;
    asm("vbroadcastss %[p], %[r]" : [r] "=x"(r) : [p] "m"(*p));
    return r;
  } else {
    return splat(*p);
  }
}

template <bool FMA>
ALWAYS_INLINE v8f madd(v8f a, v8f b, v8f c) {
  if constexpr (FMA) {
    asm("vfmadd231ps %[b], %[a], %[c]" : [c] "+x"(c) : [a] "x"(a), [b] "xm"(b));
    return c;
  } else {
    return a * b + c;
  }
}

ALWAYS_INLINE float hmax8(v8f v) {
  float m = v[0];
  for (int i = 1; i < 8; ++i) m = v[i] > m ? v[i] : m;
  return m;
}

// s[6][16] = q[6 rows, ldq apart] . kt[hdp][16]
template <bool FMA>
ALWAYS_INLINE void score_tile(const float* q, int64_t ldq, const float* kt, int64_t hdp, float* s) {
  v8f acc[kRows][2] = {};
  for (int64_t d = 0; d < hdp; ++d) {
    const v8f k0 = load8(kt + d * kKeys), k1 = load8(kt + d * kKeys + 8);
#pragma GCC unroll 6
    for (int r = 0; r < kRows; ++r) {
      const v8f qb = broadcast<FMA>(q + r * ldq + d);
      acc[r][0] = madd<FMA>(qb, k0, acc[r][0]);
      acc[r][1] = madd<FMA>(qb, k1, acc[r][1]);
    }
  }
#pragma GCC unroll 6
  for (int r = 0; r < kRows; ++r) {
    store8(s + r * kKeys, acc[r][0]);
    store8(s + r * kKeys + 8, acc[r][1]);
  }
}

// o[6 rows, ldo apart][16 columns] = o * corr[row] + p[6][0:n] . v[n rows, ldv apart][16 columns]
template <bool FMA>
ALWAYS_INLINE void value_tile(const float* p, const float* v, int64_t ldv, int64_t n, const float* corr, float* o,
                              int64_t ldo) {
  v8f acc[kRows][2];
#pragma GCC unroll 6
  for (int r = 0; r < kRows; ++r) {
    const v8f c = splat(corr[r]);
    acc[r][0] = load8(o + r * ldo) * c;
    acc[r][1] = load8(o + r * ldo + 8) * c;
  }
  for (int64_t j = 0; j < n; ++j) {
    const v8f v0 = load8(v + j * ldv), v1 = load8(v + j * ldv + 8);
#pragma GCC unroll 6
    for (int r = 0; r < kRows; ++r) {
      const v8f pb = broadcast<FMA>(p + r * kKeys + j);
      acc[r][0] = madd<FMA>(pb, v0, acc[r][0]);
      acc[r][1] = madd<FMA>(pb, v1, acc[r][1]);
    }
  }
#pragma GCC unroll 6
  for (int r = 0; r < kRows; ++r) {
    store8(o + r * ldo, acc[r][0]);
    store8(o + r * ldo + 8, acc[r][1]);
  }
}

struct Problem {
  const float* q;  // [t, nq, hd] with row strides q_token, q_head
  int64_t q_token, q_head;
  const float* kt;  // [nkv, num_key_tiles, hdp, 16] packed keys, zero past ctx and hd
  const float* values;  // [nkv] head bases: paged blocks, or packed [ctx, hdp] rows
  int64_t v_head;  // distance between heads' value bases
  bool values_packed;
  const int64_t* blocks;
  int64_t block_size;
  int64_t t, ctx, group, nkv, hd, hdp, num_key_tiles;
  float scale;
  float* out;  // [t, nq, hd]
};

// The value rows of key tile k0 for head h: a pointer and a row stride.
ALWAYS_INLINE const float* value_rows(const Problem& pb, int64_t h, int64_t k0, int64_t* ldv) {
  const float* base = pb.values + h * pb.v_head;
  if (pb.values_packed) {
    *ldv = pb.hdp;
    return base + k0 * pb.hdp;
  }
  *ldv = pb.hd;
  return base + (pb.blocks[k0 / pb.block_size] * pb.block_size + k0 % pb.block_size) * pb.hd;
}

struct Scratch {
  std::vector<float> q, o, s, m, mnew, corr, l;
  void reserve(int64_t rows, int64_t hdp) {
    q.resize(rows * hdp);
    o.resize(rows * hdp);
    s.resize(rows * kKeys);
    m.resize(rows);
    mnew.resize(rows);
    corr.resize(rows);
    l.resize(rows * 8);
  }
};

// Query tokens i0 .. i0 + n - 1 of KV head h: rows r = token * group + g, padded to a multiple of 6
// with copies of the last token's position (their results are dropped).
template <bool FMA>
ALWAYS_INLINE void attend_tile(const Problem& pb, int64_t h, int64_t i0, int64_t n, Scratch& sc) {
  const int64_t G = pb.group, hdp = pb.hdp, hd = pb.hd;
  const int64_t rows = n * G, padded = (rows + kRows - 1) / kRows * kRows;
  sc.reserve(padded, hdp);
  float *q = sc.q.data(), *o = sc.o.data(), *s = sc.s.data();
  float *m = sc.m.data(), *mnew = sc.mnew.data(), *corr = sc.corr.data(), *l = sc.l.data();
  std::fill(sc.q.begin(), sc.q.begin() + padded * hdp, 0.f);
  std::fill(sc.o.begin(), sc.o.begin() + padded * hdp, 0.f);
  std::fill(sc.l.begin(), sc.l.begin() + padded * 8, 0.f);
  std::fill(sc.m.begin(), sc.m.begin() + padded, -std::numeric_limits<float>::infinity());
  for (int64_t r = 0; r < rows; ++r) {
    const float* src = pb.q + (i0 + r / G) * pb.q_token + (h * G + r % G) * pb.q_head;
    for (int64_t d = 0; d < hd; ++d) q[r * hdp + d] = src[d] * pb.scale;
  }
  const int64_t first_pos = pb.ctx - pb.t + i0;  // the tile's first query position
  const int64_t last_pos = first_pos + n - 1;
  const v8f lane = {0, 1, 2, 3, 4, 5, 6, 7};
  const float neg_inf = -std::numeric_limits<float>::infinity();
  for (int64_t k0 = 0; k0 <= last_pos; k0 += kKeys) {
    const bool diagonal = k0 + kKeys - 1 > first_pos;
    const float* kt = pb.kt + (h * pb.num_key_tiles + k0 / kKeys) * hdp * kKeys;
    for (int64_t r = 0; r < padded; r += kRows) score_tile<FMA>(q + r * hdp, hdp, kt, hdp, s + r * kKeys);
    for (int64_t r = 0; r < padded; ++r) {
      v8f s0 = load8(s + r * kKeys), s1 = load8(s + r * kKeys + 8);
      if (diagonal) {  // key k0 + j is visible to this row while k0 + j <= its position
        const int64_t pos = first_pos + std::min(r / G, n - 1);
        const float visible = static_cast<float>(pos - k0);  // lanes j <= visible are kept
        s0 = lane <= visible ? s0 : neg_inf;
        s1 = lane + 8.f <= visible ? s1 : neg_inf;
        store8(s + r * kKeys, s0);
        store8(s + r * kKeys + 8, s1);
      }
      const float best = hmax8(s0 > s1 ? s0 : s1);
      mnew[r] = best > m[r] ? best : m[r];  // finite: every row sees key 0 in the first tile
    }
    for (int64_t r = 0; r < padded; r += 8) {
      v8f mo = {}, mn = {};
      const int64_t k = std::min<int64_t>(8, padded - r);
      __builtin_memcpy(&mo, m + r, k * sizeof(float));
      __builtin_memcpy(&mn, mnew + r, k * sizeof(float));
      const v8f c = exp8(mo - mn);  // exp(-inf) clamps to ~1e-38: times the zeros of a first tile
      __builtin_memcpy(corr + r, &c, k * sizeof(float));
      __builtin_memcpy(m + r, &mn, k * sizeof(float));
    }
    for (int64_t r = 0; r < padded; ++r) {
      const float mr = m[r];
      v8f s0 = load8(s + r * kKeys), s1 = load8(s + r * kKeys + 8);
      v8f p0 = exp8(s0 - mr), p1 = exp8(s1 - mr);
      if (diagonal) {
        p0 = s0 == neg_inf ? 0.f : p0;
        p1 = s1 == neg_inf ? 0.f : p1;
      }
      store8(s + r * kKeys, p0);
      store8(s + r * kKeys + 8, p1);
      store8(l + r * 8, load8(l + r * 8) * corr[r] + (p0 + p1));
    }
    int64_t ldv;
    const float* v = value_rows(pb, h, k0, &ldv);
    // rows past ctx (a partial last tile) may hold anything: never read them
    const int64_t nkeys = std::min(kKeys, last_pos + 1 - k0);
    for (int64_t c = 0; c < hdp; c += kKeys)
      for (int64_t r = 0; r < padded; r += kRows)
        value_tile<FMA>(s + r * kKeys, v + c, ldv, nkeys, corr + r, o + r * hdp + c, hdp);
  }
  for (int64_t r = 0; r < rows; ++r) {
    const v8f lr = load8(l + r * 8);
    const float inv = 1.f / (((lr[0] + lr[4]) + (lr[1] + lr[5])) + ((lr[2] + lr[6]) + (lr[3] + lr[7])));
    float* dst = pb.out + ((i0 + r / G) * pb.nkv * G + h * G + r % G) * hd;
    for (int64_t d = 0; d < hd; ++d) dst[d] = o[r * hdp + d] * inv;
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
  const int64_t tiles = (pb.t + kTokens - 1) / kTokens, pairs = (tiles + 1) / 2;
  at::parallel_for(0, pb.nkv * pairs, 1, [&](int64_t begin, int64_t end) {
    Scratch sc;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t h = task / pairs, j = task % pairs;
      const int64_t a = j * kTokens, b = (tiles - 1 - j) * kTokens;
      tile_fn(pb, h, a, std::min(kTokens, pb.t - a), sc);
      if (b != a) tile_fn(pb, h, b, std::min(kTokens, pb.t - b), sc);
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

  const int64_t hdp = (hd + kKeys - 1) / kKeys * kKeys, tiles = (ctx + kKeys - 1) / kKeys;
  const int64_t head_stride = num_blocks * block_size * hd;
  const float* kp = kv_layer.data_ptr<float>();
  const float* vp = kp + nkv * head_stride;
  auto key_row = [&](int64_t pos) { return (blocks[pos / block_size] * block_size + pos % block_size) * hd; };
  // A 16-key tile lies inside one block when blocks are whole tiles; value rows are then read in
  // place, else (and for a head_dim not a multiple of 16) copied to [ctx, hdp] rows first.
  const bool pack_values = block_size % kKeys != 0 || hd != hdp;
  std::vector<float> kt(static_cast<size_t>(nkv * tiles * hdp * kKeys), 0.f);
  std::vector<float> vpacked(pack_values ? static_cast<size_t>(nkv * tiles * kKeys * hdp) : 0, 0.f);
  at::parallel_for(0, nkv * tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t h = task / tiles, k0 = task % tiles * kKeys;
      float* dst = kt.data() + task * hdp * kKeys;
      for (int64_t j = 0; j < kKeys && k0 + j < ctx; ++j) {
        const float* src = kp + h * head_stride + key_row(k0 + j);
        for (int64_t d = 0; d < hd; ++d) dst[d * kKeys + j] = src[d];
        if (pack_values) {
          const float* vsrc = vp + h * head_stride + key_row(k0 + j);
          std::copy(vsrc, vsrc + hd, vpacked.data() + (h * tiles * kKeys + k0 + j) * hdp);
        }
      }
    }
  });

  Problem pb{q.data_ptr<float>(), q.stride(0), q.stride(1), kt.data(),
             pack_values ? vpacked.data() : vp, pack_values ? tiles * kKeys * hdp : head_stride, pack_values,
             blocks, block_size, t, ctx, nq / nkv, nkv, hd, hdp, tiles, static_cast<float>(scale),
             out.data_ptr<float>()};
  const int level = splitserve_isa_level();
  attend(pb, level == 2 ? tile_avx512 : level == 1 ? tile_avx2 : tile_scalar);
  return out;
}
