#pragma once
// Staging copies into shared memory shared by the stride-1 direct kernels (ct_stats_stride1.cu,
// ct_stats_mma.cu).
#include <cuda_pipeline.h>

namespace fused_ops {

// One value copied to shared memory without passing through registers, or a zero where
// `inside` is false (src is then not read, but must be a valid address). A stage's copies are
// all in flight at once: through registers each store waited on its load (t8pad1's kernel
// 62.6 us so, 37.5 with the copies; docs/performance.md, 2026-12-01 21:28 and 21:35 UTC).
template <typename scalar_t>
__device__ __forceinline__ void copy_async(scalar_t* dst, const scalar_t* src, bool inside) {
  __pipeline_memcpy_async(dst, src, sizeof(scalar_t), inside ? 0 : sizeof(scalar_t));
}

}  // namespace fused_ops
