#pragma once
// Tables of powers of a root of unity, shared by the spectral paths' geometry tables
// (cross_spectrum.cpp) and x's spectrum's DFT matrices (x_spectrum_dft.cu).
#include <ATen/ATen.h>

#include <cmath>

namespace fused_ops {

// [n, M] complex128 on the device of `exponents` (long, M of them):
// exp(sign 2 pi i ((f step m) mod size) / size) for f < n and m in `exponents`; sign is
// +1 or -1 (a forward DFT). The angle is reduced modulo size in integers first, so it is
// exact however large f m gets.
inline at::Tensor unit_roots(int64_t size, int64_t n, int64_t step, const at::Tensor& exponents, double sign) {
  const at::Tensor f = at::arange(n, exponents.options()).unsqueeze(1);
  const at::Tensor turns = at::remainder(f * exponents.unsqueeze(0) * step, size).to(at::kDouble);
  const at::Tensor angle = turns.mul_(sign * 2 * M_PI / static_cast<double>(size));
  return at::polar(at::ones_like(angle), angle);
}

}  // namespace fused_ops
