// The training energy of a padded problem (docs/math.md §3.6). Padding crops planes
// off the padding-0 output grid, and none of the paths that skip the convolution
// takes a crop; but by inclusion–exclusion over the dims the crop's energy is the full
// grid's, minus that of the cut planes, plus that of the cut lines, minus that of the
// cut corners. Each of those regions is itself a padding-0 problem: x's edge planes,
// the cut dims folded into the channels, with a weight whose taps in those dims are
// picked per (input plane, output plane) pair; its energy comes from the path `auto`
// picks for it and its sums from the padding-0 reductions; plane regions of one problem
// shape (both sides of a symmetric cut, dims alike) are one problem, side by side as
// channel groups.
// Every region's terms are centred on the crop's sample means (float64) before they are
// added.
#include "ct_bn_pool.h"

#include <ATen/record_function.h>

#include <algorithm>
#include <array>
#include <vector>

#include "common/table_cache.h"

namespace fused_ops {
namespace {

// One side of a dim's cut: the output planes [j0, j0 + nj) of the full grid it drops,
// and the input planes [i0, i0 + ni) whose taps land on them.
struct Side {
  int64_t i0, ni, j0, nj;
};

// The padding-0 problem whose output the crop is taken from: output padding beyond the
// padding stays (zero planes past the convolution's last one).
ConvGeometry full_geometry(const ConvGeometry& g) {
  ConvGeometry f = g;
  for (int d = 0; d < 3; ++d) {
    f.padding[d] = 0;
    f.output_padding[d] = std::max<int64_t>(g.output_padding[d] - g.padding[d], 0);
    f.out_size[d] = conv_transpose_out_size(g.in_size[d], g.kernel[d], g.stride[d], 0,
                                            g.dilation[d], f.output_padding[d]);
  }
  return f;
}

// The sides of dim d's cut (none where its padding is 0): the first `padding` planes, and
// the last `padding - output_padding` (output padding keeps some of them).
std::vector<Side> cut_sides(const ConvGeometry& g, const ConvGeometry& full, int d) {
  const int64_t s = g.stride[d];
  const auto inputs = [&](int64_t planes) { return std::min(g.in_size[d], (planes + s - 1) / s); };
  std::vector<Side> sides;
  if (g.padding[d] > 0) sides.push_back({0, inputs(g.padding[d]), 0, g.padding[d]});
  const int64_t high = std::max<int64_t>(g.padding[d] - g.output_padding[d], 0);
  if (high > 0) {
    const int64_t n = inputs(high);
    sides.push_back({g.in_size[d] - n, n, full.out_size[d] - high, high});
  }
  return sides;
}

// A term of the inclusion–exclusion: the dims in `cut` restricted to one side of their
// cut each, the others whole.
struct Region {
  bool cut[3];
  Side side[3];
  // Where the region's problem takes the FFT path, whose kernel spreads a block's threads
  // over the depth frequencies (blocks of 16 threads where the depth has one position).
  bool whole_depth = false;
  // order()[q]: the dim of x at the region's problem's dim q: the cut dims first (their one
  // position at the depth, which the cross-spectrum path reduces last: docs/math.md §3.6),
  // or, with whole_depth, a whole dim of x first where there is one.
  std::array<int, 3> order() const {
    std::array<int, 3> o;
    int q = 0;
    for (const bool first : {whole_depth, !whole_depth}) {
      for (int d = 0; d < 3; ++d) {
        if (cut[d] != first) o[q++] = d;
      }
    }
    return o;
  }
  int64_t planes_in() const { return product([](const Side& s) { return s.ni; }); }
  int64_t planes_out() const { return product([](const Side& s) { return s.nj; }); }
  int dims() const { return int(cut[0]) + int(cut[1]) + int(cut[2]); }
  template <typename F>
  int64_t product(F f) const {
    int64_t n = 1;
    for (int d = 0; d < 3; ++d) n *= cut[d] ? f(side[d]) : 1;
    return n;
  }
};

std::vector<Region> regions(const ConvGeometry& g, const ConvGeometry& full) {
  std::vector<Region> out = {Region{{false, false, false}, {}}};
  for (int d = 0; d < 3; ++d) {
    const std::vector<Side> sides = cut_sides(g, full, d);
    const size_t before = out.size();
    for (size_t r = 0; r < before; ++r) {
      for (const Side& s : sides) {
        Region next = out[r];
        next.cut[d] = true;
        next.side[d] = s;
        out.push_back(next);
      }
    }
  }
  return out;
}

// The region's padding-0 problem: each cut dim becomes one position, its input planes
// and output planes folded into the channels as (ci, planes) and (planes, co) per group.
ConvGeometry region_geometry(const ConvGeometry& full, const Region& r) {
  ConvGeometry sub = full;
  const std::array<int, 3> order = r.order();
  for (int q = 0; q < 3; ++q) {
    const int d = order[q];
    const bool cut = r.cut[d];
    sub.in_size[q] = cut ? 1 : full.in_size[d];
    sub.out_size[q] = cut ? 1 : full.out_size[d];
    sub.kernel[q] = cut ? 1 : full.kernel[d];
    sub.stride[q] = cut ? 1 : full.stride[d];
    sub.dilation[q] = cut ? 1 : full.dilation[d];
    sub.output_padding[q] = cut ? 0 : full.output_padding[d];
    sub.padding[q] = 0;
  }
  sub.in_channels = full.in_channels * r.planes_in();
  sub.out_channels = full.out_channels * r.planes_out();
  return sub;
}

// Each plane region's layout: cut dim first unless its problem (one region alone) then takes
// the FFT path. The cross-spectrum path is faster with the cut dim's one position at the depth
// than at the width; the FFT path is faster with a whole dim at the depth than without, its
// threads spanning the depth frequencies (docs/performance.md).
void choose_layouts(const Backend& backend, const ConvGeometry& full, std::vector<Region>& rs,
                    at::ScalarType dtype) {
  for (Region& r : rs) {
    if (r.dims() != 1) continue;
    r.whole_depth = false;  // auto judges the cut-first layout
    r.whole_depth = backend.auto_energy_algo(region_geometry(full, r), dtype) == EnergyAlgo::Fft;
  }
}

// x's planes of the region, [B, Ci, planes_in, sizes of sub]: the cut dims moved next to
// the channels, the others in the region's order.
at::Tensor region_planes(const at::Tensor& x, const Region& r, const ConvGeometry& sub) {
  at::Tensor t = x;
  std::vector<int64_t> order = {0, 1};
  for (int d = 0; d < 3; ++d) {
    if (r.cut[d]) {
      t = t.narrow(2 + d, r.side[d].i0, r.side[d].ni);
      order.push_back(2 + d);
    }
  }
  for (const int d : r.order()) {
    if (!r.cut[d]) order.push_back(2 + d);
  }
  return t.permute(order).reshape(
      {sub.batch, x.size(1), r.planes_in(), sub.in_size[0], sub.in_size[1], sub.in_size[2]});
}

// The input of a problem that holds the regions `members` (of one problem shape) as
// channel groups: [B, sides Ci planes_in, sizes of sub], side-major, so that each (side,
// group) is one block of channels.
at::Tensor region_input(const at::Tensor& x, const std::vector<Region>& rs,
                        const std::vector<size_t>& members, const ConvGeometry& sub) {
  const std::array<int64_t, 5> shape = {sub.batch, sub.in_channels, sub.in_size[0], sub.in_size[1],
                                        sub.in_size[2]};
  if (members.size() == 1) return region_planes(x, rs[members[0]], sub).reshape(shape);
  std::vector<at::Tensor> sides;
  for (const size_t k : members) sides.push_back(region_planes(x, rs[k], sub));
  return at::stack(sides, 1).view(shape);
}

// Which tap of the weight each entry of the region's weight takes: [planes_in...,
// planes_out..., kept taps...] (the cut dims' input planes, their output planes, then the
// other dims' taps in the region's order), as the flat tap index (long) into weight_taps,
// whose last tap, g.taps(), is the zero that entries taking none read.
at::Tensor tap_pick(const ConvGeometry& g, const Region& r, const at::TensorOptions& opts) {
  const auto lopts = opts.dtype(at::kLong);
  const int cut_dims = r.dims(), axes = 3 + cut_dims;
  at::Tensor index = at::zeros({}, lopts), valid = at::ones({}, lopts.dtype(at::kBool));
  int kept_axis[3] = {0, 0, 0}, kept = 0;
  for (const int d : r.order()) {
    if (!r.cut[d]) kept_axis[d] = 2 * cut_dims + kept++;
  }
  int cut_seen = 0;
  int64_t tap_step = g.taps();
  for (int d = 0; d < 3; ++d) {
    tap_step /= g.kernel[d];
    std::vector<int64_t> shape(axes, 1);
    at::Tensor tap;
    if (r.cut[d]) {
      // Input plane i reaches output plane j through tap t where i s + t dilation = j.
      const Side& s = r.side[d];
      const auto i = at::arange(s.i0, s.i0 + s.ni, lopts).view({-1, 1});
      const auto j = at::arange(s.j0, s.j0 + s.nj, lopts).view({1, -1});
      const auto offset = j - i * g.stride[d];
      tap = at::div(offset, g.dilation[d], "floor");
      const auto lands = (offset >= 0) & (offset.remainder(g.dilation[d]) == 0) & (tap < g.kernel[d]);
      shape[cut_seen] = s.ni;
      shape[cut_dims + cut_seen] = s.nj;
      ++cut_seen;
      valid = valid & lands.view(shape);
      tap = at::where(lands, tap, at::zeros_like(tap));
    } else {
      tap = at::arange(g.kernel[d], lopts);
      shape[kept_axis[d]] = g.kernel[d];
    }
    index = index + tap.view(shape) * tap_step;
  }
  // `index` has every axis's extent; `valid` only those of the cut dims.
  return at::where(valid, index, at::full_like(index, g.taps())).contiguous();
}

// The weight [Ci, Cog, taps + 1], a zero tap appended (tap_pick's index where no tap lands).
at::Tensor weight_taps(const at::Tensor& w, const ConvGeometry& g) {
  return at::constant_pad_nd(w.reshape({g.in_channels, g.out_group_channels(), g.taps()}), {0, 1});
}

// [F, k] long, for a region problem with at most one position or tap > 1 per dim: the
// input position each (output position, tap) pair reads, or L (one past the inputs, where
// im2col puts a zero) where none lands there (i s + t dilation = o).
at::Tensor im2col_columns(const ConvGeometry& sub, const at::TensorOptions& opts) {
  const auto lopts = opts.dtype(at::kLong);
  int64_t s = 1, dil = 1;
  for (int q = 0; q < 3; ++q) {
    if (sub.in_size[q] > 1 || sub.kernel[q] > 1) {
      s = sub.stride[q];
      dil = sub.dilation[q];
    }
  }
  const int64_t L = sub.in_spatial();
  const auto offset = at::arange(sub.out_spatial(), lopts).view({-1, 1}) -
                      at::arange(sub.taps(), lopts).view({1, -1}) * dil;
  const auto i = at::div(offset, s, "floor");
  const auto lands = (offset >= 0) & (offset.remainder(s) == 0) & (i < L);
  return at::where(lands, i, at::full_like(i, L));
}

// Lines and corners (a region with at most one whole dim) are formed outright: their
// outputs are few (pad2: 36 per line and channel), and a padding-0 problem's pipeline would
// cost them hundreds of ATen ops each (docs/performance.md).
bool values_pay(const Region& r) { return r.dims() >= 2; }

// [P_in, L] long: x's flat (d, h, w) offsets of the region's inputs, the cut dims' planes
// (in dim order) by the whole dim's positions (one where every dim is cut).
at::Tensor input_positions(const ConvGeometry& g, const Region& r, const at::TensorOptions& opts) {
  const auto lopts = opts.dtype(at::kLong);
  const int64_t steps[3] = {g.in_size[1] * g.in_size[2], g.in_size[2], 1};
  at::Tensor planes = at::zeros({1}, lopts), positions = at::zeros({1}, lopts);
  for (int d = 0; d < 3; ++d) {
    if (r.cut[d]) {
      const auto i = at::arange(r.side[d].i0, r.side[d].i0 + r.side[d].ni, lopts) * steps[d];
      planes = (planes.view({-1, 1}) + i.view({1, -1})).flatten();
    } else {
      positions = at::arange(g.in_size[d], lopts) * steps[d];
    }
  }
  return planes.view({-1, 1}) + positions.view({1, -1});
}

// What makes two regions' problems alike: their planes and their problem's geometry.
std::vector<int64_t> problem_key(const ConvGeometry& full, const Region& r) {
  const ConvGeometry sub = region_geometry(full, r);
  std::vector<int64_t> key = {r.planes_in(), r.planes_out()};
  for (int q = 0; q < 3; ++q) {
    key.insert(key.end(), {sub.in_size[q], sub.out_size[q], sub.kernel[q], sub.stride[q], sub.dilation[q],
                           sub.output_padding[q]});
  }
  return key;
}

// Lines and corners whose cut sides have the same plane counts (both sides of a symmetric
// padding) have problems of one shape, differing only in x's planes and the weight's taps:
// they are formed together, one batched GEMM per group of them.
struct ValueGroup {
  std::vector<size_t> members;  // indices into the regions, all of one sign
  at::Tensor positions;         // [R, P_in * L] long: input_positions of each member
  at::Tensor tap_index;         // [R, P_in, P_out, k]: each member's tap_pick
  at::Tensor columns;           // [F, k]: im2col_columns of their (common) problem
};

// The regions that `admit` takes, grouped by equal `key` (in the order of their first
// members), each group's members in region order.
template <typename Admit, typename Key>
std::vector<std::vector<size_t>> group_regions(const std::vector<Region>& rs, Admit admit, Key key) {
  std::vector<std::vector<size_t>> groups;
  std::vector<std::vector<int64_t>> keys;
  for (size_t k = 0; k < rs.size(); ++k) {
    if (!admit(rs[k])) continue;
    const std::vector<int64_t> kk = key(rs[k]);
    const auto at = std::find(keys.begin(), keys.end(), kk);
    if (at == keys.end()) {
      keys.push_back(kk);
      groups.push_back({k});
    } else {
      groups[at - keys.begin()].push_back(k);
    }
  }
  return groups;
}

std::vector<ValueGroup> value_groups(const ConvGeometry& g, const ConvGeometry& full,
                                     const std::vector<Region>& rs, const at::TensorOptions& opts) {
  std::vector<ValueGroup> groups;
  // Problems of one shape (lines whose whole dims match, D's and H's say), of one sign.
  const auto members = group_regions(rs, values_pay, [&](const Region& r) {
    std::vector<int64_t> key = problem_key(full, r);
    key.push_back(r.dims());
    return key;
  });
  for (const std::vector<size_t>& m : members) groups.push_back({m, {}, {}, {}});
  for (ValueGroup& vg : groups) {
    std::vector<at::Tensor> positions, index;
    for (const size_t k : vg.members) {
      const at::Tensor pick = tap_pick(g, rs[k], opts);
      positions.push_back(input_positions(g, rs[k], opts).flatten());
      index.push_back(pick.flatten());
    }
    const ConvGeometry sub = region_geometry(full, rs[vg.members[0]]);
    const std::vector<int64_t> shape = {static_cast<int64_t>(vg.members.size()),
                                        rs[vg.members[0]].planes_in(),
                                        rs[vg.members[0]].planes_out(), sub.taps()};
    vg.positions = at::stack(positions);
    vg.tap_index = at::stack(index).view(shape);
    vg.columns = im2col_columns(sub, opts);
  }
  return groups;
}

// The plane regions (one cut dim, all of sign -1) grouped by their problem's shape: both
// sides of a dim's cut where their plane counts are equal (no output padding in that dim),
// and the dims whose problems match after Region::order() (D and H alike). Each group is
// one padding-0 problem, its members side by side as channel groups (docs/math.md §3.6): a
// problem's pipeline issues hundreds of ATen ops and, on CUDA, dozens of launches, whatever
// its channels; its work is the members' together.
std::vector<std::vector<size_t>> plane_groups(const ConvGeometry& full, const std::vector<Region>& rs) {
  return group_regions(rs, [](const Region& r) { return r.dims() == 1; },
                       [&](const Region& r) { return problem_key(full, r); });
}

// The problem of a plane group: its members' problem with `sides` times the channel groups,
// so that each member's input channels reach only its own output channels.
ConvGeometry plane_group_geometry(const ConvGeometry& full, const Region& r, int64_t sides) {
  ConvGeometry sub = region_geometry(full, r);
  sub.in_channels *= sides;
  sub.out_channels *= sides;
  sub.groups *= sides;
  return sub;
}

struct PlaneGroup {
  std::vector<size_t> members;  // indices into the regions, in region order
  at::Tensor pick;              // the members' tap_picks stacked: [members, planes..., taps...]
};

struct RegionTables {
  std::vector<PlaneGroup> planes;
  std::vector<ValueGroup> groups;
};

// The tables of g's geometry, cached per device (table_cache.h).
RegionTables region_tables(const Backend& backend, const ConvGeometry& g, const ConvGeometry& full,
                           const std::vector<Region>& rs, const at::Tensor& w) {
  static auto* cache = new TableCache<RegionTables>();  // never destroyed: CUDA tensors at exit
  // The batch and channels pick the plane regions' layouts (choose_layouts), so they key too.
  std::vector<int64_t> key = {static_cast<int64_t>(w.scalar_type()), g.batch, g.in_channels, g.out_channels,
                              g.groups};
  for (int d = 0; d < 3; ++d) {
    key.insert(key.end(), {g.in_size[d], g.kernel[d], g.stride[d], g.dilation[d], g.padding[d],
                           g.output_padding[d]});
  }
  return cache->get(std::move(key), w.device(), backend.build_tables_apart, [&] {
    RegionTables tables;
    for (std::vector<size_t>& members : plane_groups(full, rs)) {
      std::vector<at::Tensor> index;
      for (const size_t k : members) index.push_back(tap_pick(g, rs[k], w.options()));
      tables.planes.push_back({std::move(members), at::stack(index)});
    }
    tables.groups = value_groups(g, full, rs, w.options());
    return tables;
  });
}

// The weight of a plane group's problem [sides Ci planes_in, planes_out Cog, kernel of sub]:
// each member's weight[ci, co, t] at the tap each (input plane, output plane) pair of its
// cut dim takes, 0 where none; side-major, as region_input's channels. w_taps: weight_taps.
at::Tensor region_weight(const at::Tensor& w_taps, const ConvGeometry& g, const at::Tensor& pick,
                         const ConvGeometry& sub) {
  std::vector<int64_t> shape = {g.in_channels, g.out_group_channels()};
  shape.insert(shape.end(), pick.sizes().begin(), pick.sizes().end());
  const auto picked = w_taps.index_select(2, pick.flatten()).view(shape);
  // [ci, co, sides, in planes, out planes, taps] -> [sides, ci, in planes, out planes, co, taps]
  std::vector<int64_t> order = {2, 0, 3, 4, 1};
  for (int64_t a = 3; a < pick.dim(); ++a) order.push_back(2 + a);
  return picked.permute(order).reshape({sub.in_channels, sub.out_group_channels(), sub.kernel[0],
                                        sub.kernel[1], sub.kernel[2]});
}

// Bytes of im2col columns (or of outputs, where more) formed at once, float64: bounds the
// lines' extra memory beside their weight.
constexpr int64_t kColumnBytes = int64_t(64) << 20;

// sum over a value group's regions of (y - m)^2 per channel [Co], m the crop's sample means
// [B, G, 1, Cog], from their outputs y formed in float64 (products of float32 values are exact
// there): x's planes gathered, im2col over the whole dim's taps, one GEMM per (region, group),
// over slices of the batch. The columns' inner index is (tap, ci, input plane), so that the
// gather writes them in the GEMM's layout (no transposing copy of the largest tensor), and the
// GEMM starts from -m, so that y comes out centred and one norm reduces it. The operands come
// from the backend (Backend::line_weight, line_columns): on CUDA one kernel each.
at::Tensor group_values_energy(const Backend& backend, const at::Tensor& x, const at::Tensor& w_taps,
                               const ConvGeometry& g, const ConvGeometry& sub, const ValueGroup& vg,
                               int64_t planes_in, int64_t planes_out, const at::Tensor& crop_means) {
  const int64_t R = static_cast<int64_t>(vg.members.size()), G = g.groups;
  const int64_t cog = g.out_group_channels();
  const int64_t L = sub.in_spatial(), F = sub.out_spatial(), k = sub.taps();
  const auto dopts = x.options().dtype(at::kDouble);
  // [R G, k cig P_in, P_out cog]: each member's weight, its rows (tap, ci, plane).
  const auto wd = backend.line_weight(w_taps, vg.tap_index, G);
  const auto xs = x.reshape({g.batch, g.in_channels, g.in_spatial()});
  const auto positions = vg.positions.view({R, planes_in, L});
  const auto neg_means = crop_means.view({g.batch, G, cog}).neg().permute({1, 0, 2});  // [G, B, Cog]
  const int64_t sample_bytes =
      R * F * std::max(g.in_channels * planes_in * k, g.out_channels * planes_out) * int64_t(sizeof(double));
  const int64_t slice = std::max<int64_t>(1, kColumnBytes / sample_bytes);
  auto total = at::zeros({G, cog}, dopts);
  for (int64_t b0 = 0; b0 < g.batch; b0 += slice) {
    const int64_t n = std::min(slice, g.batch - b0);
    const auto cols = backend.line_columns(xs, positions, vg.columns, G, b0, n);
    const auto start = neg_means.narrow(1, b0, n).view({1, G, n, 1, 1, cog})
                           .expand({R, G, n, F, planes_out, cog})
                           .reshape({R * G, n * F, planes_out * cog});
    const auto y = at::baddbmm(start, cols, wd).view({R, G, n * F * planes_out, cog});
    total.add_(at::linalg_vector_norm(y, 2, at::IntArrayRef{0, 2}).square_());
  }
  return total.view({G * cog});
}

// sum over the problem's regions of (y - m)^2 per channel [Co], m the crop's sample means
// [B, G, 1, Cog]: each of its (sample, side, output plane) slices' own centred energy plus
// its count times the square of its mean's distance from m. The problem's output channels
// are (side, group, output plane, co), `sides` regions side by side (plane_groups); `algo`
// the path for its energy.
at::Tensor region_energy(const Backend& backend, EnergyAlgo algo, const at::Tensor& x, const at::Tensor& w,
                         const ConvGeometry& sub, const at::Tensor& crop_means, int64_t sides,
                         int64_t planes_out) {
  const SampleSumTensors sums = training_sample_sums(backend, algo, x, w, sub);
  const auto e = energy_of(backend, algo, x, w, sums, sub);  // first: it may write the sums
  const int64_t G = sub.groups / sides, cog = sub.out_group_channels() / planes_out;
  const double n = static_cast<double>(sub.out_spatial());
  const auto means = sample_conv_sums(sums, sub).view({sub.batch, sides, G, planes_out, cog}).div_(n);
  auto total = means.sub_(crop_means.unsqueeze(1)).square_().sum(at::IntArrayRef{0, 1, 3}).mul_(n);
  total.add_(e.sum(at::IntArrayRef{0, 2}).view({sides, G, planes_out, cog}).sum(at::IntArrayRef{0, 2}));
  return total.view({G * cog});
}

}  // namespace

at::Tensor line_weight_aten(const at::Tensor& w_taps, const at::Tensor& tap_index, int64_t groups) {
  const int64_t R = tap_index.size(0), planes_in = tap_index.size(1), planes_out = tap_index.size(2),
                k = tap_index.size(3);
  const int64_t cig = w_taps.size(0) / groups, cog = w_taps.size(1);
  const auto picked =
      w_taps.index_select(2, tap_index.flatten()).view({groups, cig, cog, R, planes_in, planes_out, k});
  return at::empty({R, groups, k, cig, planes_in, planes_out, cog}, w_taps.options().dtype(at::kDouble))
      .copy_(picked.permute({3, 0, 6, 1, 4, 5, 2}))
      .view({R * groups, k * cig * planes_in, planes_out * cog});
}

at::Tensor line_columns_aten(const at::Tensor& x, const at::Tensor& positions, const at::Tensor& columns,
                             int64_t groups, int64_t b0, int64_t n) {
  const int64_t R = positions.size(0), planes_in = positions.size(1), L = positions.size(2);
  const int64_t cig = x.size(1) / groups, F = columns.size(0), k = columns.size(1);
  // x's planes of every member, [R, G, n, L + 1, cig, P_in] float64, a zero position appended
  // that the columns read where no input lands.
  const auto gathered =
      x.narrow(0, b0, n).index_select(2, positions.flatten()).view({n, groups, cig, R, planes_in, L});
  auto planes = at::zeros({R, groups, n, L + 1, cig, planes_in}, x.options().dtype(at::kDouble));
  planes.narrow(3, 0, L).copy_(gathered.permute({3, 1, 0, 5, 2, 4}));
  return planes.index_select(3, columns.flatten()).view({R * groups, n * F, k * cig * planes_in});
}

int64_t border_weight_bytes(const ConvGeometry& g) {
  const ConvGeometry full = full_geometry(g);
  const std::vector<Region> rs = regions(g, full);
  int64_t most = 0;
  const auto bytes = [](const ConvGeometry& sub, int64_t size) {
    return sub.in_channels * sub.out_group_channels() * sub.taps() * size;
  };
  for (const Region& r : rs) {
    if (r.dims() != 1) most = std::max<int64_t>(most, bytes(region_geometry(full, r), values_pay(r) ? 8 : 4));
  }
  // A plane group's weight holds all its members'.
  for (const std::vector<size_t>& members : plane_groups(full, rs)) {
    const int64_t sides = static_cast<int64_t>(members.size());
    most = std::max<int64_t>(most, bytes(plane_group_geometry(full, rs[members[0]], sides), 4));
  }
  return most;
}

double crop_fraction(const ConvGeometry& g) {
  const ConvGeometry full = full_geometry(g);
  return static_cast<double>(g.out_spatial()) / static_cast<double>(full.out_spatial());
}

at::Tensor energy_border(const Backend& backend, const at::Tensor& x, const at::Tensor& weight,
                         const SampleSumTensors& sums, const ConvGeometry& g) {
  const ConvGeometry full = full_geometry(g);
  std::vector<Region> rs = regions(g, full);
  const at::ScalarType dtype = x.scalar_type();
  choose_layouts(backend, full, rs, dtype);
  const RegionTables tables = region_tables(backend, g, full, rs, weight);
  const auto crop_means = sample_conv_sums(sums, g)
                              .div_(static_cast<double>(g.out_spatial()))
                              .view({g.batch, g.groups, 1, g.out_group_channels()});
  const at::Tensor w_taps = weight_taps(weight, g);
  // The full grid's term, then those of the planes and of the lines and corners (§3.6).
  // The profiler's ranges (scripts/profile_seed.py's `ranges`) name the three kinds of term.
  at::Tensor energy;
  {
    RECORD_FUNCTION("fused_ops::border_full_grid", std::vector<c10::IValue>());
    energy = region_energy(backend, backend.auto_energy_algo(full, dtype), x, weight, full, crop_means, 1, 1);
  }
  for (const PlaneGroup& pg : tables.planes) {
    RECORD_FUNCTION("fused_ops::border_planes", std::vector<c10::IValue>());
    const Region& r = rs[pg.members[0]];
    const int64_t sides = static_cast<int64_t>(pg.members.size());
    const ConvGeometry sub = plane_group_geometry(full, r, sides);
    at::Tensor xs, ws;
    {
      RECORD_FUNCTION("fused_ops::border_plane_inputs", std::vector<c10::IValue>());
      xs = region_input(x, rs, pg.members, sub);
      ws = region_weight(w_taps, g, pg.pick, sub);
    }
    // The path `auto` takes for one region alone, so that grouping changes how many problems
    // run, not their products. Taken again on the layout choose_layouts gave it: the FFT
    // path's limits depend on the layout, so a whole-depth layout is judged as it is.
    const EnergyAlgo algo = backend.auto_energy_algo(region_geometry(full, r), dtype);
    energy.sub_(region_energy(backend, algo, xs, ws, sub, crop_means, sides, r.planes_out()));
  }
  for (const ValueGroup& vg : tables.groups) {
    RECORD_FUNCTION("fused_ops::border_lines_corners", std::vector<c10::IValue>());
    const Region& r = rs[vg.members[0]];
    const ConvGeometry sub = region_geometry(full, r);
    const auto term =
        group_values_energy(backend, x, w_taps, g, sub, vg, r.planes_in(), r.planes_out(), crop_means);
    energy.add_(term, r.dims() % 2 == 0 ? 1.0 : -1.0);
  }
  return energy.view({1, g.out_channels, 1});
}

}  // namespace fused_ops
