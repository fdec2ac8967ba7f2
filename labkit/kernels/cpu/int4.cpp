// 4-bit weight linear layer for decoding on a CPU: y (M, N) = x (M, K) W (N, K)^T + b, M small, with
// the weights read once per call for all M rows, as packed_linear (linear.cpp) does for fp32/bf16.
//
// Weights: groups of 32 along k, each with an fp16 scale s and minimum lo: w = s * q + lo, q in 0..15
// (labkit's own group-wise int4, 5 bits a weight with the scales). Activations: each row's groups of
// 32 are quantized to int8 with a scale of their own (sx = max|x| / 127, xq = round(x / sx)), as
// llama.cpp quantizes activations to Q8 blocks for its 4-bit dot products. So, per row r and column n,
//
//   y[r, n] = sum over groups g of  sx[r,g] * ( s[g,n] * sum_k xq[r,k] q[k,n]  +  lo[g,n] * sum_k xq[r,k] )
//
// where each inner sum is exact integer arithmetic: 32 products of an unsigned 4-bit and a signed 8-bit
// number. x86 does those 32 at a time (vpmaddubsw: u8 x s8, adjacent pairs summed into int16), so the
// arithmetic a row costs is a quarter of an fp32 FMA's per weight, and the 4-bit weights, unpacked
// once per k step into two registers, serve every row of the tile. The scales are applied once per
// group and row, in fp32.
//
// Layout (pack_int4 in __init__.py): blocks of NBQ = 16 output columns; per block, k in steps of 4
// ("quads"), 32 bytes per quad: byte i holds column i / 4 (k = 4 * quad + i % 4) of the first 8
// columns in its low nibble and of the next 8 in its high nibble, so one 32-byte load unpacks (and,
// shift) into the two u8 vectors vpmaddubsw takes against a row's 4 int8 activations broadcast.
// Scales: per block and group, 16 fp16 scales then 16 fp16 minimums.
//
// The group's integer sums are exact and a row's fp32 sum runs over the groups in order whatever M
// is, so a row's output has the same bits alone or in a call of 64 rows (batch invariance; checked by
// tests/test_cpu_kernels.py): a k-token verify reproduces k one-token steps exactly.
//
// 256-bit code on every x86 CPU with AVX2 (AVX-512 CPUs run it too); where the CPU has VNNI
// (vpdpbusd), one instruction replaces vpmaddubsw + the int16 sum + vpmaddwd.
#include <ATen/ATen.h>  // not torch/extension.h (the C++ frontend, pybind11): module.cpp alone needs it
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <vector>

void store_block(float* acc, int64_t M, int64_t width, int64_t n0, int64_t cols, const float* bias, void* y,
                 int64_t N, bool out_bf16);   // linear.cpp

namespace lk4 {

constexpr int NBQ = 16;           // output columns per packed block: two vectors of 8 int32 / fp32 lanes
constexpr int GROUP = 32;         // k per scale (weights) and per activation scale
constexpr int QUADS = GROUP / 4;  // 32-byte k steps per group
constexpr int MRQ = 4;            // rows per register tile: 4 x 2 accumulators + the weights fit 16 registers
constexpr int GC = 4;             // groups per chunk: 4 KB of weights, reused from L1 by each row tile
#if (defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__)
constexpr bool VNNI = true;
#else
constexpr bool VNNI = false;
#endif

// sum of u8 w x s8 x over each lane's 4 bytes, added to acc (int32 lanes)
static inline __m256i dot4(__m256i acc, __m256i w, __m256i x) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(acc, w, x);
#elif defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(acc, w, x);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1)));
#endif
}

// Each row's activations, quantized: xq (M, K) int8, per group sx and sx * sum(xq) (M, K/32) fp32.
template <typename T>
static void quantize_rows(const T* x, int64_t M, int64_t K, int8_t* xq, float* sx, float* sxsum) {
  const int64_t G = K / GROUP;
  at::parallel_for(0, M * G, 256, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      float xg[GROUP];                           // rows are contiguous, so group i of the whole (M, K)
      float amax = 0.f;
      for (int k = 0; k < GROUP; ++k) {
        xg[k] = (float)x[i * GROUP + k];
        amax = std::max(amax, std::fabs(xg[k]));
      }
      const float inv = amax > 0.f ? 127.f / amax : 0.f;
      int32_t sum = 0;
      for (int k = 0; k < GROUP; ++k) {
        const int32_t q = (int32_t)std::nearbyint(xg[k] * inv);    // round half to even, as torch.round
        xq[i * GROUP + k] = (int8_t)q;
        sum += q;
      }
      sx[i] = amax / 127.f;
      sxsum[i] = sx[i] * (float)sum;
    }
  });
}

