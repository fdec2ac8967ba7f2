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
// 256-bit code on every x86 CPU with AVX2; where the CPU has VNNI (vpdpbusd), one instruction replaces
// vpmaddubsw + the int16 sum + vpmaddwd. Where it has AVX-512 VNNI, 512-bit code (tile512): a quad's 16 columns
// in one register, one vpdpbusd a row and quad, tiles of up to 8 rows; the same integers and fp32 fold, so the
// same bits as the 256-bit code.
//
// Where the CPU has AMX (Intel Xeon since Sapphire Rapids) a call of 2 or more rows goes to the tile
// unit instead: the vector code's integer work grows with the rows (16 vpdpbusd a row, group and
// block), and at 8 rows it takes longer than streaming the weights. On the tile unit two groups of a
// block are unpacked once into a B tile (16 rows x 64 bytes: k / 4 down, 16 columns x 4 k across), and
// one tdpbsud multiplies them with up to 8 rows of int8 activations laid out block-diagonally (row r:
// its first group's 32 values, then zeros; row 8 + r: zeros, then its second group's), which keeps the
// two groups' sums apart in one 16 x 16 int32 result, as their scales require. The sums are the same
// integers as the vector code's and the fold of the scales is the same fp32 arithmetic lane for lane,
// so the two paths give the same bits (tests/test_cpu_kernels.py) and a row's result still does not
// depend on how many rows share the call. The fold, not the multiply, is then most of the arithmetic:
// two FMAs a row, group and column.
#include <ATen/ATen.h>  // not torch/extension.h (the C++ frontend, pybind11): module.cpp alone needs it
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <algorithm>
#include <type_traits>
#include <vector>
#include "vec.h"
#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__AVX512F__)
#define LK4_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#else
#define LK4_AMX 0
#endif

void store_block(float* acc, int64_t M, int64_t width, int64_t n0, int64_t cols, const float* bias, void* y,
                 int64_t N, bool out_bf16);   // linear.cpp

namespace lk4 {

constexpr int NBQ = 16;           // output columns per packed block: two vectors of 8 lanes, or one of 16
constexpr int GROUP = 32;         // k per scale (weights) and per activation scale
constexpr int QUADS = GROUP / 4;  // 32-byte k steps per group
constexpr int GC = 4;             // groups per chunk: 1 KB of weights, reused from L1 by each row tile
#if (defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__)
constexpr bool VNNI = true;
#else
constexpr bool VNNI = false;
#endif
// 512-bit code where the CPU has AVX-512 VNNI (tile512): a quad's 16 columns x 4 k in one register
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define LK4_ZMM 1
constexpr int MRQ = 8;            // rows per register tile: 8 sums + 8 accumulators + the weights, of 32 registers
constexpr int VEC_PF_AHEAD = 4096;  // weights prefetched this many bytes ahead
constexpr int VEC_PF_ROWS = 2;      // and only for calls of at least this many rows
#else
#define LK4_ZMM 0
constexpr int MRQ = 4;            // rows per register tile: 4 x 2 accumulators + the weights fit 16 registers
constexpr int VEC_PF_AHEAD = GC * QUADS * 32;  // the next chunk
constexpr int VEC_PF_ROWS = 1;
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
#if defined(__AVX512F__)
      // 16 lanes at a time; cvtps rounds half to even, as torch.round does in int4_linear_ref
      using raw = std::conditional_t<sizeof(T) == 2, uint16_t, float>;        // bf16 as its bits, as vec.h reads it
      const raw* xr = (const raw*)x + i * GROUP;
      const __m512 x0 = lk::vload_as(xr), x1 = lk::vload_as(xr + 16);
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1)));
      const __m512 inv = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
      const __m512i q0 = _mm512_cvtps_epi32(_mm512_mul_ps(x0, inv)), q1 = _mm512_cvtps_epi32(_mm512_mul_ps(x1, inv));
      _mm_storeu_si128((__m128i*)(xq + i * GROUP), _mm512_cvtsepi32_epi8(q0));
      _mm_storeu_si128((__m128i*)(xq + i * GROUP + 16), _mm512_cvtsepi32_epi8(q1));
      sx[i] = amax / 127.f;
      sxsum[i] = sx[i] * (float)_mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
