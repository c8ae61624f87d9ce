// 16-float vectors as GCC vector extensions, so one source becomes zmm code inside an AVX-512
// function, ymm pairs inside an AVX2 one and SSE in the baseline one; and e^x on them. A scalar
// loop around expf, even under `omp simd`, stays scalar: its clamps compile to branches.
#pragma once

#include <cstdint>

#define ALWAYS_INLINE inline __attribute__((always_inline))

typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));

ALWAYS_INLINE v16f load16(const float* p) {
  v16f v;
  __builtin_memcpy(&v, p, sizeof v);
  return v;
}

ALWAYS_INLINE void store16(float* p, v16f v) { __builtin_memcpy(p, &v, sizeof v); }

// e^x as Cephes' expf computes it: x = n ln2 + r, a degree-6 polynomial for e^r, 2^n from the
// exponent bits (as two factors, so n = 128 at x = 88 does not overflow one). x is clamped to
// [-87, 88]; within 2 ulp of expf.
ALWAYS_INLINE v16f exp16(v16f x) {
  const v16f lo = v16f{} - 87.f, hi = v16f{} + 88.f;
  x = x < lo ? lo : x;
  x = x > hi ? hi : x;
  const v16f t = x * 1.44269504088896341f + 0.5f;
  v16i ni = __builtin_convertvector(t, v16i);  // truncates toward zero ...
  ni += (__builtin_convertvector(ni, v16f) > t);  // ... so step down where that rounded up: floor
  const v16f n = __builtin_convertvector(ni, v16f);
  const v16f r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
  v16f p = r * 1.9875691500e-4f + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  const v16i half = ni >> 1;
  const v16f s1 = (v16f)((half + 127) << 23), s2 = (v16f)((ni - half + 127) << 23);
  return p * s1 * s2;
}
