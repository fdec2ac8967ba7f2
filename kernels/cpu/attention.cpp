// Attention of T new queries over a KV cache, one query row at a time, for decoding on a CPU.
//
// torch's scaled_dot_product_attention on a CPU is built for long prefills; for the 1-64 queries of
// a decode or verify step its fixed costs dominate (about 0.3 ms a layer for one bf16 query here).
// This kernel walks each (batch, key/value head, query) row on its own: the query heads that share
// a key/value head (grouped-query attention) read each key and value once; the slots the mask hides
// are skipped; softmax is in fp32. A row's result depends only on its own query, the slots it may
// see and their keys and values, never on the other queries of the call: a verify of k tokens gives
// each token the bits a one-token step gives it (batch invariance; tests/test_cpu_kernels.py).
#include <ATen/ATen.h>  // not torch/extension.h (the C++ frontend, pybind11): module.cpp alone needs it
#include <ATen/Parallel.h>
#include <cmath>
#include <limits>
#include <vector>
#include "vec.h"

namespace lk {

template <typename T> static inline vf load_row(const T* p);
template <> inline vf load_row<float>(const float* p) { return vload(p); }
template <> inline vf load_row<at::BFloat16>(const at::BFloat16* p) { return vload_bf16((const uint16_t*)p); }

template <typename T, int D>
static void attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                   const uint8_t* mask, int64_t mask_b_stride, double scale, at::Tensor& out) {
  const int64_t B = q.size(0), H = q.size(1), Tq = q.size(2), Hkv = k.size(1), S = k.size(2), G = H / Hkv;
  constexpr int NVEC = D / VL;
  const T* qp = q.data_ptr<T>(); const T* kp = k.data_ptr<T>(); const T* vp = v.data_ptr<T>();
  T* op = out.data_ptr<T>();                                           // (B, Tq, H, D) contiguous
  const auto qs = q.strides(), ks = k.strides(), vs = v.strides();
  at::parallel_for(0, B * Hkv * Tq, 1, [&](int64_t i0, int64_t i1) {
    std::vector<int64_t> slots(S);
    std::vector<float> scores(G * (S + VL));
    alignas(64) float qf[64][D];                                      // G <= 64 query heads per kv head
    for (int64_t item = i0; item < i1; ++item) {
      const int64_t t = item % Tq, hk = (item / Tq) % Hkv, b = item / (Tq * Hkv);
      // 1. the slots this query may see, in order
      int64_t n = 0;
      const uint8_t* mrow = mask ? mask + b * mask_b_stride + t * S : nullptr;
      for (int64_t s = 0; s < S; ++s)
        if (!mrow || mrow[s]) slots[n++] = s;
      const int64_t npad = (n + VL - 1) / VL * VL;
      // 2. its G query heads in fp32, pre-scaled
      for (int64_t g = 0; g < G; ++g) {
        const T* src = qp + b * qs[0] + (hk * G + g) * qs[1] + t * qs[2];
        for (int j = 0; j < NVEC; ++j) vstore(qf[g] + j * VL, vmul(load_row<T>(src + j * VL), vset1((float)scale)));
      }
      // 3. scores: each visible key read once for all G heads
      for (int64_t i = 0; i < n; ++i) {
        const T* krow = kp + b * ks[0] + hk * ks[1] + slots[i] * ks[2];
        vf kv[NVEC];
        for (int j = 0; j < NVEC; ++j) kv[j] = load_row<T>(krow + j * VL);
        for (int64_t g = 0; g < G; ++g) {
          vf acc = vmul(vload(qf[g]), kv[0]);
          for (int j = 1; j < NVEC; ++j) acc = vfma(vload(qf[g] + j * VL), kv[j], acc);
          scores[g * (S + VL) + i] = hsum(acc);
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        float* sc = scores.data() + g * (S + VL);
        // 4. softmax in fp32 (the padding past n is -inf and comes out 0)
        for (int64_t i = n; i < npad; ++i) sc[i] = -std::numeric_limits<float>::infinity();
        vf mx = vset1(-std::numeric_limits<float>::infinity());
        for (int64_t i = 0; i < npad; i += VL) mx = vmax(mx, vload(sc + i));
        const vf m = vset1(hmax(mx));
        vf sum = vzero();
        for (int64_t i = 0; i < npad; i += VL) {
          vf e = vexp(vadd(vload(sc + i), vmul(m, vset1(-1.0f))));
          vstore(sc + i, e);
          sum = vadd(sum, e);
        }
        for (int64_t i = n; i < npad; ++i) sc[i] = 0.0f;
        const float inv = 1.0f / hsum(sum);
        // 5. out = softmax . V
        vf acc[NVEC];
        for (int j = 0; j < NVEC; ++j) acc[j] = vzero();
        for (int64_t i = 0; i < n; ++i) {
          const T* vrow = vp + b * vs[0] + hk * vs[1] + slots[i] * vs[2];
          const vf p = vset1(sc[i]);
          for (int j = 0; j < NVEC; ++j) acc[j] = vfma(p, load_row<T>(vrow + j * VL), acc[j]);
        }
        T* dst = op + ((b * Tq + t) * H + hk * G + g) * D;
        for (int j = 0; j < NVEC; ++j) {
          vf r = vmul(acc[j], vset1(inv));
          if constexpr (std::is_same<T, float>::value) vstore(dst + j * VL, r);
          else vstore_bf16((uint16_t*)dst + j * VL, r);
        }
      }
    }
  });
}

}  // namespace lk

