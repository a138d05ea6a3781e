// The vector layer of commfold's vocab scans: W float lanes F, W int32 lanes I, a
// lane mask M, for AVX-512, AVX2 (+FMA, F16C), NEON or scalar code - the ISA ATen's
// vec headers (and Inductor's CPU kernels) use on this CPU, picked from the compiler's
// target (-march=native): tanh through at::vec is then Inductor's tanh, bit for bit.
#pragma once
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512DQ__)
#define CPU_CAPABILITY_AVX512
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define CPU_CAPABILITY_AVX2
#elif defined(__aarch64__) && defined(__ARM_NEON)
#define CPU_CAPABILITY_NEON
#define AT_BUILD_ARM_VEC256_WITH_SLEEF
#endif
#include <ATen/cpu/vec/vec.h>
#include <c10/util/Half.h>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#elif defined(CPU_CAPABILITY_NEON)
#include <arm_neon.h>
#endif

namespace commfold_scan {

constexpr float kInf = std::numeric_limits<float>::infinity();
enum Dt { F32 = 0, BF16 = 1, F16 = 2 };  // also the chain's cast codes (chain_encoding.py)

namespace simd {
#if defined(CPU_CAPABILITY_AVX512)
constexpr int W = 16;
using F = __m512;
using I = __m512i;
using M = __mmask16;
inline F loadf(const float* p) { return _mm512_loadu_ps(p); }
inline F loadbf(const uint16_t* p) {
  const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}
inline F loadh(const uint16_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p)); }
inline void store(float* p, F v) { _mm512_storeu_ps(p, v); }
inline void storei(int32_t* p, I v) { _mm512_storeu_si512(p, v); }
inline F splat(float v) { return _mm512_set1_ps(v); }
inline I splati(int32_t v) { return _mm512_set1_epi32(v); }
inline I iota() { return _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15); }
inline I addi(I a, I b) { return _mm512_add_epi32(a, b); }
inline F add(F a, F b) { return _mm512_add_ps(a, b); }
inline F sub(F a, F b) { return _mm512_sub_ps(a, b); }
inline F mul(F a, F b) { return _mm512_mul_ps(a, b); }
inline F div(F a, F b) { return _mm512_div_ps(a, b); }
inline F vmax(F a, F b) { return _mm512_max_ps(a, b); }  // NaN-free inputs only
inline M gt(F a, F b) { return _mm512_cmp_ps_mask(a, b, _CMP_GT_OQ); }
inline M gt_or_nan(F a, F b) { return _mm512_cmp_ps_mask(a, b, _CMP_NLE_UQ); }
inline M isnan(F a) { return _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q); }
inline M below(int n) { return (M)((1u << n) - 1u); }  // lanes [0, n), n < W
inline M mor(M a, M b) { return a | b; }
inline M mand(M a, M b) { return a & b; }
inline uint32_t bits(M m) { return m; }
inline F blend(M m, F a, F b) { return _mm512_mask_blend_ps(m, a, b); }  // m ? b : a
inline I blendi(M m, I a, I b) { return _mm512_mask_blend_epi32(m, a, b); }
inline F round_bf16(F v) {  // round to nearest even on the bits (NaN: handled by caller)
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), lsb);
  return _mm512_castsi512_ps(_mm512_and_si512(r, _mm512_set1_epi32((int)0xFFFF0000u)));
}
inline F round_f16(F v) {
  return _mm512_cvtph_ps(_mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
struct Acc {  // f64 sums of f32 lanes
  __m512d lo = _mm512_setzero_pd(), hi = _mm512_setzero_pd();
  void add(F v) {
    lo = _mm512_add_pd(lo, _mm512_cvtps_pd(_mm512_castps512_ps256(v)));
    hi = _mm512_add_pd(hi, _mm512_cvtps_pd(
        _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1))));
  }
  void scale(double f) {
    lo = _mm512_mul_pd(lo, _mm512_set1_pd(f));
    hi = _mm512_mul_pd(hi, _mm512_set1_pd(f));
  }
  double sum() const { return _mm512_reduce_add_pd(_mm512_add_pd(lo, hi)); }
};
#elif defined(CPU_CAPABILITY_AVX2)
constexpr int W = 8;
using F = __m256;
using I = __m256i;
using M = __m256;
inline F loadf(const float* p) { return _mm256_loadu_ps(p); }
inline F loadbf(const uint16_t* p) {
  const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}
