#include "validate.h"

#include <initializer_list>
#include <string>

#include "message.h"

namespace fused_ops {
namespace {

void check_same_device(const at::Tensor& t, const char* name, const at::Tensor& like,
                       const char* like_name) {
  TORCH_CHECK(t.device() == like.device(), "ct_bn_pool: ", name, " must be on the same device as ",
              like_name, " (", to_str(like.device()), "), got ", to_str(t.device()));
}

// `want_from`: what fixes the dtype `t` must have, for the message.
void check_dtype(const at::Tensor& t, const char* name, at::ScalarType want, const char* want_from) {
  TORCH_CHECK(t.scalar_type() == want, "ct_bn_pool: ", name, " must have the same dtype as ",
              want_from, " (", to_str(want), "), got ", to_str(t.scalar_type()));
}

// The conv's dtype T: x, weight and bias share it, as nn.ConvTranspose3d requires.
void check_conv_dtype(at::ScalarType dtype, const char* name) {
  TORCH_CHECK(dtype == at::kHalf || dtype == at::kBFloat16 || dtype == at::kFloat ||
                  dtype == at::kDouble,
              "ct_bn_pool: ", name, " must be float16, bfloat16, float32 or float64, got ",
              to_str(dtype));
}

bool present(const c10::optional<at::Tensor>& t) { return t.has_value() && t->defined(); }

// Shape and device of a per-output-channel vector.
void check_channel_vector(const c10::optional<at::Tensor>& t, const char* name, int64_t channels,
                          const at::Tensor& like, const char* like_name = "x") {
  if (!present(t)) return;
  TORCH_CHECK(t->dim() == 1 && t->size(0) == channels, "ct_bn_pool: ", name,
              " must have shape [", to_str(channels),
              "] (one value per output channel), got ", to_str(t->sizes()));
  check_same_device(*t, name, like, like_name);
}

struct NamedTensor {
  const c10::optional<at::Tensor>& tensor;
  const char* name;
};

// BatchNorm's parameters and running statistics share one dtype P: the conv's
// dtype T, or float32 when T is float16 or bfloat16 (the mixed precision
// nn.BatchNorm3d accepts). The first one given fixes P for the others.
void check_batch_norm_dtypes(std::initializer_list<NamedTensor> bn, at::ScalarType conv_dtype,
                             const char* conv_dtype_from) {
  const NamedTensor* first = nullptr;
  for (const NamedTensor& t : bn) {
    if (!present(t.tensor)) continue;
    if (first) {
      check_dtype(*t.tensor, t.name, first->tensor->scalar_type(), first->name);
      continue;
    }
    first = &t;
    const at::ScalarType p = t.tensor->scalar_type();
    if (conv_dtype == at::kHalf || conv_dtype == at::kBFloat16) {
      TORCH_CHECK(p == conv_dtype || p == at::kFloat, "ct_bn_pool: ", t.name,
                  " must have the same dtype as ", conv_dtype_from, " (", to_str(conv_dtype),
                  ") or be float32, got ", to_str(p));
    } else {
      check_dtype(*t.tensor, t.name, conv_dtype, conv_dtype_from);
    }
  }
}

void check_triple(at::IntArrayRef v, const char* name, int64_t min_value) {
  TORCH_CHECK(v.size() == 3, "ct_bn_pool: ", name, " must have 3 values (D, H, W), got ", to_str(v));
  for (int64_t e : v) {
    TORCH_CHECK_VALUE(e >= min_value, "ct_bn_pool: ", name, " must be >= ", to_str(min_value),
                      " in every dimension, got ", to_str(v));
  }
}

}  // namespace

ConvGeometry validate_inputs(const at::Tensor& x, const at::Tensor& weight,
                             const c10::optional<at::Tensor>& bias,
                             const c10::optional<at::Tensor>& bn_weight,
                             const c10::optional<at::Tensor>& bn_bias,
                             const c10::optional<at::Tensor>& running_mean,
                             const c10::optional<at::Tensor>& running_var, bool training, double eps,
                             at::IntArrayRef stride, at::IntArrayRef padding,
                             at::IntArrayRef output_padding, at::IntArrayRef dilation,
                             int64_t groups, bool one_of_many) {
  TORCH_CHECK(x.dim() == 5, "ct_bn_pool: x must be a 5-D tensor [B, C_in, D, H, W], got ",
              to_str(x.dim()), "-D with shape ", to_str(x.sizes()));
  check_conv_dtype(x.scalar_type(), "x");
  // An empty batch is a batch (as nn.BatchNorm3d takes it): the output is empty, nothing is
  // updated; a process's share of a synchronized batch may hold no samples either.
  const bool empty_batch = x.size(0) == 0 && x.size(1) * x.size(2) * x.size(3) * x.size(4) > 0;
  TORCH_CHECK(x.numel() > 0 || empty_batch, "ct_bn_pool: x must have non-empty channel and spatial dims, got shape ",
              to_str(x.sizes()));
  TORCH_CHECK(weight.dim() == 5,
              "ct_bn_pool: weight must be a 5-D ConvTranspose3d weight [C_in, C_out/groups, kD, kH, "
              "kW], got shape ",
              to_str(weight.sizes()));
  check_same_device(weight, "weight", x, "x");
  check_dtype(weight, "weight", x.scalar_type(), "x");
  TORCH_CHECK_VALUE(groups >= 1, "ct_bn_pool: groups must be >= 1, got ", to_str(groups));
  TORCH_CHECK(weight.size(0) == x.size(1), "ct_bn_pool: weight.size(0) must equal x.size(1) = ",
              to_str(x.size(1)), " (input channels), got weight shape ", to_str(weight.sizes()));
  TORCH_CHECK_VALUE(x.size(1) % groups == 0, "ct_bn_pool: input channels (", to_str(x.size(1)),
                    ") must be divisible by groups (", to_str(groups), ")");
  TORCH_CHECK(weight.numel() > 0, "ct_bn_pool: weight must be non-empty, got shape ",
              to_str(weight.sizes()));
  check_triple(stride, "stride", 1);
  check_triple(padding, "padding", 0);
  check_triple(output_padding, "output_padding", 0);
  check_triple(dilation, "dilation", 1);

  ConvGeometry g;
  g.batch = x.size(0);
  g.in_channels = x.size(1);
  g.groups = groups;
  g.out_channels = weight.size(1) * groups;
  for (int d = 0; d < 3; ++d) {
    g.in_size[d] = x.size(2 + d);
    g.kernel[d] = weight.size(2 + d);
    g.stride[d] = stride[d];
    g.padding[d] = padding[d];
    g.dilation[d] = dilation[d];
    g.output_padding[d] = output_padding[d];
    TORCH_CHECK_VALUE(output_padding[d] < stride[d] || output_padding[d] < dilation[d],
                      "ct_bn_pool: output_padding must be smaller than either stride or dilation, "
                      "got output_padding ",
                      to_str(output_padding), ", stride ", to_str(stride), ", dilation ",
                      to_str(dilation));
    g.out_size[d] = conv_transpose_out_size(g.in_size[d], g.kernel[d], g.stride[d], g.padding[d],
                                            g.dilation[d], g.output_padding[d]);
    TORCH_CHECK(g.out_size[d] >= 1, "ct_bn_pool: the conv-transpose output would be empty (size ",
                to_str(g.out_size[d]), " in spatial dim ", to_str(int64_t(d)), "): padding ",
                to_str(padding), " is too large for input ", to_str(x.sizes()), " and kernel ",
                to_str(weight.sizes()));
  }

  check_channel_vector(bias, "bias", g.out_channels, x);
  check_channel_vector(bn_weight, "bn_weight", g.out_channels, x);
  check_channel_vector(bn_bias, "bn_bias", g.out_channels, x);
  check_channel_vector(running_mean, "running_mean", g.out_channels, x);
  check_channel_vector(running_var, "running_var", g.out_channels, x);
  if (present(bias)) check_dtype(*bias, "bias", x.scalar_type(), "x");
  check_batch_norm_dtypes({{bn_weight, "bn_weight"},
                           {bn_bias, "bn_bias"},
                           {running_mean, "running_mean"},
                           {running_var, "running_var"}},
                          x.scalar_type(), "x");
  TORCH_CHECK_VALUE(present(running_mean) == present(running_var),
                    "ct_bn_pool: running_mean and running_var must be given together or both be "
                    "None");
  TORCH_CHECK_VALUE(training || present(running_mean),
                    "ct_bn_pool: training=False normalizes with running statistics, so "
                    "running_mean and running_var are required (pass training=True for batch "
                    "statistics)");
  // As F.batch_norm: eps > 0 where it normalizes by batch statistics, >= 0 by running ones.
  if (training) {
    TORCH_CHECK_VALUE(eps > 0, "ct_bn_pool: eps must be positive in training mode, got ", to_str(eps));
  } else {
    TORCH_CHECK_VALUE(eps >= 0, "ct_bn_pool: eps must be non-negative, got ", to_str(eps));
  }
  // As F.batch_norm: one value per channel has no variance; an empty batch is no statistic.
  if (training && !one_of_many) {
    TORCH_CHECK_VALUE(g.batch * g.out_spatial() != 1,
                      "ct_bn_pool: Expected more than 1 value per channel when training, got ",
                      to_str(g.batch * g.out_spatial()), " (batch ", to_str(g.batch),
                      " x output size ", to_str(at::IntArrayRef(g.out_size, 3)), ")");
  }
  return g;
}

ConvGeometry validate_apply_inputs(const at::Tensor& sample_sums, const at::Tensor& stats,
                                   int64_t spatial, const c10::optional<at::Tensor>& bias,
                                   const c10::optional<at::Tensor>& bn_weight,
                                   const c10::optional<at::Tensor>& bn_bias,
                                   const c10::optional<at::Tensor>& running_mean,
                                   const c10::optional<at::Tensor>& running_var, double eps,
                                   at::ScalarType dtype) {
  TORCH_CHECK(sample_sums.dim() == 2 && sample_sums.scalar_type() == at::kDouble,
              "ct_bn_pool: sample_sums must be a float64 [B, C_out] tensor, got ",
              to_str(sample_sums.scalar_type()), " of shape ", to_str(sample_sums.sizes()));
  TORCH_CHECK(sample_sums.size(1) > 0, "ct_bn_pool: sample_sums must have at least one channel");
  const int64_t channels = sample_sums.size(1);
  TORCH_CHECK(stats.dim() == 2 && stats.size(0) == 3 && stats.size(1) == channels,
              "ct_bn_pool: stats must have shape [3, ", to_str(channels),
              "] (count, mean, m2 per channel), got ", to_str(stats.sizes()));
  check_same_device(stats, "stats", sample_sums, "sample_sums");
  check_dtype(stats, "stats", at::kDouble, "sample_sums");
  TORCH_CHECK_VALUE(spatial >= 1, "ct_bn_pool: spatial must be >= 1, got ", to_str(spatial));
  check_conv_dtype(dtype, "dtype");
  check_channel_vector(bias, "bias", channels, sample_sums, "sample_sums");
  check_channel_vector(bn_weight, "bn_weight", channels, sample_sums, "sample_sums");
  check_channel_vector(bn_bias, "bn_bias", channels, sample_sums, "sample_sums");
  check_channel_vector(running_mean, "running_mean", channels, sample_sums, "sample_sums");
  check_channel_vector(running_var, "running_var", channels, sample_sums, "sample_sums");
  if (present(bias)) check_dtype(*bias, "bias", dtype, "the dtype argument");
  check_batch_norm_dtypes({{bn_weight, "bn_weight"},
                           {bn_bias, "bn_bias"},
                           {running_mean, "running_mean"},
                           {running_var, "running_var"}},
                          dtype, "the dtype argument");
  TORCH_CHECK_VALUE(present(running_mean) == present(running_var),
                    "ct_bn_pool: running_mean and running_var must be given together or both be "
                    "None");
  TORCH_CHECK_VALUE(eps > 0, "ct_bn_pool: eps must be positive, got ", to_str(eps));
  ConvGeometry g{};
  g.batch = sample_sums.size(0);
  g.out_channels = channels;
  g.groups = 1;
  g.out_size[0] = spatial;
  g.out_size[1] = g.out_size[2] = 1;
  return g;
}

EnergyAlgo parse_energy_algo(c10::string_view algo, const Backend& backend, const ConvGeometry& g,
                             at::ScalarType input_dtype) {
  const at::ScalarType dtype = compute_dtype(input_dtype);
  if (algo == "auto") return backend.auto_energy_algo(g, dtype);
  if (algo == "direct") return EnergyAlgo::Direct;
  if (algo == "sliced_conv") return EnergyAlgo::SlicedConv;
  if (algo == "fft") {
    TORCH_CHECK_VALUE(backend.energy_fft != nullptr,
                      "ct_bn_pool: algo='fft' is implemented for CUDA tensors only; use 'auto', "
                      "'direct' or 'sliced_conv' on this device");
    TORCH_CHECK_VALUE(backend.fft_applies(g, dtype),
                      "ct_bn_pool: algo='fft' needs float32, float16 or bfloat16 and padding 0 "
                      "(any stride, dilation and output_padding) and a kernel height per stride "
                      "phase (kH at stride 1, else dilation (kH - 1) / stride + 1) of at most 16; "
                      "got dtype ",
                      to_str(input_dtype), ", padding ", to_str(at::IntArrayRef(g.padding, 3)),
                      ", kernel ", to_str(at::IntArrayRef(g.kernel, 3)), ", stride ",
                      to_str(at::IntArrayRef(g.stride, 3)), ", dilation ",
                      to_str(at::IntArrayRef(g.dilation, 3)), " (use 'auto')");
    return EnergyAlgo::Fft;
  }
  if (algo == "correlation" || algo == "cross_spectrum") {  // both count x's lags (§3.4, §3.5)
    TORCH_CHECK_VALUE(!g.has_padding(), "ct_bn_pool: algo='", std::string(algo),
                      "' needs padding 0 (any stride, dilation and output_padding); got padding ",
                      to_str(at::IntArrayRef(g.padding, 3)), " (use 'auto')");
    return algo == "correlation" ? EnergyAlgo::Correlation : EnergyAlgo::CrossSpectrum;
  }
  if (algo == "border") {  // a crop of the padding-0 grid (§3.6): there is none without padding
    TORCH_CHECK_VALUE(g.has_padding(),
                      "ct_bn_pool: algo='border' needs padding > 0 in some dim; got padding ",
                      to_str(at::IntArrayRef(g.padding, 3)), " (use 'auto')");
    return EnergyAlgo::Border;
  }
  TORCH_CHECK_VALUE(false,
                    "ct_bn_pool: algo must be one of 'auto', 'fft', 'direct', 'sliced_conv', "
                    "'correlation', 'cross_spectrum', 'border', got '",
                    std::string(algo), "'");
  return EnergyAlgo::Direct;
}

}  // namespace fused_ops
