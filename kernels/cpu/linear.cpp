// Weight-streaming linear layer for decoding on a CPU: y (M, N) = x (M, K) W (N, K)^T + b, M small.
//
// At M = 1..32 rows a decode or verify step is bound by reading W from memory, not by arithmetic,
// if the kernel reads each weight once for all M rows and keeps computing while the next weights
// arrive. Stock BLAS calls for small M repack W on every call or run one row at a time. Here W is
// packed once, at load, into blocks of NBW output columns laid out k-major ([N/NBW][K][NBW]), so a
// block streams as one contiguous run; MR rows x NBW columns of accumulators stay in registers;
// the k loop is cut into chunks that stay in L1 while every row block reuses them, and the next
// chunk is prefetched into L2 during the current one so memory never waits for arithmetic (into L2,
// not L1: the current chunk and the next one together overflow a 32-48 KB L1, and prefetching into
// L1 evicted the chunk in use; on the Xeon with AMX the L2 hint made fp32 1-8 rows 13-20% faster
// and a bf16 row 10% faster).
//
// Each output y[m, n] is summed in the same order (k ascending, fp32) whatever M is: a row's result
// does not depend on how many rows share the call, so a k-token verify reproduces k one-token steps
// bit for bit (batch invariance; tests/test_cpu_kernels.py checks it).
//
// Weight formats (chosen by pack_linear from the weight's dtype and the CPU):
//   F32    fp32 W, fp32 x: FMA
//   BF16W  bf16 W widened to fp32 in registers, x converted to fp32 once: FMA (CPUs without bf16 dot)
//   BF16D  bf16 W as k pairs [N/NBW][K/2][NBW][2], bf16 x: AVX512_BF16 dot products (vdpbf16ps)
#include <ATen/ATen.h>  // not torch/extension.h (the C++ frontend, pybind11): module.cpp alone needs it
#include <ATen/Parallel.h>
#include <sys/mman.h>
#include <algorithm>
#include <vector>
#include "vec.h"

