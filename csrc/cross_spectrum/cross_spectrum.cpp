// The cross-spectrum path of the training-mode energy (docs/math.md §3.5): x's
// channel cross-correlation R at the lags the phases' sub-kernels span, computed
// from x's spectrum as the per-frequency matrix sum_b X^H X reduced to those lags,
// and on to their DFT on a grid of 2k' - 1 positions per dim, one dim at a time, then
// contracted with the sub-kernels' DFT on that grid. Its cost grows with Cig^2 and
// x's spectrum, not with the output channels or the number of lags.
#include <ATen/Context.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <vector>

#include "common/phases.h"
#include "common/table_cache.h"
#include "common/unit_roots.h"
#include "x_spectrum/x_spectrum.h"

namespace fused_ops {
namespace {

// Bytes of the S stage's output (Q, x's spectrum's dtype) per chunk of depth frequencies,
// and of the sub-kernels' spectra per chunk of output channels: as much as x's spectrum
// (rows) and half of it (channels; or R^'s size, weight_chunk_budget), within these bounds,
// so that the path's temporaries shrink with the batch (below eager PyTorch's on the `b4` bench problem,
// docs/performance.md). The rows get all of x's spectrum, not half: smaller S-stage launches
// have too few blocks to fill the GPU. The channels' 64 MiB hold the seed problem's 128 output
// channels (53 MB of spectra) in one chunk: two GEMMs and one quad_form launch fewer than in
// two, and larger GEMMs. The rows' 64 MiB: fewer, larger chunks of depth frequencies take less
// GPU time for little more peak memory (docs/performance.md).
constexpr int64_t kMinChunkBytes = int64_t(8) << 20;
constexpr int64_t kMaxRowsBytes = int64_t(64) << 20;
constexpr int64_t kMaxWeightBytes = int64_t(64) << 20;
// The W stage's output kept for one D stage over every depth frequency, where it is at most
// this large (seed: 29.5 MB of complex64) and no larger than x's spectrum: per chunk, the D
// stage reads and writes Z^ (26.5 MB) each time. The output's size does not depend on the
// batch, so on a small batch keeping it would outweigh the rest of the call's memory, and
// the peak would pass eager PyTorch's (docs/performance.md).
constexpr int64_t kMaxDeferredBytes = int64_t(64) << 20;
bool keep_w_stage_output(int64_t chunks, int64_t bytes, const at::Tensor& x_spec) {
  return chunks == 1 || bytes <= std::min(kMaxDeferredBytes, x_spec.numel() * x_spec.element_size());
}
int64_t chunk_budget(const at::Tensor& x_spec, int64_t share, int64_t max_bytes) {
  return std::clamp<int64_t>(x_spec.numel() * x_spec.element_size() / share, kMinChunkBytes, max_bytes);
}
// The sub-kernels' spectra per chunk of output channels may also be as large as R^ (`blocks`),
// which the call holds anyway: where x's spectrum is small against the channels (border's plane
// problems: pad2's in 4 chunks rather than 13) the chunks' launches and partial sums cost more
// than the memory, and the larger chunks raise no peak (docs/performance.md).
int64_t weight_chunk_budget(const at::Tensor& x_spec, const at::Tensor& blocks) {
  const int64_t r_hat = blocks.numel() * blocks.element_size();
  return std::max(chunk_budget(x_spec, 2, kMaxWeightBytes), std::min(r_hat, kMaxWeightBytes));
}

// [n, M] complex128: exp(2 pi i f step m / size) for frequencies f < n and the M lags m
// of `lags` (long), on their device.
at::Tensor lag_phases(int64_t size, int64_t n, int64_t step, const at::Tensor& lags) {
  return unit_roots(size, n, step, lags, 1.0);
}

// [n, M] double, M = 2 reach + 1: the W and D stages' coefficients, a frequency f < n of
// the grid of `size` taken to the lags m = -reach .. reach and on to the bins g of their DFT
// on M, sum_m exp(2 pi i f step m / size) exp(-2 pi i g m / M) (§3.5). The lags are
// symmetric about 0, so each is a sum of cosines, real: kept as such, the stages' products
// take two multiply-adds instead of four (the imaginary parts formed here are rounding).
at::Tensor lag_spectrum_phases(int64_t size, int64_t n, int64_t step, int64_t reach, const at::TensorOptions& opts) {
  const int64_t count = 2 * reach + 1;
  const at::Tensor lags = at::arange(-reach, reach + 1, opts.dtype(at::kLong));
  return at::real(
             at::matmul(lag_phases(size, n, step, lags), lag_phases(count, count, 1, lags).conj_physical().t()))
      .contiguous();
}

// [size / 2 + 1] double: how many bins of a real signal's full DFT of that size each
// kept bin of its real FFT stands for: 2 (itself and its mirror) except bin 0 and,
// for an even size, size / 2.
at::Tensor mirror_count(int64_t size, const at::TensorOptions& opts) {
  const int64_t bins = size / 2 + 1;
  auto count = at::full({bins}, 2.0, opts.dtype(at::kDouble));
  count[0].fill_(1.0);
  if (size % 2 == 0) count[bins - 1].fill_(1.0);
  return count;
}

// [M, ρ + 1] complex128: c_m exp(-2 pi i g m / M) for the bins g of the grid M = 2ρ + 1 and
// the lags m from 0 to ρ, c_0 = 1/4 and c_m = 1/2 beyond: P of correlation_blocks (§3.5).
at::Tensor block_phases(int64_t reach, const at::TensorOptions& opts) {
  auto weight = at::full({reach + 1}, 0.5, opts.dtype(at::kDouble));
  weight[0].fill_(0.25);
  const at::Tensor m = at::arange(reach + 1, opts.dtype(at::kLong));
  return lag_phases(2 * reach + 1, 2 * reach + 1, 1, m).conj_physical().mul_(weight);
}

// The S stage's coefficients, over every fh of the grid Lh: lag_phases for the h lags 0 .. reach.
at::Tensor s_stage_coefficients(int64_t size, const Lags& lags, const at::TensorOptions& opts) {
  const at::Tensor m = at::arange(lags.reach[1] + 1, opts.dtype(at::kLong));
  return lag_phases(size, size, lags.step[1], m);
}

// The W stage's coefficients, over the kept fw of the real FFT: lag_spectrum_phases weighted
// by mirror_count (§3.5: the real part, taken by correlation_blocks, adds the mirrored bins).
at::Tensor w_stage_coefficients(int64_t size, const Lags& lags, const at::TensorOptions& opts) {
  return lag_spectrum_phases(size, size / 2 + 1, lags.step[2], lags.reach[2], opts)
      .mul_(mirror_count(size, opts).unsqueeze(1));
}

// [bins, k'] complex128: dim d's forward DFT on the grid M = 2k' - 1 of a sub-kernel's k'
// taps (conjugated lag_phases), M bins for d and h and the M / 2 + 1 of a real DFT for w:
// a sub-kernel's spectrum is their product over the dims (Backend::tap_spectrum).
at::Tensor tap_dft(const Lags& lags, int d, const at::TensorOptions& opts) {
  const int64_t taps = lags.reach[d] + 1, size = 2 * taps - 1, bins = d == 2 ? size / 2 + 1 : size;
  return lag_phases(size, bins, 1, at::arange(taps, opts.dtype(at::kLong))).conj_physical();
}

// What the path needs of the geometry alone, on the device (table_cache.h).
struct Tables {
  at::Tensor coef_s, coef_w, coef_d;  // the S, W and D stages' coefficients (correlation_spectrum)
  // With one depth frequency and one depth bin (a grid Ld = Md = 1: border's plane problems,
  // docs/math.md §3.6), the D stage is the scaling by coef_d's one entry, 1 / |L|: coef_w
  // divided by |L|, so that the W stage writes Z^ itself. Undefined otherwise.
  at::Tensor coef_wd;
  at::Tensor coef_s_float;            // coef_s as complex64, for float32 spectra: a copy kernel per call less
  at::Tensor blocks;                  // correlation_blocks' phases, [Mh, ρh + 1]
  at::Tensor mirror;                  // phase_energies' mirror counts over |M|, [ρw + 1]
  at::Tensor dft[3];                  // tap_dft of each dim
  at::Tensor slots;                   // tap_slots
};

Tables build_tables(const ConvGeometry& g, const ConvGeometry& sub, const at::TensorOptions& opts) {
  const Lags lags(sub);
  const int64_t* grid = sub.out_size;
  const double size = static_cast<double>(grid[0] * grid[1] * grid[2]);
  Tables t;
  t.coef_s = s_stage_coefficients(grid[1], lags, opts);
  t.coef_s_float = t.coef_s.to(at::kComplexFloat);
  t.coef_w = w_stage_coefficients(grid[2], lags, opts);
  t.coef_d = lag_spectrum_phases(grid[0], grid[0], lags.step[0], lags.reach[0], opts).div_(size);  // R's 1 / |L|
  if (grid[0] == 1 && lags.reach[0] == 0) t.coef_wd = t.coef_w.div(size);  // coef_d: [[1 / |L|]]
  t.blocks = block_phases(lags.reach[1], opts);
  t.mirror = mirror_count(2 * lags.reach[2] + 1, opts).div_(static_cast<double>(lags.count()));  // §3.5's 1 / |M|
  for (int d = 0; d < 3; ++d) t.dft[d] = tap_dft(lags, d, opts);
  t.slots = tap_slots(g, sub, opts.dtype(at::kLong));
  return t;
}

// The tables of g's geometry on x's device, cached per device (table_cache.h); they do
// not depend on the batch, the channels or the dtype.
Tables tables_for(const Backend& backend, const ConvGeometry& g, const ConvGeometry& sub,
                  const at::Tensor& x) {
  static auto* cache = new TableCache<Tables>();  // never destroyed: CUDA tensors at exit
  std::vector<int64_t> key;
  for (int d = 0; d < 3; ++d) {
    key.insert(key.end(), {g.in_size[d], g.kernel[d], g.stride[d], g.dilation[d], g.padding[d],
                           g.output_padding[d]});
  }
  return cache->get(std::move(key), x.device(), backend.build_tables_apart,
                    [&] { return build_tables(g, sub, x.options()); });
}

// R^, the DFT on the grid M of x's cross-correlation R' centred on its grid mean (the DC
// bin left out), as the backend's correlation_blocks: [Md, Mh, Mw/2 + 1, G, Cig, Cig]
// complex128 (§3.5). The backend's S stage runs for a chunk of depth frequencies at a
// time and its W stage on that chunk; its D stage takes the W stage's output to Z^, already
// at the bins g_d, g_w of M and the lags m_h >= 0: once over every depth frequency where
// that output may be kept (keep_w_stage_output), else per chunk, adding the chunk's terms to Z^.
at::Tensor correlation_spectrum(const Backend& backend, const at::Tensor& x_spec, const int64_t grid[3],
                                const Tables& tables, int64_t groups) {
  const int64_t cig = x_spec.size(4) / groups, entries = groups * cig * cig, lwf = x_spec.size(2);
  const at::Tensor &coef_s = tables.coef_s, &coef_w = tables.coef_w, &coef_d = tables.coef_d;
  const int64_t lags_h = coef_s.size(1), mw = coef_w.size(1), md = coef_d.size(1), columns = lags_h * entries;
  const int64_t fd_bytes = lwf * columns * x_spec.element_size();
  const int64_t most = std::clamp<int64_t>(chunk_budget(x_spec, 1, kMaxRowsBytes) / fd_bytes, 1, grid[0]);
  // Balanced chunks, no small last one (20 depth frequencies at most 8 a chunk go as 7, 7
  // and 6, not 8, 8 and 4): the same GPU time, less peak memory (docs/performance.md).
  const int64_t chunks = (grid[0] + most - 1) / most, chunk = (grid[0] + chunks - 1) / chunks;
  // The D stage's output Z^ is complex128; the W stage's is in x's spectrum's dtype, as Q is:
  // for float32 x its float64 sums are rounded once to complex64, and the W stage writes and
  // the D stage reads half the bytes (seed: 29.5 MB instead of 59; docs/performance.md).
  const at::TensorOptions lag_options = coef_w.options().dtype(at::kComplexDouble);
  const at::TensorOptions w_options = coef_w.options().dtype(x_spec.scalar_type());
  const bool deferred =
      keep_w_stage_output(chunks, grid[0] * mw * columns * x_spec.element_size(), x_spec);
  const at::Tensor coef_s_x = x_spec.scalar_type() == at::kComplexFloat ? tables.coef_s_float : coef_s;
  const auto blocks = [&](const at::Tensor& r) {
    return backend.correlation_blocks(r.view({md, mw, lags_h, groups, cig, cig}), tables.blocks);
  };
  if (tables.coef_wd.defined()) {  // one depth frequency and bin: the W stage writes Z^ (Tables::coef_wd)
    at::Tensor r = at::empty({1, mw, columns}, lag_options);
    backend.lag_stage(backend.cross_spectrum_rows(x_spec, 0, 1, coef_s_x, groups).view({1, lwf, columns}),
                      tables.coef_wd, r, false);
    return blocks(r);
  }
  const at::Tensor p_all = deferred ? at::empty({grid[0], mw, columns}, w_options) : at::Tensor();
  at::Tensor r = deferred ? at::empty({1, md, mw * columns}, lag_options)
                          : at::zeros({1, md, mw * columns}, lag_options);
  for (int64_t fd0 = 0; fd0 < grid[0]; fd0 += chunk) {
    const int64_t n = std::min(chunk, grid[0] - fd0);
    const at::Tensor q = backend.cross_spectrum_rows(x_spec, fd0, n, coef_s_x, groups);
    at::Tensor p = deferred ? p_all.narrow(0, fd0, n) : at::empty({n, mw, columns}, w_options);
    backend.lag_stage(q.view({n, lwf, columns}), coef_w, p, false);
    if (!deferred) backend.lag_stage(p.view({1, n, mw * columns}), coef_d.narrow(0, fd0, n), r, true);
  }
  if (deferred) backend.lag_stage(p_all.view({1, grid[0], mw * columns}), coef_d, r, false);
  return blocks(r);
}

// [S, G, Cog] double, S rows to be added (the finalize adds them, finalize.h): sum over
// the phases r of sum_{m, m'} w_r[:, c, m]^T R'(m - m') w_r[:, c, m'], as
// (1 / |M|) sum_g W_r(g)^H R^(g) W_r(g) on the grid M = 2k' - 1 per dim, where both DFTs
// are exact (§3.5). One chunk of one phase (the seed problem) leaves its S partial sums
// (Backend::quad_forms) unadded: four small kernels fewer per call (a reduction, a copy, a sum
// over the phases and a scaling). blocks: R^ (correlation_spectrum), complex.
// budget: bytes of the sub-kernels' spectra per chunk of output channels.
// stack: the sub-kernels, [k'd, k'h, k'w, G, Cig, P, Cog] (sub_kernels), so that their DFT
// comes out with a frequency's [Cig, P Cog] matrix contiguous.
at::Tensor phase_energies(const Backend& backend, const at::Tensor& blocks, const at::Tensor& stack,
                          const Tables& tables, int64_t budget) {
  const int64_t groups = stack.size(3), cig = stack.size(4), phases = stack.size(5),
                cog = stack.size(6);
  const int64_t bins = blocks.size(0) * blocks.size(1) * blocks.size(2);
  const int64_t channel_bytes = bins * groups * cig * phases * 16;
  const int64_t chunk = std::clamp<int64_t>(budget / channel_bytes, 1, cog);
  // [S, G, P n]: the quadratic forms of the output channels c0 .. c0 + n - 1.
  auto quad_forms = [&](int64_t c0, int64_t n) {
    // [Md, Mh, Mwf, G, 2 Cig, P n], a channel's real parts' row, then its imaginary parts':
    // the order that serves both the GEMM and the quadratic forms, R^'s interleaved real form.
    const at::Tensor taps = stack.narrow(6, c0, n).flatten(3, 5);  // [k'd, k'h, k'w, G Cig P, n], a view
    const at::Tensor w_hat =
        backend.tap_spectrum(taps, tables.dft[0], tables.dft[1], tables.dft[2], groups * cig)
                                 .view({blocks.size(0), blocks.size(1), blocks.size(2), groups, 2 * cig, phases * n});
    return backend.quad_forms(blocks, w_hat, tables.mirror);
  };
  if (phases == 1 && chunk == cog) return quad_forms(0, cog);
  auto energy = at::empty({groups, phases, cog}, stack.options().dtype(at::kDouble));
  for (int64_t c0 = 0; c0 < cog; c0 += chunk) {
    const int64_t n = std::min(chunk, cog - c0);
    energy.narrow(2, c0, n).copy_(quad_forms(c0, n).sum(0).view({groups, phases, n}));
  }
  return energy.sum(1).unsqueeze(0);
}

// The sub-kernels as phase_energies takes them, [k'd, k'h, k'w, G, Cig, P, Cog]: with one
// phase (stride 1) the weight itself, a view in its dtype that the backend reads in place
// or copies as it needs (Backend::tap_spectrum); else phase_stack's gather, in float64.
at::Tensor sub_kernels(const at::Tensor& weight, const ConvGeometry& g, const ConvGeometry& sub,
                       const at::Tensor& slots) {
  constexpr std::array<int64_t, 7> order = {4, 5, 6, 0, 1, 3, 2};
  if (phase_count(g) > 1) return phase_stack(weight, g, sub, slots).permute(order).contiguous();
  return weight
      .reshape({g.groups, g.in_group_channels(), g.out_group_channels(), 1, sub.kernel[0], sub.kernel[1],
                sub.kernel[2]})
      .permute(order);
}

}  // namespace

at::Tensor cross_spectrum_rows_aten(const at::Tensor& x_spec, int64_t fd0, int64_t count,
                                    const at::Tensor& coef, int64_t groups) {
  const at::NoTF32Guard exact;
  const int64_t lh = x_spec.size(1), lwf = x_spec.size(2), batch = x_spec.size(3);
  const int64_t cig = x_spec.size(4) / groups;
  const at::Tensor xs =  // [count, Lwf, Lh, G, B, Cig]
      x_spec.narrow(0, fd0, count).view({count, lh, lwf, batch, groups, cig}).transpose(3, 4).transpose(1, 2);
  // conj_physical: with a lazy conj view, the first call under
  // torch.compile on the CPU (torch 2.14) returns wrong values (tests/test_tooling_families.py).
  at::Tensor s = at::matmul(xs.conj_physical().transpose(-1, -2), xs);  // [count, Lwf, Lh, G, Cig, Cig]
  if (fd0 == 0) s[0][0][0].zero_();  // the DC bin is left out (§3.5)
  const at::Tensor q =
      at::matmul(coef.to(s.scalar_type()).t(), s.reshape({count * lwf, lh, groups * cig * cig}));
  return q.view({count, lwf, coef.size(1), groups, cig, cig});
}

// P + P^H, P = sum_{m_h} phases[g_h, m_h] (Z^(g) + conj(Z^(-g))) (§3.5), g = (g_d, g_w), -g
// of index k at index (M - k) mod M: a flip, then a roll by one; only the bins
// g_w <= (Mw - 1) / 2 kept, as [Md, Mh, Mwh].
at::Tensor correlation_blocks_aten(const at::Tensor& z_hat, const at::Tensor& phases) {
  const int64_t md = z_hat.size(0), mw = z_hat.size(1), lags = z_hat.size(2), mh = phases.size(0);
  const int64_t mwh = (mw + 1) / 2, entries = z_hat.numel() / (md * mw * lags);
  const at::Tensor u = z_hat + z_hat.flip({0, 1}).roll({1, 1}, {0, 1}).conj_physical();
  const at::Tensor p = at::matmul(phases, u.narrow(1, 0, mwh).reshape({md * mwh, lags, entries}))
                           .view({md, mwh, mh, z_hat.size(3), z_hat.size(4), z_hat.size(5)})
                           .transpose(1, 2);
  return (p + p.transpose(-1, -2).conj_physical()).contiguous();
}

at::Tensor interleaved_real_form(const at::Tensor& blocks) {
  const at::Tensor parts = at::view_as_real(blocks);
  const at::Tensor re = parts.select(-1, 0), im = parts.select(-1, 1);
  // [..., Cig (i), 2 (a), Cig (k), 2 (b)]: rows 2i (Re, -Im) and 2i + 1 (Im, Re) over columns 2k, 2k + 1
  const at::Tensor form = at::stack({at::stack({re, -im}, -1), at::stack({im, re}, -1)}, -3);
  std::vector<int64_t> shape(blocks.sizes().begin(), blocks.sizes().end());
  shape.end()[-2] *= 2;
  shape.end()[-1] *= 2;
  return form.reshape(shape);
}

at::Tensor quad_forms_aten(const at::Tensor& blocks, const at::Tensor& w_hat, const at::Tensor& mirror) {
  const at::Tensor quad = at::mul(w_hat, at::matmul(interleaved_real_form(blocks), w_hat)).sum(4);
  return quad.mul_(mirror.view({1, 1, -1, 1, 1})).sum(at::IntArrayRef{0, 1, 2}).unsqueeze(0);
}

// One dim at a time (docs/math.md §3.5): on the seed problem 5.5 times fewer real multiply-adds
// per column than the three tables' product as one matrix in one GEMM.
at::Tensor tap_spectrum_aten(const at::Tensor& taps, const at::Tensor& dft_d, const at::Tensor& dft_h,
                             const at::Tensor& dft_w, int64_t rows) {
  const int64_t kd = taps.size(0), kh = taps.size(1), kw = taps.size(2), cols = taps.size(3) * taps.size(4);
  const int64_t bd = dft_d.size(0), bh = dft_h.size(0), bw = dft_w.size(0);
  at::Tensor t = at::matmul(dft_d, taps.reshape({kd, -1}).to(at::kComplexDouble));  // [bd, kh kw cols]
  t = at::matmul(dft_h, t.view({bd, kh, kw * cols}));                              // [bd, bh, kw cols]
  t = at::matmul(dft_w, t.view({bd * bh, kw, cols}));                              // [bd bh, bw, cols]
  return at::view_as_real(t.view({bd * bh * bw, rows, cols / rows})).permute({0, 1, 3, 2}).contiguous();
}

void lag_stage_aten(const at::Tensor& q, const at::Tensor& coef, at::Tensor& out, bool accumulate) {
  const at::Tensor terms = at::matmul(coef.t().to(at::kComplexDouble), q.to(at::kComplexDouble));
  if (accumulate) {
    out.add_(terms);
  } else {
    out.copy_(terms);
  }
}

std::tuple<at::Tensor, at::Tensor> x_lag_spectrum(const Backend& backend, const at::Tensor& x,
                                                  const ConvGeometry& g) {
  const ConvGeometry sub = phase_geometry(g);
  const Tables tables = tables_for(backend, g, sub, x);
  at::Tensor x_spec = x_spectrum(x, sub.out_size, backend.spectrum_kernels);
  at::Tensor lags = correlation_spectrum(backend, x_spec, sub.out_size, tables, g.groups);
  return {std::move(lags), std::move(x_spec)};
}

at::Tensor energy_cross_spectrum(const Backend& backend, const at::Tensor& x,
                                 const at::Tensor& weight, const SampleSumTensors& sums,
                                 const ConvGeometry& g) {
  const ConvGeometry sub = phase_geometry(g);
  const Tables tables = tables_for(backend, g, sub, x);
  at::Tensor blocks;
  int64_t weight_budget = 0;
  {  // x's spectrum is freed before the contraction
    const at::Tensor x_spec = x_spectrum(x, sub.out_size, backend.spectrum_kernels, sums.spectrum_channel_sums());
    blocks = correlation_spectrum(backend, x_spec, sub.out_size, tables, g.groups);
    weight_budget = weight_chunk_budget(x_spec, blocks);
  }
  const at::Tensor energy =  // [S, Co, 1]
      phase_energies(backend, blocks, sub_kernels(weight, g, sub, tables.slots), tables, weight_budget)
          .view({-1, g.out_channels, 1});
  if (is_full_convolution(g)) return energy;
  const at::Tensor correction = phase_sum_correction(weight, sums, g, sub, tables.slots);
  return energy.sum(0, true).add_(correction.view({1, g.out_channels, 1}));
}

}  // namespace fused_ops
