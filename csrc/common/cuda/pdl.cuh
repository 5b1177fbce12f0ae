#pragma once
// Programmatic dependent launch (sm_90 and later): a kernel launched with
// launch_overlapping may start while the kernel before it on the stream still
// runs, once every block of that kernel has called pdl_launch_dependents; it
// must call pdl_wait before it reads anything that kernel writes. What it reads
// before pdl_wait must not be written by the kernel before it (the earlier
// kernel itself was launched normally, so everything older is complete): the eval
// finalize (eval_finalize.cu) reads the weight and the BN inputs before its wait,
// so ct_bn_pool.cpp prepares them before the x pass. On older GPUs both calls
// compile to nothing and the launch is an ordinary one.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <cuda_runtime.h>

#include <utility>

#include "testing_hooks.h"

namespace fused_ops {

__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

template <typename... KernelArgs, typename... Args>
void launch_overlapping(void (*kernel)(KernelArgs...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                        Args&&... args) {
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = attr;
  // Route overlap='off' (fused_ops.testing) launches them one after another, as ordinary
  // launches: for profiling, where each kernel's time would otherwise include its wait for the
  // one before (scripts/profile_seed.py --no-overlap); the results are the same bits either way.
  const bool overlap =
      at::cuda::getCurrentDeviceProperties()->major >= 9 && forced_route(Knob::Overlap) != Route::Off;
  config.numAttrs = overlap ? 1 : 0;
  C10_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...));
}

template <typename... KernelArgs, typename... Args>
void launch_overlapping(void (*kernel)(KernelArgs...), dim3 grid, dim3 block, cudaStream_t stream,
                        Args&&... args) {
  launch_overlapping(kernel, grid, block, size_t{0}, stream, std::forward<Args>(args)...);
}

// The training path's chain of kernels (x's spectrum, the S, W and D stages, correlation_blocks,
// tap_spectrum, the fused contraction): each is launched with launch_overlapping and begins with
// pdl_chain_start, before it touches global memory, so the next kernel's launch and block
// scheduling overlap this one's last blocks instead of following them (docs/performance.md).
// Nothing is read or written before the wait, so the kernel
// before may be any kernel (its own predecessors complete when it does), and memory the
// caching allocator hands back between the launches is never touched early.
__device__ __forceinline__ void pdl_chain_start() {
  pdl_launch_dependents();
  pdl_wait();
}

}  // namespace fused_ops
