#pragma once
// The environment variables that force a kernel's other route where the default would take
// the first (FUSED_OPS_S_STAGE, FUSED_OPS_CONTRACTION: docs/math.md §3.5; FUSED_OPS_DIRECT:
// §3.1), so that the tests run each on one GPU, or turn the overlapping launches off
// (FUSED_OPS_OVERLAP, pdl.cuh). Read at every call: a test sets them within the process.
#include <ATen/ATen.h>

#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <string>

namespace fused_ops {

// Which of `routes` `variable` asks for: its index, or -1 where it is unset, empty or `auto`;
// any other value is an error naming the variable and the routes.
inline int forced_route(const char* variable, std::initializer_list<const char*> routes) {
  const char* v = std::getenv(variable);
  if (v == nullptr || v[0] == '\0' || std::strcmp(v, "auto") == 0) return -1;
  std::string accepted = "'auto'";
  int index = 0;
  for (const char* route : routes) {
    if (std::strcmp(v, route) == 0) return index;
    accepted += std::string(", '") + route + "'";
    ++index;
  }
  TORCH_CHECK(false, "ct_bn_pool: ", variable, " must be one of ", accepted, ", got '", v, "'");
  return -1;
}

// Whether `variable` asks for `route`, its one alternative to the default.
inline bool route_forced(const char* variable, const char* route) { return forced_route(variable, {route}) == 0; }

}  // namespace fused_ops