inline F loadh(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)); }
inline void store(float* p, F v) { _mm256_storeu_ps(p, v); }
inline void storei(int32_t* p, I v) { _mm256_storeu_si256((__m256i*)p, v); }
inline F splat(float v) { return _mm256_set1_ps(v); }
inline I splati(int32_t v) { return _mm256_set1_epi32(v); }
inline I iota() { return _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7); }
inline I addi(I a, I b) { return _mm256_add_epi32(a, b); }
inline F add(F a, F b) { return _mm256_add_ps(a, b); }
inline F sub(F a, F b) { return _mm256_sub_ps(a, b); }
inline F mul(F a, F b) { return _mm256_mul_ps(a, b); }
inline F div(F a, F b) { return _mm256_div_ps(a, b); }
inline F vmax(F a, F b) { return _mm256_max_ps(a, b); }
inline M gt(F a, F b) { return _mm256_cmp_ps(a, b, _CMP_GT_OQ); }
inline M gt_or_nan(F a, F b) { return _mm256_cmp_ps(a, b, _CMP_NLE_UQ); }
inline M isnan(F a) { return _mm256_cmp_ps(a, a, _CMP_UNORD_Q); }
inline M below(int n) {
  return _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(n), iota()));
}
inline M mor(M a, M b) { return _mm256_or_ps(a, b); }
inline M mand(M a, M b) { return _mm256_and_ps(a, b); }
inline uint32_t bits(M m) { return (uint32_t)_mm256_movemask_ps(m); }
inline F blend(M m, F a, F b) { return _mm256_blendv_ps(a, b, m); }
inline I blendi(M m, I a, I b) {
  return _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(a), _mm256_castsi256_ps(b), m));
}
inline F round_bf16(F v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), lsb);
  return _mm256_castsi256_ps(_mm256_and_si256(r, _mm256_set1_epi32((int)0xFFFF0000u)));
}
inline F round_f16(F v) {
  return _mm256_cvtph_ps(_mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
struct Acc {
  __m256d lo = _mm256_setzero_pd(), hi = _mm256_setzero_pd();
  void add(F v) {
    lo = _mm256_add_pd(lo, _mm256_cvtps_pd(_mm256_castps256_ps128(v)));
    hi = _mm256_add_pd(hi, _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1)));
  }
  void scale(double f) {
    lo = _mm256_mul_pd(lo, _mm256_set1_pd(f));
    hi = _mm256_mul_pd(hi, _mm256_set1_pd(f));
  }
  double sum() const {
    alignas(32) double t[4];
    _mm256_store_pd(t, _mm256_add_pd(lo, hi));
    return (t[0] + t[1]) + (t[2] + t[3]);
  }
};
#elif defined(CPU_CAPABILITY_NEON)
constexpr int W = 4;
using F = float32x4_t;
using I = int32x4_t;
using M = uint32x4_t;
inline F loadf(const float* p) { return vld1q_f32(p); }
inline F loadbf(const uint16_t* p) { return vreinterpretq_f32_u32(vshll_n_u16(vld1_u16(p), 16)); }
inline F loadh(const uint16_t* p) { return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(p))); }
inline void store(float* p, F v) { vst1q_f32(p, v); }
inline void storei(int32_t* p, I v) { vst1q_s32(p, v); }
inline F splat(float v) { return vdupq_n_f32(v); }
inline I splati(int32_t v) { return vdupq_n_s32(v); }
inline I iota() { const int32_t t[4] = {0, 1, 2, 3}; return vld1q_s32(t); }
inline I addi(I a, I b) { return vaddq_s32(a, b); }
inline F add(F a, F b) { return vaddq_f32(a, b); }
inline F sub(F a, F b) { return vsubq_f32(a, b); }
inline F mul(F a, F b) { return vmulq_f32(a, b); }
inline F div(F a, F b) { return vdivq_f32(a, b); }
inline F vmax(F a, F b) { return vmaxq_f32(a, b); }
inline M gt(F a, F b) { return vcgtq_f32(a, b); }
inline M gt_or_nan(F a, F b) { return vmvnq_u32(vcleq_f32(a, b)); }
inline M isnan(F a) { return vmvnq_u32(vceqq_f32(a, a)); }
inline M below(int n) { return vcltq_s32(iota(), vdupq_n_s32(n)); }
inline M mor(M a, M b) { return vorrq_u32(a, b); }
inline M mand(M a, M b) { return vandq_u32(a, b); }
inline uint32_t bits(M m) {
  const uint32_t t[4] = {1, 2, 4, 8};
  return vaddvq_u32(vandq_u32(m, vld1q_u32(t)));
}
inline F blend(M m, F a, F b) { return vbslq_f32(m, b, a); }
inline I blendi(M m, I a, I b) { return vbslq_s32(m, b, a); }
inline F round_bf16(F v) {
  const uint32x4_t u = vreinterpretq_u32_f32(v);
  const uint32x4_t lsb = vandq_u32(vshrq_n_u32(u, 16), vdupq_n_u32(1));
  const uint32x4_t r = vaddq_u32(vaddq_u32(u, vdupq_n_u32(0x7FFF)), lsb);
  return vreinterpretq_f32_u32(vandq_u32(r, vdupq_n_u32(0xFFFF0000u)));
}
inline F round_f16(F v) { return vcvt_f32_f16(vcvt_f16_f32(v)); }
struct Acc {
  float64x2_t lo = vdupq_n_f64(0), hi = vdupq_n_f64(0);
  void add(F v) {
    lo = vaddq_f64(lo, vcvt_f64_f32(vget_low_f32(v)));
    hi = vaddq_f64(hi, vcvt_high_f64_f32(v));
  }
  void scale(double f) {
    lo = vmulq_n_f64(lo, f);
    hi = vmulq_n_f64(hi, f);
  }
  double sum() const { return vaddvq_f64(vaddq_f64(lo, hi)); }
};
#else  // scalar
constexpr int W = 1;
using F = float;
using I = int32_t;
using M = bool;
inline F loadf(const float* p) { return *p; }
inline F loadbf(const uint16_t* p) {
  const uint32_t u = (uint32_t)*p << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline F loadh(const uint16_t* p) { return c10::detail::fp16_ieee_to_fp32_value(*p); }
inline void store(float* p, F v) { *p = v; }
inline void storei(int32_t* p, I v) { *p = v; }
inline F splat(float v) { return v; }
inline I splati(int32_t v) { return v; }
inline I iota() { return 0; }
inline I addi(I a, I b) { return a + b; }
inline F add(F a, F b) { return a + b; }
inline F sub(F a, F b) { return a - b; }
inline F mul(F a, F b) { return a * b; }
inline F div(F a, F b) { return a / b; }
inline F vmax(F a, F b) { return a > b ? a : b; }
inline M gt(F a, F b) { return a > b; }
inline M gt_or_nan(F a, F b) { return !(a <= b); }
inline M isnan(F a) { return a != a; }
inline M below(int n) { return n > 0; }
inline M mor(M a, M b) { return a || b; }
inline M mand(M a, M b) { return a && b; }
inline uint32_t bits(M m) { return m ? 1u : 0u; }
inline F blend(M m, F a, F b) { return m ? b : a; }
inline I blendi(M m, I a, I b) { return m ? b : a; }
inline F round_bf16(F v) {
  uint32_t u;
  std::memcpy(&u, &v, 4);
  u = (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline F round_f16(F v) {
  return c10::detail::fp16_ieee_to_fp32_value(c10::detail::fp16_ieee_from_fp32_value(v));
}
struct Acc {
  double s = 0;
  void add(F v) { s += v; }
  void scale(double f) { s *= f; }
  double sum() const { return s; }
};
#endif

// tanh and exp as Inductor's CPU kernels compute them (at::vec: Sleef where vectorized)
inline F vtanh(F v) {
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_NEON)
  return static_cast<F>(at::vec::Vectorized<float>(v).tanh());
#else
  return std::tanh(v);
#endif
}
// exp for the softmax sums: Cephes' expf (Cody-Waite reduction, degree-6 polynomial,
// ~1 ulp) in FMA form - about twice Sleef's u10 speed; 0 below -87.3 (and for -inf).
// Only the statistics' float64 sums use it (no value is compared bit for bit).
inline F vexp(F x) {
#if defined(CPU_CAPABILITY_AVX512)
  x = _mm512_max_ps(x, _mm512_set1_ps(-104.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  const __m512 y = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(y, n);
#elif defined(CPU_CAPABILITY_AVX2)
  const __m256 tiny = _mm256_cmp_ps(x, _mm256_set1_ps(-87.3f), _CMP_LT_OQ);
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  const __m256 y = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(tiny, _mm256_mul_ps(y, _mm256_castsi256_ps(e)));
#elif defined(CPU_CAPABILITY_NEON)
  return static_cast<F>(at::vec::Vectorized<float>(x).exp());
#else
  return std::exp(x);
#endif
}
inline float hmax(F v) {  // NaN-free
  alignas(64) float t[W];
  store(t, v);
  float m = t[0];
  for (int j = 1; j < W; ++j) m = t[j] > m ? t[j] : m;
  return m;
}
inline int first_lane(uint32_t b) { return __builtin_ctz(b); }
}  // namespace simd

}  // namespace commfold_scan