// acc (R rows x NBQ fp32, row stride NBQ) += the groups [g0, g1) of block `wb` against rows `xq`.
template <int R>
static inline void tile(const int8_t* xq, int64_t K, const float* sx, const float* sxsum, int64_t G,
                        const uint8_t* wb, const uint16_t* sb, int64_t g0, int64_t g1, float* acc) {
  const __m256i low = _mm256_set1_epi8(0x0F);
  for (int64_t g = g0; g < g1; ++g) {
    __m256i isum[R][2];
    for (int r = 0; r < R; ++r) isum[r][0] = isum[r][1] = _mm256_setzero_si256();
    const uint8_t* w = wb + g * QUADS * 32;
    if constexpr (VNNI) {
      for (int q = 0; q < QUADS; ++q) {
        const __m256i raw = _mm256_loadu_si256((const __m256i*)(w + q * 32));
        const __m256i w0 = _mm256_and_si256(raw, low), w1 = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
        for (int r = 0; r < R; ++r) {
          const __m256i xb = _mm256_set1_epi32(*(const int32_t*)(xq + r * K + g * GROUP + q * 4));
          isum[r][0] = dot4(isum[r][0], w0, xb);
          isum[r][1] = dot4(isum[r][1], w1, xb);
        }
      }
    } else {
      // vpmaddubsw's int16 pair sums are at most 2 * 15 * 127 = 3810, so a group's 8 of them add up
      // in int16 without overflow (30480 < 32767); vpmaddwd widens them to int32 once per group
      __m256i s16[R][2];
      for (int r = 0; r < R; ++r) s16[r][0] = s16[r][1] = _mm256_setzero_si256();
      for (int q = 0; q < QUADS; ++q) {
        const __m256i raw = _mm256_loadu_si256((const __m256i*)(w + q * 32));
        const __m256i w0 = _mm256_and_si256(raw, low), w1 = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low);
        for (int r = 0; r < R; ++r) {
          const __m256i xb = _mm256_set1_epi32(*(const int32_t*)(xq + r * K + g * GROUP + q * 4));
          s16[r][0] = _mm256_add_epi16(s16[r][0], _mm256_maddubs_epi16(w0, xb));
          s16[r][1] = _mm256_add_epi16(s16[r][1], _mm256_maddubs_epi16(w1, xb));
        }
      }
      const __m256i ones = _mm256_set1_epi16(1);
      for (int r = 0; r < R; ++r)
        for (int j = 0; j < 2; ++j) isum[r][j] = _mm256_madd_epi16(s16[r][j], ones);
    }
    const uint16_t* sg = sb + g * 2 * NBQ;                               // 16 scales, then 16 minimums
    const __m256 s0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)sg));
    const __m256 s1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(sg + 8)));
    const __m256 lo0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(sg + NBQ)));
    const __m256 lo1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(sg + NBQ + 8)));
    for (int r = 0; r < R; ++r) {
      const __m256 c1 = _mm256_set1_ps(sx[r * G + g]), c2 = _mm256_set1_ps(sxsum[r * G + g]);
      float* a = acc + r * NBQ;
      __m256 a0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r][0]), _mm256_mul_ps(s0, c1), _mm256_loadu_ps(a));
      __m256 a1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r][1]), _mm256_mul_ps(s1, c1), _mm256_loadu_ps(a + 8));
      _mm256_storeu_ps(a, _mm256_fmadd_ps(lo0, c2, a0));
      _mm256_storeu_ps(a + 8, _mm256_fmadd_ps(lo1, c2, a1));
    }
  }
}

static void tile_rows(int rows, const int8_t* xq, int64_t K, const float* sx, const float* sxsum, int64_t G,
                      const uint8_t* wb, const uint16_t* sb, int64_t g0, int64_t g1, float* acc) {
  switch (rows) {
    case 1: return tile<1>(xq, K, sx, sxsum, G, wb, sb, g0, g1, acc);
    case 2: return tile<2>(xq, K, sx, sxsum, G, wb, sb, g0, g1, acc);
    case 3: return tile<3>(xq, K, sx, sxsum, G, wb, sb, g0, g1, acc);
    case 4: return tile<4>(xq, K, sx, sxsum, G, wb, sb, g0, g1, acc);
  }
}

