#include "common/cuda/co_resident.h"

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <tuple>

namespace fused_ops {
namespace {

// Registers are allocated per warp in units of 256, shared memory per block in
// units of 128 bytes plus what the device reserves per block (sm_80, sm_90).
int64_t block_registers(const KernelFootprint& k) {
  const int64_t per_warp = (static_cast<int64_t>(k.regs) * 32 + 255) / 256 * 256;
  return (k.threads + 31) / 32 * per_warp;
}

int64_t block_smem(const KernelFootprint& k, const cudaDeviceProp& p) {
  return (k.smem + 127) / 128 * 128 + static_cast<int64_t>(p.reservedSharedMemPerBlock);
}

bool fits_beside(int kx, const KernelFootprint& x, const KernelFootprint& f,
                 const cudaDeviceProp& p) {
  return static_cast<int64_t>(kx) * x.threads + f.threads <= p.maxThreadsPerMultiProcessor &&
         kx + 1 <= p.maxBlocksPerMultiProcessor &&
         kx * block_registers(x) + block_registers(f) <= p.regsPerMultiprocessor &&
         kx * block_smem(x, p) + block_smem(f, p) <= static_cast<int64_t>(p.sharedMemPerMultiprocessor);
}

}  // namespace

KernelFootprint kernel_footprint(const void* kernel, int threads, int64_t dynamic_smem) {
  // Asked once per (device, kernel): these are driver calls, costly beside the host time of a
  // whole eval call.
  static std::mutex mutex;
  static std::map<std::tuple<int, const void*>, KernelFootprint> cache;
  int device = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  const std::lock_guard<std::mutex> lock(mutex);
  auto it = cache.find({device, kernel});
  if (it == cache.end()) {
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                        cudaSharedmemCarveoutMaxShared));
    cudaFuncAttributes attr;
    C10_CUDA_CHECK(cudaFuncGetAttributes(&attr, kernel));
    KernelFootprint f;
    f.regs = attr.numRegs;
    f.smem = static_cast<int64_t>(attr.sharedSizeBytes);
    it = cache.emplace(std::make_tuple(device, kernel), f).first;
  }
  KernelFootprint f = it->second;
  f.threads = threads;
  f.smem += dynamic_smem;
  return f;
}

int blocks_per_sm_leaving_room(const void* x, const KernelFootprint& x_block,
                               const KernelFootprint& room) {
  static std::mutex mutex;  // cached as kernel_footprint, per device and footprints
  static std::map<std::tuple<int, const void*, int, int, int, int64_t, int64_t>, int> cache;
  int device = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  const auto key = std::make_tuple(device, x, x_block.threads, room.threads, room.regs, room.smem,
                                   x_block.smem);
  const std::lock_guard<std::mutex> lock(mutex);
  const auto it = cache.find(key);
  if (it != cache.end()) return it->second;
  int most = 0;  // x takes no dynamic shared memory
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&most, x, x_block.threads, 0));
  const cudaDeviceProp& p = *at::cuda::getCurrentDeviceProperties();
  int k = std::max(most, 1);
  while (k > 1 && !fits_beside(k, x_block, room, p)) --k;
  cache.emplace(key, k);
  return k;
}

}  // namespace fused_ops
