#pragma once
// Backend::build_tables_apart on CUDA (common/table_cache.h): cached tables built on a thread
// and a stream of this library's own and waited for, so that every stream may read them.
#include <ATen/ATen.h>
#include <c10/util/FunctionRef.h>

namespace fused_ops {

bool build_tables_apart_cuda(const at::Device& device, c10::function_ref<void()> build);

}  // namespace fused_ops
