// A few SIMD operations on float vectors, one definition per ISA (AVX-512 or AVX2 + FMA), so the
// kernels in this folder read the same for both. Compiled with -march=native on the machine that runs
// them (kernels/cpu/__init__.py), so the widest ISA the CPU has is the one used.
#pragma once
#include <immintrin.h>
#include <cstdint>

#if defined(__AVX512F__)
namespace lk {
constexpr int VL = 16;                       // fp32 lanes per vector
typedef __m512 vf;
static inline vf vzero() { return _mm512_setzero_ps(); }
static inline vf vload(const float* p) { return _mm512_loadu_ps(p); }
static inline void vstore(float* p, vf v) { _mm512_storeu_ps(p, v); }
static inline vf vbcast(const float* p) { return _mm512_set1_ps(*p); }
static inline vf vset1(float x) { return _mm512_set1_ps(x); }
static inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
static inline vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
static inline vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
static inline vf vmax(vf a, vf b) { return _mm512_max_ps(a, b); }
static inline vf vmin(vf a, vf b) { return _mm512_min_ps(a, b); }
static inline vf vdiv(vf a, vf b) { return _mm512_div_ps(a, b); }
static inline float hsum(vf v) { return _mm512_reduce_add_ps(v); }
static inline float hmax(vf v) { return _mm512_reduce_max_ps(v); }
// bf16 -> fp32 is a 16-bit left shift of the bits
static inline vf vload_bf16(const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}
// fp32 -> bf16, round to nearest even (as torch's .to(torch.bfloat16)); NaN stays NaN
static inline void vstore_bf16(uint16_t* p, vf v) {
  __m512i bits = _mm512_castps_si512(v);
  __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
  __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  rounded = _mm512_mask_mov_epi32(rounded, nan, _mm512_or_si512(bits, _mm512_set1_epi32(0x400000)));
  _mm256_storeu_si256((__m256i*)p, _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16)));
}
static inline vf vscale2(vf x, vf n) { return _mm512_scalef_ps(x, n); }   // x * 2^n
static inline vf vfloor(vf x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC); }
}  // namespace lk
#elif defined(__AVX2__) && defined(__FMA__)
namespace lk {
constexpr int VL = 8;
typedef __m256 vf;
static inline vf vzero() { return _mm256_setzero_ps(); }
static inline vf vload(const float* p) { return _mm256_loadu_ps(p); }
static inline void vstore(float* p, vf v) { _mm256_storeu_ps(p, v); }
static inline vf vbcast(const float* p) { return _mm256_broadcast_ss(p); }
static inline vf vset1(float x) { return _mm256_set1_ps(x); }
static inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
static inline vf vmul(vf a, vf b) { return _mm256_mul_ps(a, b); }
static inline vf vadd(vf a, vf b) { return _mm256_add_ps(a, b); }
static inline vf vmax(vf a, vf b) { return _mm256_max_ps(a, b); }
static inline vf vmin(vf a, vf b) { return _mm256_min_ps(a, b); }
static inline vf vdiv(vf a, vf b) { return _mm256_div_ps(a, b); }
static inline float hsum(vf v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
static inline float hmax(vf v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}
static inline vf vload_bf16(const uint16_t* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}
static inline void vstore_bf16(uint16_t* p, vf v) {
  __m256i bits = _mm256_castps_si256(v);
  __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  __m256i rounded = _mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
  __m256 nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
  rounded = _mm256_castps_si256(_mm256_blendv_ps(_mm256_castsi256_ps(rounded),
      _mm256_castsi256_ps(_mm256_or_si256(bits, _mm256_set1_epi32(0x400000))), nan));
  __m256i hi = _mm256_srli_epi32(rounded, 16);                        // 8 x u32 holding the bf16 bits
  __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(hi), _mm256_extracti128_si256(hi, 1));
  _mm_storeu_si128((__m128i*)p, packed);
}
static inline vf vscale2(vf x, vf n) {                               // x * 2^n for integral n in [-126, 127]
  __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(x, _mm256_castsi256_ps(e));
}
static inline vf vfloor(vf x) { return _mm256_floor_ps(x); }
}  // namespace lk
#else
#error "labkit's CPU kernels need AVX2 with FMA, or AVX-512"
#endif

namespace lk {
// The same code for fp32 and bf16 tensors: bf16 is stored as its 16 raw bits (uint16_t).
static inline vf vload_as(const float* p) { return vload(p); }
static inline vf vload_as(const uint16_t* p) { return vload_bf16(p); }
static inline void vstore_as(float* p, vf v) { vstore(p, v); }
static inline void vstore_as(uint16_t* p, vf v) { vstore_bf16(p, v); }
// v rounded to the precision of T (a no-op for fp32), as torch rounds every bf16 op's result
template <typename T> static inline vf vround(vf v) {
  if constexpr (sizeof(T) == 2) { alignas(64) uint16_t b[VL]; vstore_bf16(b, v); return vload_bf16(b); }
  else return v;
}

// exp(x) = 2^(x log2 e) = 2^n * 2^f, f in [0, 1), 2^f by a degree-6 polynomial fitted for relative
// error (1.1e-7 in fp32); x is clamped to [-87, 88] (below: ~1e-38 instead of 0; above: no inf).
static inline vf vexp(vf x) {
  x = vmin(vmax(x, vset1(-87.0f)), vset1(88.0f));
  vf t = vmul(x, vset1(1.44269504088896341f));
  vf n = vfloor(t);
  vf f = vadd(t, vmul(n, vset1(-1.0f)));
  vf p = vset1(2.1690609e-4f);
  p = vfma(p, f, vset1(1.2443082e-3f));
  p = vfma(p, f, vset1(9.6784726e-3f));
  p = vfma(p, f, vset1(5.5483525e-2f));
  p = vfma(p, f, vset1(2.4022980e-1f));
  p = vfma(p, f, vset1(6.9314699e-1f));
  p = vfma(p, f, vset1(1.0f));
  return vscale2(p, n);
}
}  // namespace lk