// q (B, H, T, D), k and v (B, Hkv, S, D) with unit stride in D (cache views are fine), mask bool
// (T, S) or (B|1, 1, T, S) or none (every slot visible) -> (B, H, T, D) in q's dtype.
at::Tensor decode_attention(at::Tensor q, at::Tensor k, at::Tensor v, c10::optional<at::Tensor> mask,
                               double scale) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, "decode_attention: q, k, v must be 4-D");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type(),
              "decode_attention: q, k, v must share a dtype");
  TORCH_CHECK(q.stride(3) == 1 && k.stride(3) == 1 && v.stride(3) == 1, "decode_attention: head dim must be contiguous");
  const int64_t B = q.size(0), H = q.size(1), T = q.size(2), D = q.size(3), Hkv = k.size(1), S = k.size(2);
  TORCH_CHECK(k.size(0) == B && v.sizes() == k.sizes() && k.size(3) == D, "decode_attention: k/v shapes do not fit q");
  TORCH_CHECK(H % Hkv == 0 && H / Hkv <= 64, "decode_attention: need H a multiple of Hkv and at most 64 heads per group");
  at::Tensor m;
  int64_t mask_b_stride = 0;
  if (mask.has_value() && mask->defined()) {
    m = mask->to(at::kByte);
    if (m.dim() == 4) m = m.select(1, 0);
    TORCH_CHECK(m.dim() == 2 || m.dim() == 3, "decode_attention: mask must be (T, S) or (B, 1, T, S)");
    if (m.dim() == 2) m = m.unsqueeze(0);
    TORCH_CHECK(m.size(1) == T && m.size(2) == S && (m.size(0) == 1 || m.size(0) == B),
                "decode_attention: mask shape ", mask->sizes(), " does not fit T=", T, " S=", S);
    m = m.contiguous();
    mask_b_stride = m.size(0) == 1 ? 0 : T * S;
  }
  auto out = at::empty({B, T, H, D}, q.options());
  const uint8_t* mp = m.defined() ? m.data_ptr<uint8_t>() : nullptr;
#define CASE(DD) \
  if (D == DD) { \
    if (q.scalar_type() == at::kFloat) lk::attend<float, DD>(q, k, v, mp, mask_b_stride, scale, out); \
    else if (q.scalar_type() == at::kBFloat16) lk::attend<at::BFloat16, DD>(q, k, v, mp, mask_b_stride, scale, out); \
    else TORCH_CHECK(false, "decode_attention: float32 or bfloat16 only, got ", q.scalar_type()); \
    return out.transpose(1, 2); }
  CASE(64) CASE(128) CASE(256)
#undef CASE
  TORCH_CHECK(false, "decode_attention: head dim ", D, " not compiled (64, 128, 256)");
}
