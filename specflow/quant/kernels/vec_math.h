// The float helpers the row-exact kernels share (attend_rows.cpp, layer_rows.cpp): each in
// a portable form and an AVX2 form that compute the same bits (the same operations in the
// same order; the sources are built with -ffp-contract=off, so no fma is fused in).
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace rowexact {

constexpr int kLanes = 8;

// ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7))
inline float lanes_sum(const float l[kLanes]) {
  return ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]));
}

inline float bits_float(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }
inline uint32_t float_bits(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }

// exp(x), x clamped to [-87, 88] and 0 below -87: x = n ln2 + t with n rounded half-even (by
// adding and subtracting 1.5 * 2^23) and |t| <= ln2 / 2, exp(t) by its Taylor polynomial to
// t^6 (Horner; 1-2 ulp), times 2^n built in the exponent bits.
inline float exp_clamped(float x) {
  const float kLog2e = 1.44269504088896341f, kShift = 12582912.0f;
  const float kLn2Hi = 0.693145751953125f, kLn2Lo = 1.42860682030941723e-6f;
  const bool tiny = x < -87.0f;
  const float xc = tiny ? -87.0f : (x > 88.0f ? 88.0f : x);
  const float shifted = xc * kLog2e + kShift;
  const float n = shifted - kShift;
  const float t = (xc - n * kLn2Hi) - n * kLn2Lo;
  float p = 1.0f / 720.0f;
  p = p * t + 1.0f / 120.0f;
  p = p * t + 1.0f / 24.0f;
  p = p * t + 1.0f / 6.0f;
  p = p * t + 0.5f;
  p = p * t + 1.0f;
  p = p * t + 1.0f;
  const int32_t ni = static_cast<int32_t>(float_bits(shifted) - float_bits(kShift));
  const float two_n = bits_float(static_cast<uint32_t>(ni + 127) << 23);
  return tiny ? 0.0f : p * two_n;
}

#if defined(__AVX2__)
inline float lanes_sum(__m256 v) {
  const __m128 t = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 u = _mm_add_ps(t, _mm_movehl_ps(t, t));  // (l0+l4)+(l2+l6), (l1+l5)+(l3+l7)
  return _mm_cvtss_f32(_mm_add_ss(u, _mm_movehdup_ps(u)));
}

inline __m256 exp_clamped(__m256 x) {
  const __m256 shift = _mm256_set1_ps(12582912.0f);
  const __m256 lo = _mm256_set1_ps(-87.0f);
  const __m256 tiny = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  const __m256 xc = _mm256_blendv_ps(_mm256_min_ps(x, _mm256_set1_ps(88.0f)), lo, tiny);
  const __m256 shifted =
      _mm256_add_ps(_mm256_mul_ps(xc, _mm256_set1_ps(1.44269504088896341f)), shift);
  const __m256 n = _mm256_sub_ps(shifted, shift);
  const __m256 t =
      _mm256_sub_ps(_mm256_sub_ps(xc, _mm256_mul_ps(n, _mm256_set1_ps(0.693145751953125f))),
                    _mm256_mul_ps(n, _mm256_set1_ps(1.42860682030941723e-6f)));
  __m256 p = _mm256_set1_ps(1.0f / 720.0f);
  p = _mm256_add_ps(_mm256_mul_ps(p, t), _mm256_set1_ps(1.0f / 120.0f));
  p = _mm256_add_ps(_mm256_mul_ps(p, t), _mm256_set1_ps(1.0f / 24.0f));
  p = _mm256_add_ps(_mm256_mul_ps(p, t), _mm256_set1_ps(1.0f / 6.0f));
  p = _mm256_add_ps(_mm256_mul_ps(p, t), _mm256_set1_ps(0.5f));
  p = _mm256_add_ps(_mm256_mul_ps(p, t), _mm256_set1_ps(1.0f));
  p = _mm256_add_ps(_mm256_mul_ps(p, t), _mm256_set1_ps(1.0f));
  const __m256i ni = _mm256_sub_epi32(_mm256_castps_si256(shifted), _mm256_castps_si256(shift));
  const __m256 two_n = _mm256_castsi256_ps(
      _mm256_slli_epi32(_mm256_add_epi32(ni, _mm256_set1_epi32(127)), 23));
  return _mm256_andnot_ps(tiny, _mm256_mul_ps(p, two_n));
}
#endif

}  // namespace rowexact