#else
      // the same arithmetic 8 lanes at a time (AVX2): four vectors a group, packed to int8 with saturation
      using raw = std::conditional_t<sizeof(T) == 2, uint16_t, float>;
      const raw* xr = (const raw*)x + i * GROUP;
      const __m256 sign = _mm256_set1_ps(-0.f);
      __m256 v[4], m = _mm256_setzero_ps();
      for (int j = 0; j < 4; ++j) {
        v[j] = lk::vload_as(xr + 8 * j);
        m = _mm256_max_ps(m, _mm256_andnot_ps(sign, v[j]));
      }
      const float amax = lk::hmax(m);
      const __m256 inv = _mm256_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
      __m256i q[4], sum = _mm256_setzero_si256();
      for (int j = 0; j < 4; ++j) {
        q[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], inv));
        sum = _mm256_add_epi32(sum, q[j]);
      }
      // packs work within 128-bit halves: dword d of the result is q[d % 4]'s lanes 0-3 (d < 4) or 4-7
      const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
      _mm256_storeu_si256((__m256i*)(xq + i * GROUP),
                          _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
      const __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
      const __m128i s2 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
      sx[i] = amax / 127.f;
      sxsum[i] = sx[i] * (float)_mm_cvtsi128_si32(_mm_add_epi32(s2, _mm_shuffle_epi32(s2, 0xB1)));
#endif
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

#if LK4_ZMM
// acc += w (u8) . x (s8), x being the 4 bytes at p in every lane: vpdpbusd with its memory operand broadcast
// ({1to16}), which the load unit serves; a separate vpbroadcastd would cost a vector operation a row and quad.
// Compilers do not fold _mm512_set1_epi32(*p) into the operand, hence the asm.
static inline __m512i dot4_bcast(__m512i acc, __m512i w, const int8_t* p) {
  __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*(const int32_t*)p));
  return acc;
}

// tile() in 512-bit registers: quad q's 32 bytes in both halves of one, the upper half shifted right by 4, so its
// low nibbles are columns 0-7 and its high nibbles columns 8-15, lane for lane as tile()'s w0 and w1; one vpdpbusd a
// row and quad. The accumulators stay in registers over the chunk's groups. Each lane's integer sum and fp32 fold
// are tile()'s, so the bits are the same (tests/test_cpu_kernels.py checks them against the AVX2 build).
template <int R>
static inline void tile512(const int8_t* xq, int64_t K, const float* sx, const float* sxsum, int64_t G,
                           const uint8_t* wb, const uint16_t* sb, int64_t g0, int64_t g1, float* acc) {
  const __m512i low = _mm512_set1_epi8(0x0F);
  __m512 a[R];
  for (int r = 0; r < R; ++r) a[r] = _mm512_loadu_ps(acc + r * NBQ);
  for (int64_t g = g0; g < g1; ++g) {
    __m512i isum[R];
    for (int r = 0; r < R; ++r) isum[r] = _mm512_setzero_si512();
    const uint8_t* w = wb + g * QUADS * 32;
    for (int q = 0; q < QUADS; ++q) {
      const __m512i raw = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i*)(w + q * 32)));
      const __m512i wq = _mm512_and_si512(_mm512_mask_srli_epi16(raw, 0xFFFF0000u, raw, 4), low);
      for (int r = 0; r < R; ++r)
        isum[r] = dot4_bcast(isum[r], wq, xq + r * K + g * GROUP + q * 4);
    }
    const uint16_t* sg = sb + g * 2 * NBQ;                               // 16 scales, then 16 minimums
    const __m512 s = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)sg));
    const __m512 lo = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(sg + NBQ)));
    for (int r = 0; r < R; ++r) {
      const __m512 c1 = _mm512_set1_ps(sx[r * G + g]), c2 = _mm512_set1_ps(sxsum[r * G + g]);
      a[r] = _mm512_fmadd_ps(lo, c2, _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[r]), _mm512_mul_ps(s, c1), a[r]));
    }
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(acc + r * NBQ, a[r]);
}
#endif

