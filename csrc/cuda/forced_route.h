#pragma once
// The environment variables that force a kernel's other route where the default would take
// the first (FUSED_OPS_S_STAGE, FUSED_OPS_CONTRACTION: docs/math.md §3.5), so that the tests
// run both on one GPU, or turn the overlapping launches off (FUSED_OPS_OVERLAP, pdl.cuh). Read
// at every call: a test sets them within the process.
#include <ATen/ATen.h>

#include <cstdlib>
#include <cstring>

namespace fused_ops {

// Whether `variable` asks for `route`: unset, empty or `auto` do not (the default); any other
// value is an error naming the variable.
inline bool route_forced(const char* variable, const char* route) {
  const char* v = std::getenv(variable);
  if (v == nullptr || v[0] == '\0' || std::strcmp(v, "auto") == 0) return false;
  TORCH_CHECK(std::strcmp(v, route) == 0, "ct_bn_pool: ", variable, " must be 'auto' or '", route, "', got '", v,
              "'");
  return true;
}

}  // namespace fused_ops
