#include "ct_bn_pool.h"

namespace fused_ops {
namespace {

// [kernel, in] 0/1 matrix: does tap k of input index i land inside the output
// along this dimension? Built on x's device so the call stays graph-capturable.
at::Tensor landing_mask(const ConvGeometry& g, int dim, const at::TensorOptions& opts) {
  const auto i = at::arange(g.in_size[dim], opts.dtype(at::kLong)).view({1, -1});
  const auto k = at::arange(g.kernel[dim], opts.dtype(at::kLong)).view({-1, 1});
  const auto pos = i * g.stride[dim] - g.padding[dim] + k * g.dilation[dim];
  return at::logical_and(pos >= 0, pos < g.out_size[dim]).to(opts.dtype(at::kDouble));
}

}  // namespace

at::Tensor box_sums(const at::Tensor& x, const ConvGeometry& g) {
  const auto opts = x.options();
  // One float64 copy of x, contiguous whatever x's layout, so that reshape is a view.
  const auto xd = x.to(at::kDouble, /*non_blocking=*/false, /*copy=*/false,
                       at::MemoryFormat::Contiguous)
                      .view({g.batch * g.in_channels, g.in_size[0], g.in_size[1], g.in_size[2]});
  // One contraction per dimension; each visits x's elements once.
  auto t = at::einsum("ndhw,aw->ndha", {xd, landing_mask(g, 2, opts)});
  t = at::einsum("ndha,bh->ndba", {t, landing_mask(g, 1, opts)});
  t = at::einsum("ndba,cd->ncba", {t, landing_mask(g, 0, opts)});
  return t.reshape({g.batch, g.in_channels, g.taps()});
}

}  // namespace fused_ops