static void tile_rows(int rows, const int8_t* xq, int64_t K, const float* sx, const float* sxsum, int64_t G,
                      const uint8_t* wb, const uint16_t* sb, int64_t g0, int64_t g1, float* acc) {
#if LK4_ZMM
  switch (rows) {
    case 1: return tile512<1>(xq, K, sx, sxsum, G, wb, sb, g0, g1, acc);
    case 2: return tile512<2>(xq, K, sx, sxsum, G, wb, sb, g0, g1, acc);
    case 3: return tile512<3>(xq, K, sx, sxsum, G, wb, sb, g0, g1, acc);
    case 4: return tile512<4>(xq, K, sx, sxsum, G, wb, sb, g0, g1, acc);
    case 5: return tile512<5>(xq, K, sx, sxsum, G, wb, sb, g0, g1, acc);
    case 6: return tile512<6>(xq, K, sx, sxsum, G, wb, sb, g0, g1, acc);
    case 7: return tile512<7>(xq, K, sx, sxsum, G, wb, sb, g0, g1, acc);
    case 8: return tile512<8>(xq, K, sx, sxsum, G, wb, sb, g0, g1, acc);
  }
#else
  switch (rows) {
    case 1: return tile<1>(xq, K, sx, sxsum, G, wb, sb, g0, g1, acc);
    case 2: return tile<2>(xq, K, sx, sxsum, G, wb, sb, g0, g1, acc);
    case 3: return tile<3>(xq, K, sx, sxsum, G, wb, sb, g0, g1, acc);
    case 4: return tile<4>(xq, K, sx, sxsum, G, wb, sb, g0, g1, acc);
  }
#endif
}