namespace lk {

#if defined(__AVX512F__)
constexpr int NV = 4;        // vectors per column block: 64 columns
#else
constexpr int NV = 2;        // AVX2 has 16 registers: 6 rows x 2 vectors of accumulators + 2 of weights
#endif
constexpr int NBW = NV * VL; // output columns per packed block
constexpr int MR = 6;        // rows per register tile (6 x 4 = 24 accumulators keep the FMA pipes full)
constexpr int KC = 128;      // k per chunk: 32 KB of fp32 weights per block, reused from L1 by each row tile
#if defined(__AVX512BF16__)
constexpr bool HAVE_BF16_DOT = true;
#else
constexpr bool HAVE_BF16_DOT = false;
#endif

enum Format { F32 = 0, BF16W = 1, BF16D = 2 };

// acc (R rows x NBW, fp32, row stride NBW) += x[rows, k0:k1] . W[block, k0:k1]; zero first if `first`.
// While it runs it prefetches `pf_bytes` per k step from `pf` (a slice of the next chunk).
template <int FMT, int R>
static inline void tile(const void* xv, int64_t ldx, const void* wv, int64_t k0, int64_t k1,
                        float* acc_out, bool first, const char* pf, int64_t pf_bytes) {
  vf acc[R][NV];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NV; ++j) acc[r][j] = first ? vzero() : vload(acc_out + r * NBW + j * VL);
  for (int64_t k = k0; k < k1; ++k) {
    if (pf)
      for (int64_t o = 0; o < pf_bytes; o += 64) _mm_prefetch(pf + (k - k0) * pf_bytes + o, _MM_HINT_T1);
    if constexpr (FMT == BF16D) {
#if defined(__AVX512BF16__)
      const uint16_t* w = (const uint16_t*)wv + k * 2 * NBW;      // k indexes pairs here
      const int32_t* x = (const int32_t*)xv;
      __m512bh wr[NV];
      for (int j = 0; j < NV; ++j) wr[j] = (__m512bh)_mm512_loadu_si512(w + j * 2 * VL);
      for (int r = 0; r < R; ++r) {
        __m512bh xb = (__m512bh)_mm512_set1_epi32(x[r * ldx + k]);
        for (int j = 0; j < NV; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], xb, wr[j]);
      }
#endif
    } else {
      const float* x = (const float*)xv;
      vf wr[NV];
      for (int j = 0; j < NV; ++j)
        wr[j] = FMT == F32 ? vload((const float*)wv + k * NBW + j * VL)
                           : vload_bf16((const uint16_t*)wv + k * NBW + j * VL);
      for (int r = 0; r < R; ++r) {
        vf xb = vbcast(x + r * ldx + k);
        for (int j = 0; j < NV; ++j) acc[r][j] = vfma(xb, wr[j], acc[r][j]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NV; ++j) vstore(acc_out + r * NBW + j * VL, acc[r][j]);
}

template <int FMT>
static void tile_rows(int rows, const void* x, int64_t ldx, const void* w, int64_t k0, int64_t k1, float* acc,
                      bool first, const char* pf, int64_t pf_bytes) {
  switch (rows) {
    case 1: return tile<FMT, 1>(x, ldx, w, k0, k1, acc, first, pf, pf_bytes);
    case 2:
      if constexpr (FMT == BF16D) {   // two one-row passes (the chunk stays in L1): measured 1.6x faster than
        tile<FMT, 1>(x, ldx, w, k0, k1, acc, first, pf, pf_bytes);             // a two-row tile on a Xeon
        return tile<FMT, 1>((const int32_t*)x + ldx, ldx, w, k0, k1, acc + NBW, first, nullptr, 0);
      }
      return tile<FMT, 2>(x, ldx, w, k0, k1, acc, first, pf, pf_bytes);
    case 3: return tile<FMT, 3>(x, ldx, w, k0, k1, acc, first, pf, pf_bytes);
    case 4: return tile<FMT, 4>(x, ldx, w, k0, k1, acc, first, pf, pf_bytes);
    case 5: return tile<FMT, 5>(x, ldx, w, k0, k1, acc, first, pf, pf_bytes);
    case 6: return tile<FMT, 6>(x, ldx, w, k0, k1, acc, first, pf, pf_bytes);
  }
}

}  // namespace lk

// A column block's accumulators acc (M rows x width fp32) + bias -> y[:, n0 : n0 + cols] (fp32 or bf16,
// rounded to nearest even); shared by packed_linear and int4_linear.
void store_block(float* acc, int64_t M, int64_t width, int64_t n0, int64_t cols, const float* bias, void* y,
                 int64_t N, bool out_bf16) {
  using namespace lk;
  for (int64_t m = 0; m < M; ++m) {
    float* a = acc + m * width;
    if (bias)
      for (int64_t c = 0; c < cols; ++c) a[c] += bias[n0 + c];
    if (!out_bf16) {
      std::copy(a, a + cols, (float*)y + m * N + n0);
    } else if (cols % VL == 0) {
      for (int64_t c = 0; c < cols; c += VL) vstore_bf16((uint16_t*)y + m * N + n0 + c, vload(a + c));
    } else {
      at::BFloat16* out = (at::BFloat16*)y + m * N + n0;
      for (int64_t c = 0; c < cols; ++c) out[c] = at::BFloat16(a[c]);
    }
  }
}

namespace lk {

// y (M, N) in x's dtype; x is fp32 (F32, BF16W) or bf16 pairs (BF16D); wp packed; bias fp32 (N) or null.
template <int FMT>
static void gemm(const void* x, int64_t M, int64_t K, const void* wp, int64_t N, const float* bias,
                 void* y, bool out_bf16) {
  const int64_t n_blocks = (N + NBW - 1) / NBW;
  const int64_t steps = FMT == BF16D ? K / 2 : K;                 // k steps (pairs for BF16D)
  const int64_t step_bytes = (FMT == F32 ? 4 : 2) * NBW * (FMT == BF16D ? 2 : 1);
  const int64_t chunk = FMT == BF16D ? KC / 2 : KC;
  const int64_t n_row_tiles = (M + MR - 1) / MR;
  at::parallel_for(0, n_blocks, 1, [&](int64_t b0, int64_t b1) {
    std::vector<float> acc(M * NBW);
    for (int64_t b = b0; b < b1; ++b) {
      const char* wb = (const char*)wp + b * steps * step_bytes;
      for (int64_t k0 = 0; k0 < steps; k0 += chunk) {
        const int64_t k1 = std::min(steps, k0 + chunk);
        // what to prefetch meanwhile: this block's next chunk, or the next block's first one
        const char* next = k1 < steps ? wb + k1 * step_bytes : (b + 1 < b1 ? wb + steps * step_bytes : nullptr);
        const int64_t slice = ((step_bytes + n_row_tiles - 1) / n_row_tiles + 63) / 64 * 64;
        for (int64_t t = 0, m0 = 0; t < n_row_tiles; ++t) {
          const int rows = (int)((M - m0) / (n_row_tiles - t));     // balanced: 8 rows -> 4 + 4, not 6 + 2
          const char* pf = next && t * slice < step_bytes ? next + t * slice * (k1 - k0) : nullptr;
          const char* xr = (const char*)x + m0 * (FMT == BF16D ? K * 2 : K * 4);
          tile_rows<FMT>(rows, xr, FMT == BF16D ? K / 2 : K, wb, k0, k1, acc.data() + m0 * NBW, k0 == 0, pf, slice);
          m0 += rows;
        }
      }
      const int64_t n0 = b * NBW;
      store_block(acc.data(), M, NBW, n0, std::min<int64_t>(NBW, N - n0), bias, y, N, out_bf16);
    }
  });
}

}  // namespace lk

// An uninitialised tensor on 2 MB pages where the kernel allows (transparent huge pages, madvise mode):
// streaming gigabytes of weights through 4 KB pages costs a TLB miss every 4 KB, and the hardware
// prefetchers stop at each page boundary.
at::Tensor empty_on_huge_pages(at::IntArrayRef shape, at::ScalarType dtype) {
  const int64_t huge = 2 << 20, bytes = c10::multiply_integers(shape) * c10::elementSize(dtype);
  auto raw = at::empty({bytes + huge}, at::TensorOptions().dtype(at::kByte));
  const uintptr_t p = (uintptr_t)raw.data_ptr(), aligned = (p + huge - 1) & ~(uintptr_t)(huge - 1);
  if (bytes >= huge) madvise((void*)aligned, (size_t)((bytes + huge - 1) / huge * huge), MADV_HUGEPAGE);
  return raw.narrow(0, (int64_t)(aligned - p), bytes).view(dtype).view(shape);
}

// (N, K) weight -> packed blocks; bf16 weights take the dot-product layout where the CPU has it.
at::Tensor pack_linear(at::Tensor w) {
  TORCH_CHECK(w.dim() == 2, "pack_linear: weight must be 2-D (N, K), got ", w.sizes());
  TORCH_CHECK(w.scalar_type() == at::kFloat || w.scalar_type() == at::kBFloat16,
              "pack_linear: weight must be float32 or bfloat16, got ", w.scalar_type());
  const int64_t N = w.size(0), K = w.size(1), n_blocks = (N + lk::NBW - 1) / lk::NBW;
  at::Tensor padded = w.contiguous();
  if (N % lk::NBW != 0) {  // zero rows up to a whole block (no copy where N fills its blocks, as it mostly does)
    padded = at::zeros({n_blocks * lk::NBW, K}, w.options());
    padded.narrow(0, 0, N).copy_(w);
  }
  if (w.scalar_type() == at::kBFloat16 && lk::HAVE_BF16_DOT && K % 2 == 0) {  // [Nb][K/2][NBW][2]
    // a k pair of bf16 is one 4-byte word: a transpose of words copies twice as fast as a permute of pairs
    at::Tensor out = empty_on_huge_pages({n_blocks, K / 2, lk::NBW, 2}, at::kBFloat16);
    out.view(at::kInt).squeeze(-1).copy_(padded.view(at::kInt).view({n_blocks, lk::NBW, K / 2}).transpose(1, 2));
    return out;
  }
  at::Tensor blocks = padded.view({n_blocks, lk::NBW, K}).transpose(1, 2);  // [Nb][K][NBW]
  return empty_on_huge_pages(blocks.sizes(), w.scalar_type()).copy_(blocks);
}

// A linear layer's optional bias as a contiguous fp32 (N) tensor (undefined where there is none), checked.
at::Tensor fp32_bias(const c10::optional<at::Tensor>& bias, int64_t N, const char* op) {
  if (!bias.has_value() || !bias->defined()) return at::Tensor();
  auto bias32 = bias->to(at::kFloat).contiguous();
  TORCH_CHECK(bias32.numel() == N, op, ": bias has ", bias32.numel(), " entries, expected ", N);
  return bias32;
}

at::Tensor packed_linear(at::Tensor x, at::Tensor wp, int64_t N, c10::optional<at::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "packed_linear: x must be a contiguous (M, K) tensor");
  const int64_t M = x.size(0), K = x.size(1);
  const bool dot = wp.dim() == 4;
  TORCH_CHECK(wp.size(0) * lk::NBW >= N && (dot ? wp.size(1) * 2 : wp.size(1)) == K,
              "packed_linear: x has K=", K, " but the packed weight does not fit it");
  TORCH_CHECK(x.scalar_type() == wp.scalar_type(), "packed_linear: x is ", x.scalar_type(),
              " but the weight was packed as ", wp.scalar_type());
  const at::Tensor bias32 = fp32_bias(bias, N, "packed_linear");
  const float* b = bias32.defined() ? bias32.data_ptr<float>() : nullptr;
  auto y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  const bool out_bf16 = x.scalar_type() == at::kBFloat16;
  if (x.scalar_type() == at::kFloat) {
    lk::gemm<lk::F32>(x.data_ptr(), M, K, wp.data_ptr(), N, b, y.data_ptr(), false);
  } else if (dot) {
    lk::gemm<lk::BF16D>(x.data_ptr(), M, K, wp.data_ptr(), N, b, y.data_ptr(), true);
  } else {
    auto x32 = x.to(at::kFloat);
    lk::gemm<lk::BF16W>(x32.data_ptr(), M, K, wp.data_ptr(), N, b, y.data_ptr(), out_bf16);
  }
  return y;
}

// A copy of `t` on 2 MB pages (for weights packed elsewhere, e.g. pack_int4).
at::Tensor on_huge_pages(at::Tensor t) {
  return empty_on_huge_pages(t.sizes(), t.scalar_type()).copy_(t);
}

bool have_bf16_dot() { return lk::HAVE_BF16_DOT; }
int64_t block_columns() { return lk::NBW; }
