// The sliced_conv path (docs/math.md §3.2): ATen's convolution (cuDNN or oneDNN, strict
// float32) over slices of the batch, each slice's output centred per sample and squared.
#include "ct_bn_pool.h"

#include <algorithm>

#include "testing_hooks.h"

namespace fused_ops {
namespace {
// Bytes of conv output held at once: bounds the path's extra memory.
constexpr int64_t kSliceBytes = int64_t(64) << 20;
}  // namespace

at::Tensor energy_sliced_conv(const at::Tensor& x, const at::Tensor& weight, const ConvGeometry& g) {
  const auto& ctx = at::globalContext();
  const int64_t sample_bytes = g.out_channels * g.out_spatial() * x.element_size();
  const int64_t slice = std::max<int64_t>(1, limit_or(Limit::SliceBytes, kSliceBytes) / sample_bytes);
  const std::vector<int64_t> stride(g.stride, g.stride + 3), padding(g.padding, g.padding + 3),
      dilation(g.dilation, g.dilation + 3), output_padding(g.output_padding, g.output_padding + 3);
  auto energy = at::empty({g.batch, g.out_channels, 1}, x.options().dtype(at::kDouble));
  for (int64_t b0 = 0; b0 < g.batch; b0 += slice) {
    const int64_t n = std::min(slice, g.batch - b0);
    // TF32 stays off whatever the global flags say: the result must be float32-exact.
    auto y = at::_convolution(x.narrow(0, b0, n), weight, {}, stride, padding, dilation,
                              /*transposed=*/true, output_padding, g.groups,
                              ctx.benchmarkCuDNN(), ctx.deterministicCuDNN(), ctx.userEnabledCuDNN(),
                              /*allow_tf32=*/false);
    // Centre each sample on its own mean before squaring: no cancellation.
    const auto mean = y.mean({2, 3, 4}, /*keepdim=*/true);
    y.sub_(mean).square_();
    energy.narrow(0, b0, n).copy_(y.sum({2, 3, 4}, /*keepdim=*/false, at::kDouble).unsqueeze(2));
  }
  return energy;
}

}  // namespace fused_ops