static void gemm(const int8_t* xq, const float* sx, const float* sxsum, int64_t M, int64_t K, const uint8_t* wp,
                 const uint16_t* sp, int64_t N, const float* bias, void* y, bool out_bf16) {
  const int64_t n_blocks = (N + NBQ - 1) / NBQ, G = K / GROUP;
  const int64_t n_row_tiles = (M + MRQ - 1) / MRQ;
  const uint8_t* w_end = wp + n_blocks * (K / 4) * 32;
  at::parallel_for(0, n_blocks, 1, [&](int64_t b0, int64_t b1) {
    std::vector<float> acc(M * NBQ);
    for (int64_t b = b0; b < b1; ++b) {
      const uint8_t* wb = wp + b * (K / 4) * 32;
      const uint16_t* sb = sp + b * G * 2 * NBQ;
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t g0 = 0; g0 < G; g0 += GC) {
        const int64_t g1 = std::min(G, g0 + GC);
        // a chunk's worth of weights VEC_PF_AHEAD bytes ahead (blocks lie one after another) into L2. The 512-bit
        // code, whose chunks take less time, looks 4 KB ahead, and leaves one row, which waits on nothing but the
        // stream, to the hardware prefetcher (data/bench/int4_zmm_amd-epyc-zen5/)
        const uint8_t* ahead = wb + g0 * QUADS * 32 + VEC_PF_AHEAD;
        if (M >= VEC_PF_ROWS && ahead + GC * QUADS * 32 <= w_end)
          for (int64_t o = 0; o < GC * QUADS * 32; o += 64)
            _mm_prefetch((const char*)(ahead + o), _MM_HINT_T1);
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

#if LK4_AMX
constexpr int AMX_ROWS = 8;       // rows per chunk: a C tile holds two groups' sums of at most 8 rows each
constexpr int AGP = 4;            // group pairs per stage: unpacked, multiplied, then folded, each in one run
constexpr int PF_AHEAD = 2048;    // weights prefetched this many bytes ahead (of 1-8 KB, 2 KB measured best)

// Calls of more than 8 rows run in equal chunks of R rows; the rows past M are zeros.
static int64_t amx_chunks(int64_t M) { return (M + AMX_ROWS - 1) / AMX_ROWS; }
static int amx_chunk_rows(int64_t M) { return (int)((M + amx_chunks(M) - 1) / amx_chunks(M)); }

// Linux gives a process the AMX tile state only when it asks for it (arch_prctl); false where it refuses.
static bool amx_allowed() {
  static const bool ok = [] {
    constexpr int ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  }();
  return ok;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Two slots of three tiles, used in turn (tiles are not renamed: one slot would wait for each multiply and
// store): C (tiles 0, 1), 2R x 16 int32 sums; A (2, 3), 2R x 64 int8 activations; B (4, 5), 16 x 64 u8 weights.
static void configure_tiles(int R) {
  TileConfig c;
  for (int t = 0; t < 2; ++t) {
    c.rows[t] = 2 * R, c.colsb[t] = 64;
    c.rows[2 + t] = 2 * R, c.colsb[2 + t] = 64;
    c.rows[4 + t] = 2 * QUADS, c.colsb[4 + t] = 64;
  }
  _tile_loadconfig(&c);
}

// One group of a block (8 quads, 256 bytes) -> 8 rows of a B tile: row q is quad q's low nibbles (columns 0-7,
// 4 k each), then its high nibbles (columns 8-15), so B[q][4n + i] is column n's weight at k = 4q + i.
static inline void unpack_group(const uint8_t* w, uint8_t* b) {
  const __m512i low = _mm512_set1_epi8(0x0F);
  for (int q = 0; q < QUADS; q += 2) {
    const __m512i raw = _mm512_loadu_si512(w + q * 32);                          // quads q and q + 1
    const __m512i lo = _mm512_and_si512(raw, low), hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low);
    _mm512_storeu_si512(b + q * 64, _mm512_shuffle_i64x2(lo, hi, 0x44));         // lo q, hi q
    _mm512_storeu_si512(b + (q + 1) * 64, _mm512_shuffle_i64x2(lo, hi, 0xEE));   // lo q + 1, hi q + 1
  }
}

// The A tiles of every group pair: for each chunk of R rows and pair p, 2R rows of 64 bytes, block diagonal:
// row r is row r's group 2p activations then 32 zeros, row R + r is 32 zeros then its group 2p + 1. Against a
// B tile of both groups' weights one multiply gives group 2p's sums in C's first R rows and 2p + 1's in the
// next R: two groups a multiply and a store, as far apart as the scales require.
static std::vector<int8_t> pair_rows(const int8_t* xq, int64_t n_chunks, int R, int64_t K) {
  const int64_t G = K / GROUP, P = (G + 1) / 2;
  std::vector<int8_t> xd(n_chunks * P * 2 * R * 64, 0);
  for (int64_t ch = 0; ch < n_chunks; ++ch)
    for (int64_t p = 0; p < P; ++p)
      for (int h = 0; h < 2 && 2 * p + h < G; ++h)
        for (int r = 0; r < R; ++r)
          std::copy_n(xq + (ch * R + r) * K + (2 * p + h) * GROUP, GROUP,
                      xd.data() + ((ch * P + p) * 2 * R + h * R + r) * 64 + h * GROUP);
  return xd;
}

// A group pair's sums on tile slot S: B from the unpacked weights wt, A from the paired rows xd, the 2R x 16
// sums stored to c. (A macro: the tile intrinsics take literal tile numbers.)
#define LK4_PAIR_SUMS(S, C, A, B)                                                                       \
  static inline void pair_sums##S(const uint8_t* wt, const int8_t* xd, int32_t* c) {                    \
    _tile_loadd(B, wt, 64);                                                                              \
    _tile_loadd(A, xd, 64);                                                                              \
    _tile_zero(C);                                                                                       \
    _tile_dpbsud(C, A, B);                                                                               \
    _tile_stored(C, c, 64);                                                                              \
  }
LK4_PAIR_SUMS(0, 0, 2, 4)
LK4_PAIR_SUMS(1, 1, 3, 5)
#undef LK4_PAIR_SUMS

// One block of 16 columns on the tile unit: acc (n_chunks * R x 16 fp32) = its rows' products. AGP pairs of groups
// at a time: their weights unpacked once, then for each chunk of R rows multiplied (two groups a multiply) and
// folded with their scales as tile() folds them, lane for lane, the chunk's R accumulators in registers for the
// stage (in acc between stages). A call of many rows (a prompt) unpacks each weight once, not once per chunk.
// Each step runs over all AGP pairs before the next reads what it stored: a tile load of weights just stored by
// vector code, or a vector load of sums just stored from a tile, waits until the store reaches the cache.
template <int R>
static void block_amx(const int8_t* xd, const float* sx, const float* sxsum, int64_t n_chunks, int64_t K,
                      const uint8_t* wb, const uint16_t* sb, const uint8_t* w_end, uint8_t (*wt)[2 * QUADS * 64],
                      int32_t (*c)[2 * AMX_ROWS * NBQ], float* acc) {
  const int64_t G = K / GROUP, P = (G + 1) / 2;
  std::fill_n(acc, n_chunks * R * NBQ, 0.f);
  for (int64_t p0 = 0; p0 < P; p0 += AGP) {
    const int np = (int)std::min<int64_t>(AGP, P - p0);
    // weights PF_AHEAD bytes ahead (blocks lie one after another) into L2, a pair's worth beside each pair
    const uint8_t* ahead = wb + p0 * 2 * QUADS * 32 + PF_AHEAD;
    for (int j = 0; j < np; ++j) {
      if (ahead + (j + 1) * 2 * QUADS * 32 <= w_end)
        for (int o = 0; o < 2 * QUADS * 32; o += 64) _mm_prefetch((const char*)(ahead + j * 2 * QUADS * 32 + o), _MM_HINT_T1);
      for (int h = 0; h < 2 && 2 * (p0 + j) + h < G; ++h)
        unpack_group(wb + (2 * (p0 + j) + h) * QUADS * 32, wt[j] + h * QUADS * 64);
    }
    for (int64_t ch = 0; ch < n_chunks; ++ch) {
      const float* sxc = sx + ch * R * G, *sxsumc = sxsum + ch * R * G;
      float* ac = acc + ch * R * NBQ;
      __m512 a[R];
      for (int r = 0; r < R; ++r) a[r] = _mm512_loadu_ps(ac + r * NBQ);
      const int8_t* xc = xd + (ch * P + p0) * 2 * R * 64;
      for (int j = 0; j < np; ++j) {
        if (j % 2 == 0) pair_sums0(wt[j], xc + j * 2 * R * 64, c[j]);
        else pair_sums1(wt[j], xc + j * 2 * R * 64, c[j]);
      }
      for (int j = 0; j < np; ++j)
        for (int h = 0; h < 2; ++h) {
          const int64_t g = 2 * (p0 + j) + h;
          if (g >= G) break;
          const uint16_t* sg = sb + g * 2 * NBQ;                                  // 16 scales, then 16 minimums
          const __m512 sc = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)sg));
          const __m512 lo = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(sg + NBQ)));
          const int32_t* cg = c[j] + h * R * NBQ;
          for (int r = 0; r < R; ++r) {
            const __m512 c1 = _mm512_set1_ps(sxc[r * G + g]), c2 = _mm512_set1_ps(sxsumc[r * G + g]);
            a[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_loadu_si512(cg + r * NBQ)), _mm512_mul_ps(sc, c1), a[r]);
            a[r] = _mm512_fmadd_ps(lo, c2, a[r]);
          }
        }
      for (int r = 0; r < R; ++r) _mm512_storeu_ps(ac + r * NBQ, a[r]);
    }
  }
}

