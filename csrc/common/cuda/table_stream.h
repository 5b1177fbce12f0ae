#pragma once
// Backend::table_stream on CUDA: the current stream of `device` as the id that geometry-only
// tables are cached under (common/table_cache.h), or -1 while it is being captured into a
// CUDA graph (a table made then would live in the graph's memory pool).
#include <ATen/ATen.h>

namespace fused_ops {

int64_t table_stream_cuda(const at::Device& device);

}  // namespace fused_ops
