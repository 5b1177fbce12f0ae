#pragma once
// Sizing a persistent grid so that the kernel launched after it with programmatic
// dependent launch (pdl.cuh) finds room on every SM from the start: eval mode's x
// pass leaves one finalize block per SM, which then reads the weight while x
// streams (docs/dispatch.md, "Kernel routes"; scripts/eval_variants.cu at f692131, V2/V5).
#include <cstdint>

namespace fused_ops {

// What one block of a kernel takes from an SM.
struct KernelFootprint {
  int threads = 0, regs = 0;  // threads per block; registers per thread
  int64_t smem = 0;           // static + dynamic shared memory per block, bytes
};

// The footprint of `kernel` launched with `threads` threads and `dynamic_smem`
// bytes on the current device. The first call per (device, kernel) also gives the
// kernel the largest shared-memory carveout: blocks of two kernels can share an SM
// only under one carveout, and the driver would otherwise pick one per kernel from
// its own needs.
KernelFootprint kernel_footprint(const void* kernel, int threads, int64_t dynamic_smem);

// Blocks per SM of kernel `x` (cudaOccupancyMaxActiveBlocksPerMultiprocessor; x
// takes no dynamic shared memory), less as many as needed for one block of `room`
// to fit beside them on the current device; at least 1.
int blocks_per_sm_leaving_room(const void* x, const KernelFootprint& x_block,
                               const KernelFootprint& room);

}  // namespace fused_ops
