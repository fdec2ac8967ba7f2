// The small per-token operations of a decoder layer, fused: RMSNorm, rotary embedding, SiLU(gate) * up.
//
// Each is a handful of torch ops in model.py (RMSNorm alone: cast, square, mean, add, rsqrt, multiply,
// cast, multiply), and at one token per forward those ops' fixed costs, not their arithmetic, add up:
// about 5 ms of a 50 ms step of the 1.5B model. Each kernel does the same arithmetic as the torch
// code it replaces, rounding where torch rounds (bf16 after every op), one row at a time.
#include <ATen/ATen.h>  // not torch/extension.h (the C++ frontend, pybind11): module.cpp alone needs it
#include <ATen/Parallel.h>
#include <cmath>
#include "vec.h"

namespace lk {

template <typename T>
static void rms_rows(const T* x, const T* w, T* y, int64_t rows, int64_t D, float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* xr = x + r * D;
      T* yr = y + r * D;
      vf ss = vzero();
      for (int64_t j = 0; j < D; j += VL) { vf v = vload_as(xr + j); ss = vfma(v, v, ss); }
      const vf inv = vset1(1.0f / std::sqrt(hsum(ss) / (float)D + eps));
      // model.py: weight * (x * rsqrt(mean(x^2) + eps)).to(dtype), each product rounded to dtype
      for (int64_t j = 0; j < D; j += VL)
        vstore_as(yr + j, vmul(vload_as(w + j), vround<T>(vmul(vload_as(xr + j), inv))));
    }
  });
}

// x (B, H, T, hd) with any strides but a contiguous last dim; cos, sin (B, 1, T, hd) contiguous.
template <typename T>
static void rope_rows(const T* x, const int64_t* xs, const T* cs, const T* sn, T* y, int64_t B, int64_t H,
                      int64_t Tn, int64_t hd) {
  const int64_t half = hd / 2;
  at::parallel_for(0, B * H * Tn, 64, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t t = i % Tn, h = (i / Tn) % H, b = i / (Tn * H);
      const T* xr = x + b * xs[0] + h * xs[1] + t * xs[2];
      const T* c = cs + (b * Tn + t) * hd;
      const T* s = sn + (b * Tn + t) * hd;
      T* yr = y + i * hd;
      // model.py: x * cos + cat(-x2, x1) * sin, each op rounded to dtype
      for (int64_t j = 0; j < half; j += VL) {
        vf x1 = vload_as(xr + j), x2 = vload_as(xr + half + j);
        vf a1 = vround<T>(vmul(x1, vload_as(c + j))), b1 = vround<T>(vmul(vmul(x2, vset1(-1.0f)), vload_as(s + j)));
        vf a2 = vround<T>(vmul(x2, vload_as(c + half + j))), b2 = vround<T>(vmul(x1, vload_as(s + half + j)));
        vstore_as(yr + j, vadd(a1, b1));
        vstore_as(yr + half + j, vadd(a2, b2));
      }
    }
  });
}

// gu (rows, 2F): silu(gu[:, :F]) * gu[:, F:] -> (rows, F)
template <typename T>
static void silu_mul_rows(const T* gu, T* y, int64_t rows, int64_t F) {
  at::parallel_for(0, rows * (F / VL), 256, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t r = i / (F / VL), j = (i % (F / VL)) * VL;
      vf g = vload_as(gu + r * 2 * F + j), u = vload_as(gu + r * 2 * F + F + j);
      vf act = vround<T>(vdiv(g, vadd(vset1(1.0f), vexp(vmul(g, vset1(-1.0f))))));   // F.silu, then rounded
      vstore_as(y + r * F + j, vmul(act, u));
    }
  });
}

}  // namespace lk

#define DISPATCH(t, FN, ...)                                                                    \
  if ((t).scalar_type() == at::kFloat) { using T = float; FN; }                                 \
  else if ((t).scalar_type() == at::kBFloat16) { using T = uint16_t; FN; }                      \
  else TORCH_CHECK(false, "labkit cpu kernels: float32 or bfloat16 only, got ", (t).scalar_type());

at::Tensor rms_norm(at::Tensor x, at::Tensor weight, double eps) {
  const int64_t D = x.size(-1);
  TORCH_CHECK(D % lk::VL == 0, "rms_norm: the last dim (", D, ") must be a multiple of ", lk::VL);
  TORCH_CHECK(weight.numel() == D && weight.scalar_type() == x.scalar_type(), "rms_norm: weight must be (D,) in x's dtype");
  auto xc = x.contiguous(), wc = weight.contiguous();
  auto y = at::empty_like(xc);
  DISPATCH(x, lk::rms_rows<T>((const T*)xc.data_ptr(), (const T*)wc.data_ptr(), (T*)y.data_ptr(), xc.numel() / D, D, (float)eps))
  return y;
}

at::Tensor rope(at::Tensor x, at::Tensor cos, at::Tensor sin) {
  TORCH_CHECK(x.dim() == 4 && x.stride(3) == 1, "rope: x must be (B, H, T, hd) with a contiguous last dim");
  const int64_t B = x.size(0), H = x.size(1), Tn = x.size(2), hd = x.size(3);
  TORCH_CHECK(hd % (2 * lk::VL) == 0, "rope: head dim ", hd, " must be a multiple of ", 2 * lk::VL);
  auto c = cos.expand({B, 1, Tn, hd}).contiguous(), s = sin.expand({B, 1, Tn, hd}).contiguous();
  TORCH_CHECK(c.scalar_type() == x.scalar_type() && s.scalar_type() == x.scalar_type(), "rope: cos/sin in x's dtype");
  auto y = at::empty({B, H, Tn, hd}, x.options());
  const int64_t xs[3] = {x.stride(0), x.stride(1), x.stride(2)};
  DISPATCH(x, lk::rope_rows<T>((const T*)x.data_ptr(), xs, (const T*)c.data_ptr(), (const T*)s.data_ptr(), (T*)y.data_ptr(), B, H, Tn, hd))
  return y;
}

at::Tensor silu_mul(at::Tensor gate_up) {
  const int64_t F = gate_up.size(-1) / 2;
  TORCH_CHECK(gate_up.size(-1) % 2 == 0 && F % lk::VL == 0, "silu_mul: the last dim must be 2F with F a multiple of ", lk::VL);
  auto gu = gate_up.contiguous();
  auto sizes = gu.sizes().vec();
  sizes.back() = F;
  auto y = at::empty(sizes, gu.options());
  DISPATCH(gu, lk::silu_mul_rows<T>((const T*)gu.data_ptr(), (T*)y.data_ptr(), gu.numel() / (2 * F), F))
  return y;
}
