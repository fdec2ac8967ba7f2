// The Python module: kernels/cpu/__init__.py builds it on first use with -march=native.
#include <torch/extension.h>

torch::Tensor pack_linear(torch::Tensor w);
torch::Tensor packed_linear(torch::Tensor x, torch::Tensor wp, int64_t N, c10::optional<torch::Tensor> bias);
bool have_bf16_dot();
torch::Tensor on_huge_pages(torch::Tensor t);
int64_t block_columns();
torch::Tensor int4_linear(torch::Tensor x, torch::Tensor wp, torch::Tensor sp, int64_t N,
                          c10::optional<torch::Tensor> bias);
bool int4_vnni();
bool int4_amx();
bool int4_use_amx(bool on);
torch::Tensor decode_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, c10::optional<torch::Tensor> mask,
                               double scale);
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps);
torch::Tensor rope(torch::Tensor x, torch::Tensor cos, torch::Tensor sin);
torch::Tensor silu_mul(torch::Tensor gate_up);
torch::Tensor packed_blocks(torch::Tensor x, torch::Tensor cos, torch::Tensor sin, torch::Tensor k_cache,
                            torch::Tensor v_cache, int64_t length, c10::optional<torch::Tensor> mask,
                            std::vector<torch::Tensor> layers, std::vector<int64_t> shape, double eps, double scale);
std::vector<torch::Tensor> packed_blocks_taps(torch::Tensor x, torch::Tensor cos, torch::Tensor sin,
                                              torch::Tensor k_cache, torch::Tensor v_cache, int64_t length,
                                              c10::optional<torch::Tensor> mask, std::vector<torch::Tensor> layers,
                                              std::vector<int64_t> shape, double eps, double scale,
                                              std::vector<int64_t> taps);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("pack_linear", &pack_linear, "pack an (N, K) weight once for packed_linear");
  m.def("packed_linear", &packed_linear, "y (M, N) = x (M, K) W^T + b with a packed W");
  m.def("on_huge_pages", &on_huge_pages, "a copy of a tensor on 2 MB pages (transparent huge pages, madvise)");
  m.def("have_bf16_dot", &have_bf16_dot, "whether bf16 weights use AVX512_BF16 dot products");
  m.def("block_columns", &block_columns, "output columns per packed weight block");
  m.def("int4_linear", &int4_linear, "y (M, N) = x (M, K) W^T + b with W packed as 4-bit groups (pack_int4)");
  m.def("int4_vnni", &int4_vnni, "whether int4_linear uses VNNI dot products (vpdpbusd)");
  m.def("int4_amx", &int4_amx, "whether int4_linear runs calls of 2+ rows on AMX tiles (tdpbsud)");
  m.def("int4_use_amx", &int4_use_amx, "allow (True) or forbid int4_linear the AMX tiles; returns the setting before");
  m.def("decode_attention", &decode_attention, "per-row attention of T queries over a KV cache");
  m.def("rms_norm", &rms_norm, "weight * x / rms(x), rounding as model.RMSNorm does");
  m.def("rope", &rope, "rotary position embedding of (B, H, T, hd)");
  m.def("silu_mul", &silu_mul, "silu(gate) * up of a fused (..., 2F) gate-up projection");
  m.def("packed_blocks", &packed_blocks, "every decoder block of one forward, the packed path's kernels in one call");
  m.def("packed_blocks_taps", &packed_blocks_taps, "packed_blocks and some layers' outputs (EAGLE-3's taps)");
}
