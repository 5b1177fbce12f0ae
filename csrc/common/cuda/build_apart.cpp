#include "common/cuda/build_apart.h"

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <array>
#include <exception>
#include <mutex>
#include <thread>

namespace fused_ops {
namespace {

constexpr int kMaxDevices = 64;

// One stream per device, created by this library and never destroyed: not one of PyTorch's
// pooled streams, which a caller (a CUDA graph's capture among them) may be using.
c10::cuda::CUDAStream table_stream(c10::DeviceIndex index) {
  static std::array<cudaStream_t, kMaxDevices> streams{};
  static std::array<std::once_flag, kMaxDevices> made;
  TORCH_CHECK(index >= 0 && index < kMaxDevices, "fused_ops supports CUDA devices 0 to ", kMaxDevices - 1);
  std::call_once(made[index], [&] {
    const c10::cuda::CUDAGuard guard(index);
    C10_CUDA_CHECK(cudaStreamCreateWithFlags(&streams[index], cudaStreamNonBlocking));
  });
  return c10::cuda::getStreamFromExternal(streams[index], index);
}

}  // namespace

// cudaStreamIsCapturing is one of the calls capture allows. The tables read nothing the
// current stream writes (they depend on the geometry alone), so the build need not wait for it.
// The build runs on a thread of its own: torch.compile's CUDA graph trees route every
// allocation of the warming-up *thread* to the graph's pool, whatever the stream, and a table
// made there would stay in that pool untracked. A miss happens once per geometry and device.
bool build_tables_apart_cuda(const at::Device& device, c10::function_ref<void()> build) {
  const c10::cuda::CUDAGuard guard(device);
  const c10::cuda::CUDAStream current = at::cuda::getCurrentCUDAStream(device.index());
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  C10_CUDA_CHECK(cudaStreamIsCapturing(current.stream(), &status));
  if (status != cudaStreamCaptureStatusNone) return false;
  const c10::cuda::CUDAStream side = table_stream(device.index());
  std::exception_ptr failure;
  std::thread worker([&] {
    try {
      const c10::cuda::CUDAGuard on_device(device);
      const c10::cuda::CUDAStreamGuard on_side(side);
      build();
      side.synchronize();  // complete before any stream reads them
    } catch (...) {
      failure = std::current_exception();
    }
  });
  worker.join();
  if (failure) std::rethrow_exception(failure);
  return true;
}

}  // namespace fused_ops