static void gemm(const int8_t* xq, const float* sx, const float* sxsum, int64_t M, int64_t K, const uint8_t* wp,
                 const uint16_t* sp, int64_t N, const float* bias, void* y, bool out_bf16) {
  const int64_t n_blocks = (N + NBQ - 1) / NBQ, G = K / GROUP;
  const int64_t n_row_tiles = (M + MRQ - 1) / MRQ;
  at::parallel_for(0, n_blocks, 1, [&](int64_t b0, int64_t b1) {
    std::vector<float> acc(M * NBQ);
    for (int64_t b = b0; b < b1; ++b) {
      const uint8_t* wb = wp + b * (K / 4) * 32;
      const uint16_t* sb = sp + b * G * 2 * NBQ;
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t g0 = 0; g0 < G; g0 += GC) {
        const int64_t g1 = std::min(G, g0 + GC);
        if (g1 < G)                                        // the next chunk, into L2 while this one runs
          for (int64_t o = 0; o < GC * QUADS * 32; o += 64)
            _mm_prefetch((const char*)(wb + g1 * QUADS * 32 + o), _MM_HINT_T1);
        for (int64_t t = 0, m0 = 0; t < n_row_tiles; ++t) {
          const int rows = (int)((M - m0) / (n_row_tiles - t));  // balanced: 6 rows -> 3 + 3, not 4 + 2
          tile_rows(rows, xq + m0 * K, K, sx + m0 * G, sxsum + m0 * G, G, wb, sb, g0, g1, acc.data() + m0 * NBQ);
          m0 += rows;
        }
      }
      const int64_t n0 = b * NBQ;
      store_block(acc.data(), M, NBQ, n0, std::min<int64_t>(NBQ, N - n0), bias, y, N, out_bf16);
    }
  });
}

}  // namespace lk4

at::Tensor fp32_bias(const c10::optional<at::Tensor>& bias, int64_t N, const char* op);   // linear.cpp

at::Tensor int4_linear(at::Tensor x, at::Tensor wp, at::Tensor sp, int64_t N,
                          c10::optional<at::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "int4_linear: x must be a contiguous (M, K) tensor");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "int4_linear: x must be float32 or bfloat16, got ", x.scalar_type());
  const int64_t M = x.size(0), K = x.size(1), n_blocks = (N + lk4::NBQ - 1) / lk4::NBQ;
  TORCH_CHECK(K % lk4::GROUP == 0, "int4_linear: K must be a multiple of ", lk4::GROUP, ", got ", K);
  TORCH_CHECK(wp.scalar_type() == at::kByte && wp.is_contiguous() && wp.numel() == n_blocks * K / 4 * 32,
              "int4_linear: the packed weight does not fit x's K=", K, " and N=", N);
  TORCH_CHECK(sp.scalar_type() == at::kHalf && sp.is_contiguous() && sp.numel() == n_blocks * K / lk4::GROUP * 2 * lk4::NBQ,
              "int4_linear: the packed scales do not fit x's K=", K, " and N=", N);
  const at::Tensor bias32 = fp32_bias(bias, N, "int4_linear");
  const float* b = bias32.defined() ? bias32.data_ptr<float>() : nullptr;
  auto y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  const int64_t G = K / lk4::GROUP;
  std::vector<int8_t> xq(M * K);
  std::vector<float> sx(M * G), sxsum(M * G);
  if (x.scalar_type() == at::kFloat)
    lk4::quantize_rows(x.data_ptr<float>(), M, K, xq.data(), sx.data(), sxsum.data());
  else
    lk4::quantize_rows(x.data_ptr<at::BFloat16>(), M, K, xq.data(), sx.data(), sxsum.data());
  lk4::gemm(xq.data(), sx.data(), sxsum.data(), M, K, wp.data_ptr<uint8_t>(), (const uint16_t*)sp.data_ptr(), N, b,
            y.data_ptr(), x.scalar_type() == at::kBFloat16);
  return y;
}

bool int4_vnni() { return lk4::VNNI; }