// gemm() on the tile unit. xq, sx and sxsum hold amx_chunks(M) * amx_chunk_rows(M) rows (those past M zero).
static void gemm_amx(const int8_t* xq, const float* sx, const float* sxsum, int64_t M, int64_t K,
                     const uint8_t* wp, const uint16_t* sp, int64_t N, const float* bias, void* y, bool out_bf16) {
  const int64_t n_blocks = (N + NBQ - 1) / NBQ, G = K / GROUP, n_chunks = amx_chunks(M);
  const int R = amx_chunk_rows(M);
  const std::vector<int8_t> xd = pair_rows(xq, n_chunks, R, K);
  decltype(&block_amx<1>) block = nullptr;
  switch (R) {
    case 1: block = block_amx<1>; break;
    case 2: block = block_amx<2>; break;
    case 3: block = block_amx<3>; break;
    case 4: block = block_amx<4>; break;
    case 5: block = block_amx<5>; break;
    case 6: block = block_amx<6>; break;
    case 7: block = block_amx<7>; break;
    default: block = block_amx<8>; break;
  }
  at::parallel_for(0, n_blocks, 1, [&](int64_t b0, int64_t b1) {
    configure_tiles(R);                                    // tile state is per thread
    std::vector<float> acc(n_chunks * R * NBQ);
    alignas(64) uint8_t wt[AGP][2 * QUADS * 64] = {};      // (an odd G's last pair: zero activations for its 2nd half)
    alignas(64) int32_t c[AGP][2 * AMX_ROWS * NBQ];
    for (int64_t b = b0; b < b1; ++b) {
      block(xd.data(), sx, sxsum, n_chunks, K, wp + b * (K / 4) * 32, sp + b * G * 2 * NBQ, wp + b1 * (K / 4) * 32,
            wt, c, acc.data());
      const int64_t n0 = b * NBQ;
      store_block(acc.data(), M, NBQ, n0, std::min<int64_t>(NBQ, N - n0), bias, y, N, out_bf16);
    }
    _tile_release();
  });
}
#endif

