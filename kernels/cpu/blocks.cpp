// Every decoder block of one forward in a single call from Python (models/fused.py). The same kernels as the
// packed path's modules, called in the order transformer.Block calls them, so the result is bit for bit the
// module-by-module forward's; what goes away is Python's cost of calling some 25 small operations a layer,
// which on a 1-token step of a small draft model is about a quarter of its time.
#include <torch/extension.h>

#include <algorithm>
#include <vector>

at::Tensor packed_linear(at::Tensor x, at::Tensor wp, int64_t N, c10::optional<at::Tensor> bias);
at::Tensor int4_linear(at::Tensor x, at::Tensor wp, at::Tensor sp, int64_t N, c10::optional<at::Tensor> bias);
at::Tensor decode_attention(at::Tensor q, at::Tensor k, at::Tensor v, c10::optional<at::Tensor> mask, double scale);
at::Tensor rms_norm(at::Tensor x, at::Tensor weight, double eps);
at::Tensor rope(at::Tensor x, at::Tensor cos, at::Tensor sin);
at::Tensor silu_mul(at::Tensor gate_up);

namespace lkb {

constexpr int PER_LINEAR = 3;                       // packed weight, int4 scales (empty: bf16/fp32), bias (empty: none)
constexpr int PER_LAYER = 2 + 4 * PER_LINEAR;       // input norm, post-attention norm, qkv, o, gate_up, down

static c10::optional<at::Tensor> given(const at::Tensor& t) {
  return t.numel() ? c10::optional<at::Tensor>(t) : c10::nullopt;
}

// x (..., K) -> (..., N) through one packed linear: w[0] the packed weight, w[1] its int4 scales, w[2] its bias
static at::Tensor linear(const at::Tensor& x, const at::Tensor* w, int64_t N) {
  auto x2 = x.reshape({-1, x.size(-1)}).contiguous();                                  // (M, K)
  auto y = w[1].numel() ? int4_linear(x2, w[0], w[1], N, given(w[2])) : packed_linear(x2, w[0], N, given(w[2]));
  auto sizes = x.sizes().vec();
  sizes.back() = N;
  return y.view(sizes);
}

}  // namespace lkb

// x (B, T, D) through every layer; k_cache, v_cache (L, B, Hkv, S, hd), written at slots [length, length + T).
// layers: PER_LAYER tensors a layer (see above); shape: n_heads, n_kv_heads, head_dim, hidden_dim; scale: the
// attention's, hd^-0.5 as Python computes it. taps: layers whose outputs go into *tapped, in order (EAGLE-3 reads
// three of them).
static at::Tensor run_blocks(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& k_cache,
                             const at::Tensor& v_cache, int64_t length, const c10::optional<at::Tensor>& mask,
                             const std::vector<at::Tensor>& layers, const std::vector<int64_t>& shape, double eps,
                             double scale, const std::vector<int64_t>& taps, std::vector<at::Tensor>* tapped) {
  TORCH_CHECK(x.dim() == 3 && shape.size() == 4, "packed_blocks: x must be (B, T, D), shape (H, Hkv, hd, F)");
  const int64_t L = k_cache.size(0), B = x.size(0), T = x.size(1), D = x.size(2);
  const int64_t H = shape[0], Hkv = shape[1], hd = shape[2], F = shape[3];
  TORCH_CHECK((int64_t)layers.size() == L * lkb::PER_LAYER, "packed_blocks: ", layers.size(), " tensors for ", L,
              " layers, need ", lkb::PER_LAYER, " a layer");
  TORCH_CHECK(length + T <= k_cache.size(3), "packed_blocks: ", length, " cached + ", T,
              " new tokens exceed the cache");
  const int64_t q_dim = H * hd, kv_dim = Hkv * hd, end = length + T;
  for (int64_t l = 0; l < L; ++l) {
    const at::Tensor* w = layers.data() + l * lkb::PER_LAYER;
    auto h = rms_norm(x, w[0], eps);
    auto qkv = lkb::linear(h, w + 2, q_dim + 2 * kv_dim).split_with_sizes({q_dim, kv_dim, kv_dim}, -1);
    auto q = rope(qkv[0].view({B, T, H, hd}).transpose(1, 2), cos, sin);             // (B, H, T, hd)
    auto k = rope(qkv[1].view({B, T, Hkv, hd}).transpose(1, 2), cos, sin);           // (B, Hkv, T, hd)
    auto v = qkv[2].view({B, T, Hkv, hd}).transpose(1, 2);                           // (B, Hkv, T, hd)
    auto k_all = k_cache.select(0, l), v_all = v_cache.select(0, l);                 // (B, Hkv, S, hd)
    k_all.slice(2, length, end).copy_(k);
    v_all.slice(2, length, end).copy_(v);
    auto y = decode_attention(q, k_all.slice(2, 0, end), v_all.slice(2, 0, end), mask, scale);   // (B, H, T, hd)
    x = x + lkb::linear(y.transpose(1, 2).reshape({B, T, q_dim}), w + 2 + lkb::PER_LINEAR, D);
    auto gate_up = lkb::linear(rms_norm(x, w[1], eps), w + 2 + 2 * lkb::PER_LINEAR, 2 * F);
    x = x + lkb::linear(silu_mul(gate_up), w + 2 + 3 * lkb::PER_LINEAR, D);
    if (std::find(taps.begin(), taps.end(), l) != taps.end()) tapped->push_back(x);   // x is never written again
  }
  return x;
}

at::Tensor packed_blocks(at::Tensor x, at::Tensor cos, at::Tensor sin, at::Tensor k_cache, at::Tensor v_cache,
                         int64_t length, c10::optional<at::Tensor> mask, std::vector<at::Tensor> layers,
                         std::vector<int64_t> shape, double eps, double scale) {
  return run_blocks(x, cos, sin, k_cache, v_cache, length, mask, layers, shape, eps, scale, {}, nullptr);
}

// packed_blocks, and the outputs of layers `taps` (ascending): [tap outputs..., the last layer's output]
std::vector<at::Tensor> packed_blocks_taps(at::Tensor x, at::Tensor cos, at::Tensor sin, at::Tensor k_cache,
                                           at::Tensor v_cache, int64_t length, c10::optional<at::Tensor> mask,
                                           std::vector<at::Tensor> layers, std::vector<int64_t> shape, double eps,
                                           double scale, std::vector<int64_t> taps) {
  TORCH_CHECK(std::is_sorted(taps.begin(), taps.end()) && std::adjacent_find(taps.begin(), taps.end()) == taps.end()
              && (taps.empty() || (taps.front() >= 0 && taps.back() < k_cache.size(0))),
              "packed_blocks_taps: taps must be distinct layers in ascending order, below the model's ",
              k_cache.size(0));
  std::vector<at::Tensor> out;                                             // the taps, in order
  const at::Tensor last =
      run_blocks(x, cos, sin, k_cache, v_cache, length, mask, layers, shape, eps, scale, taps, &out);
  out.push_back(last);
  return out;
}
