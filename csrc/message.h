#pragma once
// Numbers in error messages are formatted here, never streamed: streaming an
// integer through std::ostream inside this library can crash on a supported setup
// (torch 2.11 on the H200 image: the extension's own num_put instantiation
// disagrees with the libstdc++ loaded at run time), so every TORCH_CHECK in
// csrc/ passes strings only.
#include <ATen/ATen.h>

#include <cstdio>
#include <string>

namespace fused_ops {

inline std::string to_str(int64_t v) { return std::to_string(v); }

inline std::string to_str(double v) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%g", v);
  return buf;
}

inline std::string to_str(at::IntArrayRef v) {
  std::string s = "[";
  for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
  return s + "]";
}

inline std::string to_str(const at::Device& d) { return d.str(); }

// The names Python users know (torch.float16, ...) for the dtypes the op takes.
inline std::string to_str(at::ScalarType t) {
  switch (t) {
    case at::kHalf: return "float16";
    case at::kBFloat16: return "bfloat16";
    case at::kFloat: return "float32";
    case at::kDouble: return "float64";
    default: return c10::toString(t);
  }
}

}  // namespace fused_ops
