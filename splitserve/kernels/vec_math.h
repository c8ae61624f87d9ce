// 16-float vectors as GCC vector extensions, so one source becomes zmm code inside an AVX-512
// function, ymm pairs inside an AVX2 one and SSE in the baseline one; and e^x on them (and on
// 8-float vectors, AVX2's own width). A scalar loop around expf, even under `omp simd`, stays
// scalar: its clamps compile to branches.
#pragma once

#include <cstdint>

#define ALWAYS_INLINE inline __attribute__((always_inline))

typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));

ALWAYS_INLINE v16f load16(const float* p) {
  v16f v;
  __builtin_memcpy(&v, p, sizeof v);
  return v;
}

ALWAYS_INLINE void store16(float* p, v16f v) { __builtin_memcpy(p, &v, sizeof v); }

// e^x as Cephes' expf computes it: x = n ln2 + r, a degree-6 polynomial for e^r, 2^n from the
// exponent bits (as two factors, so n = 128 at x = 88 does not overflow one). x is clamped to
// [-87, 88]; within 2 ulp of expf.
template <typename F, typename I>  // F: a float vector, I: the int32 vector of as many lanes
ALWAYS_INLINE F exp_lanes(F x) {
  const F lo = F{} - 87.f, hi = F{} + 88.f;
  x = x < lo ? lo : x;
  x = x > hi ? hi : x;
  const F t = x * 1.44269504088896341f + 0.5f;
  I ni = __builtin_convertvector(t, I);  // truncates toward zero ...
  ni += (__builtin_convertvector(ni, F) > t);  // ... so step down where that rounded up: floor
  const F n = __builtin_convertvector(ni, F);
  const F r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
  F p = r * 1.9875691500e-4f + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  const I half = ni >> 1;
  const F s1 = (F)((half + 127) << 23), s2 = (F)((ni - half + 127) << 23);
  return p * s1 * s2;
}

ALWAYS_INLINE v16f exp16(v16f x) { return exp_lanes<v16f, v16i>(x); }
ALWAYS_INLINE v8f exp8(v8f x) { return exp_lanes<v8f, v8i>(x); }
