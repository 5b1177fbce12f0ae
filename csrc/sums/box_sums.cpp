#include "ct_bn_pool.h"
#include "common/table_cache.h"

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

struct Masks {
  at::Tensor dim[3];
};

// The three masks of g's geometry on x's device, cached per device (table_cache.h): built at
// every call they would be about 20 small kernels, most of the padded sums' GPU time on a
// small problem (docs/performance.md).
Masks masks_for(const Backend& backend, const ConvGeometry& g, const at::Tensor& x) {
  static auto* cache = new TableCache<Masks>();  // never destroyed: CUDA tensors at exit
  std::vector<int64_t> key;
  for (int d = 0; d < 3; ++d) {
    key.insert(key.end(), {g.in_size[d], g.kernel[d], g.stride[d], g.dilation[d], g.padding[d], g.out_size[d]});
  }
  return cache->get(std::move(key), x.device(), backend.build_tables_apart, [&] {
    Masks m;
    for (int d = 0; d < 3; ++d) m.dim[d] = landing_mask(g, d, x.options());
    return m;
  });
}

}  // namespace

at::Tensor box_sums(const Backend& backend, const at::Tensor& x, const ConvGeometry& g) {
  if (backend.box_sums) {
    at::Tensor t = backend.box_sums(x, g);
    if (t.defined()) return t;
  }
  const Masks masks = masks_for(backend, g, x);
  // One float64 copy of x, contiguous whatever x's layout, so that reshape is a view.
  const auto xd = x.to(at::kDouble, /*non_blocking=*/false, /*copy=*/false,
                       at::MemoryFormat::Contiguous)
                      .view({g.batch * g.in_channels, g.in_size[0], g.in_size[1], g.in_size[2]});
  // One contraction per dimension; each visits x's elements once.
  auto t = at::einsum("ndhw,aw->ndha", {xd, masks.dim[2]});
  t = at::einsum("ndha,bh->ndba", {t, masks.dim[1]});
  t = at::einsum("ndba,cd->ncba", {t, masks.dim[0]});
  return t.reshape({g.batch, g.in_channels, g.taps()});
}

}  // namespace fused_ops