static bool amx_on = true;          // int4_use_amx(false): every call on the vector code (to compare the two)

// whether a call of M rows runs on the tile unit
static bool use_amx(int64_t M) {
#if LK4_AMX
  return amx_on && M >= 2 && amx_allowed();
#else
  (void)M;
  return false;
#endif
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
  const bool amx = lk4::use_amx(M);
#if LK4_AMX
  const int64_t rows = amx ? lk4::amx_chunks(M) * lk4::amx_chunk_rows(M) : M;   // the tile unit's chunks, padded
#else
  const int64_t rows = M;
#endif
  std::vector<int8_t> xq(rows * K, 0);
  std::vector<float> sx(rows * G, 0.f), sxsum(rows * G, 0.f);
  if (x.scalar_type() == at::kFloat)
    lk4::quantize_rows(x.data_ptr<float>(), M, K, xq.data(), sx.data(), sxsum.data());
  else
    lk4::quantize_rows(x.data_ptr<at::BFloat16>(), M, K, xq.data(), sx.data(), sxsum.data());
  const bool out_bf16 = x.scalar_type() == at::kBFloat16;
  const uint8_t* w = wp.data_ptr<uint8_t>();
  const uint16_t* s = (const uint16_t*)sp.data_ptr();
#if LK4_AMX
  if (amx) {
    lk4::gemm_amx(xq.data(), sx.data(), sxsum.data(), M, K, w, s, N, b, y.data_ptr(), out_bf16);
    return y;
  }
#endif
  lk4::gemm(xq.data(), sx.data(), sxsum.data(), M, K, w, s, N, b, y.data_ptr(), out_bf16);
  return y;
}

bool int4_vnni() { return lk4::VNNI; }
bool int4_amx() { return lk4::use_amx(2); }
bool int4_use_amx(bool on) {
  const bool was = lk4::amx_on;
  lk4::amx_on = on;
  return was;
}
