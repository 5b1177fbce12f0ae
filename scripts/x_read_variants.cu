// Standalone microbenchmark of ways to read x once for eval mode's x pass
// (csrc/cuda/spatial_sum_x.cu): the same reduction (per-(row, part) sums of float32 x in
// double) done with different load instructions and pipeline designs, timed in one run on
// the same data, so that we learn whether anything reads x faster than the extension's
// __ldg kernel (~3.5 TB/s on an H200 against ~4.8 TB/s HBM3e peak). No torch: plain CUDA
// runtime + CUB.
//
//   nvcc -O3 -std=c++17 -arch=sm_90 scripts/x_read_variants.cu -o /tmp/x_read_variants
//   /tmp/x_read_variants [--only SUBSTR] [--iters N] [--warmup N]
//   (or: scripts/gpu_check.sh x-read-variants)
//
// x float32 [16, 64, 16, 32, 32] (64 MiB) seen as 1024 rows of 16384 floats, 2 parts per row:
// item it = part (it % 2) of row (it / 2), 8192 floats (32 KiB), out[it] its sum in double.
// Every variant is checked on buffers 0 and 1 against a host double reference (max over items
// of |out - ref| / max(|ref|, 1) < 1e-10; exit 1 if any variant fails), then timed: --warmup
// calls (30), then --iters calls (300), each after a ~30 us GPU spin (the call is queued
// before the GPU reaches it), CUDA events right before and after; median and min us,
// TB/s = 64 MiB / median. A second figure leaves launch latency out: %globaltimer read by
// thread 0 of every block at its start and end, min start to max end over the blocks, median
// over the calls (the table also prints the smallest globaltimer step seen: its resolution
// bounds this figure's). Call i reads buffer i % 8 (8 x 64 MiB: x is never L2 resident, the
// 60 MB L2 holding less than one buffer).
// The results are copied into docs/performance.md by hand.
//
// Variants (persistent grid of blocks/SM x SMs blocks taking items round robin, as csrc):
//   ldg        csrc's kernel: 16-byte __ldg, 8 loads in flight per thread, 48 registers
//   nc.*       the same with ld.global.nc and explicit L1 / L2 qualifiers (inline PTX)
//   +prefetch  ldg, each block prefetching its next item into L2 while it reads this one
//   bulk       cp.async.bulk (TMA engine, no tensor map) of contiguous chunks into a ring of
//              shared-memory stages, completion on mbarriers; the threads sum from shared
// References in the same run: cudaMemcpyAsync D2D (read + write counted), cub DeviceReduce.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cub/block/block_reduce.cuh>
#include <cub/device/device_reduce.cuh>
#include <functional>
#include <string>
#include <vector>

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
#error "x_read_variants needs sm_90 (cp.async.bulk, mbarrier tx counts): build with -arch=sm_90"
#endif

#include "cuda_check.cuh"

// ---------------------------------------------------------------------------------------
// Problem
constexpr int64_t ROWS = 16 * 64;           // B * Ci
constexpr int64_t LEN = 16 * 32 * 32;       // D * H * W
constexpr int64_t XN = ROWS * LEN;          // 16 Mi floats
constexpr double XBYTES = double(XN) * 4;   // 67108864
constexpr int64_t PARTS = 2;                // as csrc's plan for the seed problem
constexpr int64_t ITEMS = ROWS * PARTS;     // 2048 items of 32 KiB
constexpr int NBUF = 8;
constexpr int MAX_GRID = 4096;              // stamp slots per call
constexpr double SPIN_NS = 30000;

// csrc's XPassPlan (spatial_sum_x.cu), kept so that the replica does the same per-item
// index arithmetic; here channels = 64, strides of a contiguous x.
struct XPassPlan {
  int64_t channels, len, batch_stride, channel_stride;
  int64_t chunk, parts, items;
};

__device__ __forceinline__ const float* item_begin(const float* x, const XPassPlan& p, int64_t item) {
  const int64_t row = item / p.parts;
  return x + (row / p.channels) * p.batch_stride + (row % p.channels) * p.channel_stride +
         (item % p.parts) * p.chunk;
}

// ---------------------------------------------------------------------------------------
// Device helpers
__device__ __forceinline__ unsigned long long gtime() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// The launch-free duration: thread 0 of each block stamps its start and end (two 8-byte
// stores per block, the same in every kernel), the host takes min start to max end.
__device__ __forceinline__ void stamp(unsigned long long* stamps, int slot) {
  if (threadIdx.x == 0) stamps[2 * blockIdx.x + slot] = gtime();
}

__device__ __forceinline__ double sum16(const uint4& v) {  // 4 floats, as Vec16<float>::sum
  return (double(__uint_as_float(v.x)) + double(__uint_as_float(v.y))) +
         (double(__uint_as_float(v.z)) + double(__uint_as_float(v.w)));
}

enum class Ld { kLdg, kNcL1naL2_256, kNcL2_128, kNcL1na };

// One 16-byte load of read-only data. The generic pointer goes to ld.global as it is, as
// CUTLASS's loads do (a cudaMalloc'd generic address is its global address).
template <Ld L>
__device__ __forceinline__ uint4 load16(const uint4* p) {
  uint4 v;
  if constexpr (L == Ld::kLdg) {
    v = __ldg(p);
  } else if constexpr (L == Ld::kNcL1naL2_256) {
    asm("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
        : "l"(p));
  } else if constexpr (L == Ld::kNcL2_128) {
    asm("ld.global.nc.L2::128B.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
        : "l"(p));
  } else {
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
        : "l"(p));
  }
  return v;
}

// csrc's vector_partial with the load as a parameter: whole rounds of U loads back to back,
// then the rest one at a time. Left to itself ptxas starts adding the first vectors before
// issuing the last loads (fewer registers, about half in flight); making every vector depend
// on all of them (their .w words ANDed with `zero`, a runtime 0, XORed into the others) keeps
// all U in flight.
template <Ld L, int U, int NT>
__device__ __forceinline__ double vector_partial(const uint4* __restrict__ p, int64_t begin,
                                                 int64_t end, unsigned zero) {
  double acc = 0;
  int64_t i = begin + threadIdx.x;
  for (; i + (U - 1) * NT < end; i += NT * U) {
    uint4 v[U];
#pragma unroll
    for (int u = 0; u < U; ++u) v[u] = load16<L>(p + i + u * NT);
    unsigned dep = zero;
#pragma unroll
    for (int u = 0; u < U; ++u) dep &= v[u].w;
#pragma unroll
    for (int u = 0; u < U; ++u) {
      v[u].x ^= dep;
      v[u].y ^= dep;
      v[u].z ^= dep;
    }
#pragma unroll
    for (int u = 0; u < U; ++u) acc += sum16(v[u]);
  }
  for (; i < end; i += NT) acc += sum16(load16<L>(p + i));
  return acc;
}

// csrc's spatial_sum_x_kernel (float, vector path) with the load, U and the block size as
// parameters; MAXREG caps registers so that the host can pick blocks/SM (csrc: 48, 4/SM).
// kPrefetch: before reading an item, the block asks L2 for its next item (one
// prefetch.global.L2 per 128-byte line), so that more of x is in flight than the registers
// hold. csrc's PDL trigger is left out: nothing is launched after this kernel here.
template <Ld L, int U, int NT, int MAXREG, bool kPrefetch = false>
__global__ void __maxnreg__(MAXREG) vec_kernel(const float* __restrict__ x, const XPassPlan p,
                                               unsigned zero, double* __restrict__ out,
                                               unsigned long long* __restrict__ stamps) {
  stamp(stamps, 0);
  using BlockReduce = cub::BlockReduce<double, NT>;
  __shared__ typename BlockReduce::TempStorage tmp;
  for (int64_t item = blockIdx.x; item < p.items; item += gridDim.x) {
    if constexpr (kPrefetch) {
      const int64_t next = item + gridDim.x;
      if (next < p.items) {
        const float* n = item_begin(x, p, next);
        for (int64_t l = int64_t(threadIdx.x) * 32; l < p.chunk; l += int64_t(NT) * 32)
          asm volatile("prefetch.global.L2 [%0];" ::"l"(n + l));
      }
    }
    const int64_t row = item / p.parts, begin = (item % p.parts) * p.chunk;
    const int64_t end = min(p.len, begin + p.chunk);
    const float* r = x + (row / p.channels) * p.batch_stride + (row % p.channels) * p.channel_stride;
    const double acc =
        vector_partial<L, U, NT>(reinterpret_cast<const uint4*>(r), begin / 4, end / 4, zero);
    const double total = BlockReduce(tmp).Sum(acc);
    if (threadIdx.x == 0) out[item] = total;
    __syncthreads();  // tmp is reused by the next item
  }
  stamp(stamps, 1);  // after the loop's last __syncthreads: every thread of the block is done
}

// ---------------------------------------------------------------------------------------
// Bulk copies (sm_90): the asm strings are those of CCCL's cuda::ptx wrappers
// (cuda/__ptx/instructions/generated/*.h in CUDA 13.0) and of CUTLASS's SM90_BULK_COPY_G2S /
// ClusterTransactionBarrier.
__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void mbar_init(uint64_t* bar, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(count) : "memory");
}
// One arrival that also raises the phase's expected transaction count by `bytes`; the phase
// completes when the arrival count is met and the bulk copies have delivered those bytes.
__device__ __forceinline__ void mbar_arrive_expect_tx(uint64_t* bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_addr(bar)) : "memory");
}
// Until the phase of parity `parity` has completed (try_wait: acquire at CTA scope by default,
// so the bulk copy's bytes are visible after it). The loop is in C++ so that no PTX label is
// duplicated when this is inlined more than once.
__device__ __forceinline__ void mbar_wait(uint64_t* bar, unsigned parity) {
  const uint32_t a = smem_addr(bar);
  uint32_t done;
  do {
    asm volatile(
        "{\n\t.reg .pred P;\n\t"
        "mbarrier.try_wait.parity.shared::cta.b64 P, [%1], %2;\n\t"
        "selp.b32 %0, 1, 0, P;\n\t}"
        : "=r"(done)
        : "r"(a), "r"(parity)
        : "memory");
  } while (!done);
}
// Global -> this CTA's shared memory. A CTA launched without clusters is a cluster of one, so
// its shared::cta addresses are valid shared::cluster addresses. dst, src 16-byte aligned,
// bytes a multiple of 16.
__device__ __forceinline__ void bulk_g2s(void* dst, const void* src, unsigned bytes, uint64_t* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
               ::"r"(smem_addr(dst)), "l"(static_cast<uint64_t>(__cvta_generic_to_global(src))), "r"(bytes),
               "r"(smem_addr(bar))
               : "memory");
}
// Orders this thread's view of shared memory between the generic proxy (ld/st, mbarrier
// init) and the async proxy (bulk copies).
__device__ __forceinline__ void fence_proxy_async_smem() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

// The block's items (blockIdx.x, + gridDim.x, ...) as one stream of CHUNK-byte chunks, item
// after item, so that the ring does not drain at item boundaries: thread 0 keeps the chunks
// after the one being summed in flight (STAGES - 1 of them), every thread sums its float4s of
// the current stage from shared memory, and the per-item block reduce runs when an item's last
// chunk has been summed.
// Refilling a stage once every thread has read it:
//   kEmptyBar false: __syncthreads() after each chunk, then thread 0 refills the stage.
//   kEmptyBar true:  each warp arrives on the stage's "empty" mbarrier (no block-wide stall);
//                    thread 0 waits there before refilling, so only warp 0 waits for the slowest.
// Proxy fence before each refill: the threads' reads of the stage are generic-proxy accesses
// and the refill is an async-proxy write of the same bytes. CUTLASS's PipelineTmaAsync orders this
// write-after-read by the barrier alone; Triton's proxy-fence pass inserts
// fence.proxy.async.shared::cta for it, and the PTX ISA's wording asks for a proxy fence
// between proxies on the same location. One fence by one thread per chunk costs nothing next to
// a multi-KiB copy, so it is kept and the result does not rest on that reading.
template <int CHUNK, int STAGES, int NT, bool kEmptyBar>
__global__ void __launch_bounds__(NT) bulk_kernel(const float* __restrict__ x, const XPassPlan p,
                                                  unsigned zero, double* __restrict__ out,
                                                  unsigned long long* __restrict__ stamps) {
  static_assert(CHUNK % 16 == 0 && (CHUNK / 16) % NT == 0, "a chunk is whole float4s per thread");
  constexpr int PER_THREAD = CHUNK / 16 / NT;
  stamp(stamps, 0);
  extern __shared__ __align__(128) unsigned char ring[];  // STAGES * CHUNK bytes
  __shared__ __align__(8) uint64_t full[STAGES], empty[STAGES];
  using BlockReduce = cub::BlockReduce<double, NT>;
  __shared__ typename BlockReduce::TempStorage tmp;
  (void)zero;  // same signature as vec_kernel

  const int64_t first = blockIdx.x, step = gridDim.x;
  const int my_items = first < p.items ? int((p.items - first + step - 1) / step) : 0;
  const int cpi = int(p.chunk * int64_t(sizeof(float)) / CHUNK);  // chunks per item (host checks)
  const int total = my_items * cpi;
  if (threadIdx.x == 0) {
    for (int s = 0; s < STAGES; ++s) {
      mbar_init(&full[s], 1);         // thread 0's arrive.expect_tx
      mbar_init(&empty[s], NT / 32);  // one arrival per warp
    }
    // The inits are generic-proxy writes that the bulk copies' complete_tx (async proxy) must
    // see: CUDA's TMA example fences the proxy after init; CUTLASS adds the mbarrier_init fence.
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    fence_proxy_async_smem();
  }
  __syncthreads();

  // Chunks are issued in order, so the producer (thread 0) walks them with counters instead of
  // dividing a chunk index: src is the next chunk, src_left the chunks left in its item.
  const float* src = total > 0 ? item_begin(x, p, first) : x;
  int64_t src_item = first;
  int src_left = cpi;
  int issued = 0;
  auto issue = [&]() {  // thread 0 only: the next chunk into its stage
    const int s = issued % STAGES;
    mbar_arrive_expect_tx(&full[s], CHUNK);
    bulk_g2s(ring + size_t(s) * CHUNK, src, CHUNK, &full[s]);
    ++issued;
    if (--src_left > 0) {
      src += CHUNK / 4;
    } else if (issued < total) {
      src_item += step;
      src = item_begin(x, p, src_item);
      src_left = cpi;
    }
  };
  if (threadIdx.x == 0)
    while (issued < min(STAGES, total)) issue();

  const int lane = threadIdx.x % 32;
  int64_t item = first;
  int left = cpi;  // chunks of `item` not yet summed
  double acc = 0;
  for (int c = 0; c < total; ++c) {
    const int s = c % STAGES;
    if (kEmptyBar && threadIdx.x == 0 && c > 0 && issued < total) {
      // Chunk c - 1's stage takes chunk c - 1 + STAGES (= issued) once every warp has read it.
      mbar_wait(&empty[(c - 1) % STAGES], unsigned((c - 1) / STAGES) & 1u);
      fence_proxy_async_smem();
      issue();
    }
    mbar_wait(&full[s], unsigned(c / STAGES) & 1u);
    const uint4* v = reinterpret_cast<const uint4*>(ring + size_t(s) * CHUNK);
#pragma unroll
    for (int k = 0; k < PER_THREAD; ++k) acc += sum16(v[threadIdx.x + k * NT]);
    if (kEmptyBar) {
      __syncwarp();  // the warp's reads are ordered before lane 0's (release) arrival
      if (lane == 0) mbar_arrive(&empty[s]);
    } else {
      __syncthreads();
      if (threadIdx.x == 0 && issued < total) {  // issued = c + STAGES here
        fence_proxy_async_smem();
        issue();
      }
    }
    if (--left == 0) {
      const double t = BlockReduce(tmp).Sum(acc);
      if (threadIdx.x == 0) out[item] = t;
      acc = 0;
      item += step;
      left = cpi;
      __syncthreads();  // tmp is reused by the next item
    }
  }
  stamp(stamps, 1);  // the loop ended on an item's __syncthreads: every thread is done
}

// ---------------------------------------------------------------------------------------
// Timing and data helpers
__global__ void spin_kernel(unsigned long long ns) {
  const unsigned long long t0 = gtime();
  while (gtime() - t0 < ns) {
  }
}

__host__ __device__ inline uint64_t splitmix(uint64_t z) {
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}
__host__ __device__ inline float unif(uint64_t seed, uint64_t i) {  // [-1, 1), 24-bit exact
  return float(double(splitmix(seed * 0x100000001b3ull + i) >> 40) * 0x1p-23 - 1.0);
}
// Values in [-1, 1): half noise, half a per-row offset, so that item sums are large (|sum| up
// to ~4096) and differ from row to row; a variant that mixes up items fails the check.
__global__ void fill_kernel(float* x, int64_t n, uint64_t seed) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += stride)
    x[i] = 0.5f * unif(seed, uint64_t(i)) + 0.5f * unif(seed + 7777, uint64_t(i / LEN));
}

static double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

struct Variant {
  std::string name;
  bool kernel = false;  // ours: checked, stamped, attributes known
  int regs = 0, per_sm = 0, grid = 0;
  size_t lmem = 0;     // local memory per thread (spills), from cudaFuncGetAttributes
  double bytes = XBYTES;
  std::function<void(int, unsigned long long*)> call;  // call(buffer index, stamp slice)
};

int main(int argc, char** argv) {
  int iters = 300, warmup = 30;
  std::string only;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--only" && i + 1 < argc) only = argv[++i];
    else if (a == "--iters" && i + 1 < argc) iters = atoi(argv[++i]);
    else if (a == "--warmup" && i + 1 < argc) warmup = atoi(argv[++i]);
    else {
      fprintf(stderr, "usage: %s [--only SUBSTR] [--iters N] [--warmup N]\n", argv[0]);
      return 2;
    }
  }
  if (iters < 1 || warmup < 0) {
    fprintf(stderr, "bad --iters/--warmup\n");
    return 2;
  }
  // The references run whatever --only says: they are the scale the variants are read against.
  auto selected = [&](const std::string& name) {
    return only.empty() || name.find(only) != std::string::npos || name.rfind("ref: ", 0) == 0;
  };

  CK(cudaSetDevice(0));
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  const int sms = prop.multiProcessorCount;
  printf("device %s, %d SMs, L2 %.0f MB, cc %d.%d; %d x buffers of 64 MiB; %d warm-up + %d timed calls\n",
         prop.name, sms, prop.l2CacheSize / 1e6, prop.major, prop.minor, NBUF, warmup, iters);
  if (prop.major < 9) {
    fprintf(stderr, "needs sm_90 or later\n");
    return 2;
  }
  cudaStream_t st;
  CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));

  // ---- data and host reference (buffers 0 and 1)
  std::vector<float*> dx(NBUF);
  for (int k = 0; k < NBUF; ++k) {
    CK(cudaMalloc(&dx[k], XN * sizeof(float)));
    fill_kernel<<<4 * sms, 256, 0, st>>>(dx[k], XN, 1000 + k);
    CK_LAUNCH();
  }
  CK(cudaStreamSynchronize(st));
  std::vector<std::vector<double>> ref(2, std::vector<double>(ITEMS));
  {
    std::vector<float> hx(XN);
    for (int k = 0; k < 2; ++k) {
      CK(cudaMemcpy(hx.data(), dx[k], XN * sizeof(float), cudaMemcpyDeviceToHost));
      const int64_t per = LEN / PARTS;
      for (int64_t it = 0; it < ITEMS; ++it) {
        double s = 0;
        for (int64_t i = 0; i < per; ++i) s += hx[it * per + i];
        ref[k][it] = s;
      }
    }
  }
  double* dout;
  CK(cudaMalloc(&dout, ITEMS * sizeof(double)));
  // Stamp slices: one per timed call, plus one for the check and warm-up calls.
  const size_t slice = 2 * size_t(MAX_GRID);
  unsigned long long* dstamps;
  CK(cudaMalloc(&dstamps, (size_t(iters) + 1) * slice * sizeof(unsigned long long)));
  unsigned long long* scratch_stamps = dstamps + size_t(iters) * slice;
  float* dcopy;
  CK(cudaMalloc(&dcopy, XN * sizeof(float)));
  float* dred;
  CK(cudaMalloc(&dred, sizeof(float)));
  size_t cub_bytes = 0;
  CK(cub::DeviceReduce::Sum(nullptr, cub_bytes, dx[0], dred, XN, st));
  void* dcub;
  CK(cudaMalloc(&dcub, cub_bytes));

  XPassPlan plan;
  plan.channels = 64;
  plan.len = LEN;
  plan.batch_stride = 64 * LEN;
  plan.channel_stride = LEN;
  plan.parts = PARTS;
  plan.chunk = LEN / PARTS;
  plan.items = ITEMS;

  // The bulk kernels take items as whole chunks (8, 16, 32 KiB) from 16-byte aligned addresses.
  if ((plan.chunk * 4) % 32768 != 0 || reinterpret_cast<uintptr_t>(dx[0]) % 16 != 0) {
    fprintf(stderr, "items are not whole 32 KiB chunks\n");
    return 2;
  }

  std::vector<Variant> vs;
  std::vector<std::string> notes;
  // ---- references
  {
    Variant v;
    v.name = "ref: cudaMemcpyAsync D2D (read + write)";
    v.bytes = 2 * XBYTES;
    v.call = [&](int b, unsigned long long*) {
      CK(cudaMemcpyAsync(dcopy, dx[b % NBUF], XN * sizeof(float), cudaMemcpyDeviceToDevice, st));
    };
    vs.push_back(v);
    v.name = "ref: cub::DeviceReduce::Sum (float)";
    v.bytes = XBYTES;
    v.call = [&](int b, unsigned long long*) {
      CK(cub::DeviceReduce::Sum(dcub, cub_bytes, dx[b % NBUF], dred, XN, st));
    };
    vs.push_back(v);
  }

  // ---- our kernels: one row per (kernel, blocks/SM); per_sm 0 = the most that fit
  auto add = [&](auto kernel, const std::string& base, int threads, size_t dsmem, std::vector<int> per_sms) {
    const void* k = reinterpret_cast<const void*>(kernel);
    if (dsmem > 0) {
      CK(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, int(dsmem)));
      // The ring needs most of the SM's shared memory to fit several blocks.
      CK(cudaFuncSetAttribute(k, cudaFuncAttributePreferredSharedMemoryCarveout, 100));
    }
    cudaFuncAttributes fa;
    CK(cudaFuncGetAttributes(&fa, k));
    int occ = 0;
    CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, k, threads, dsmem));
    std::vector<int> want;
    for (int n : per_sms) {
      const int m = n == 0 ? occ : n;
      if (std::find(want.begin(), want.end(), m) == want.end()) want.push_back(m);
    }
    for (int n : want) {
      const std::string name = base + ", " + std::to_string(n) + "/SM";
      if (!selected(name)) continue;
      if (n < 1 || n > occ) {
        char line[200];
        snprintf(line, sizeof line, "skipped %s: %d regs, %zu B dyn smem -> at most %d blocks/SM",
                 name.c_str(), fa.numRegs, dsmem, occ);
        notes.push_back(line);
        continue;
      }
      Variant v;
      v.name = name;
      v.kernel = true;
      v.regs = fa.numRegs;
      v.lmem = fa.localSizeBytes;
      v.per_sm = n;
      v.grid = int(std::min<int64_t>(ITEMS, int64_t(n) * sms));
      if (v.grid > MAX_GRID) {
        fprintf(stderr, "%s: grid %d > MAX_GRID\n", name.c_str(), v.grid);
        exit(2);
      }
      const unsigned grid = unsigned(v.grid);
      v.call = [=, &dx, &plan](int b, unsigned long long* stamps) {
        kernel<<<grid, threads, dsmem, st>>>(dx[b % NBUF], plan, 0u, dout, stamps);
        CK_LAUNCH();
      };
      vs.push_back(v);
    }
  };
  // 1. csrc's kernel (spatial_sum_x.cu): __ldg, 8 in flight, 48 registers, 4/SM (+ the most).
  add(vec_kernel<Ld::kLdg, 8, 256, 48>, "ldg u8 t256 r48 (csrc)", 256, 0, {4, 0});
  // 2-4. The same with other load instructions.
  add(vec_kernel<Ld::kNcL1naL2_256, 8, 256, 48>, "nc.L1::no_allocate.L2::256B u8 t256 r48", 256, 0,
      {2, 4, 8, 0});
  add(vec_kernel<Ld::kNcL2_128, 8, 256, 48>, "nc.L2::128B u8 t256 r48", 256, 0, {4});
  add(vec_kernel<Ld::kNcL1na, 8, 256, 48>, "nc.L1::no_allocate u8 t256 r48", 256, 0, {4});
  // 5. L2::256B with fewer / more loads in flight per thread. An item is 2048 vectors: u16 at
  // 256 threads would be more than one item per round (csrc's loop would fall to its one-at-a-
  // time remainder), so u16 runs 128-thread blocks (one round per item, as u8 at 256).
  add(vec_kernel<Ld::kNcL1naL2_256, 4, 256, 32>, "nc.L1::no_allocate.L2::256B u4 t256 r32", 256, 0,
      {2, 4, 8, 0});
  // r32 is what 8 blocks/SM need, and ptxas spills 16 B there (the lmem column); r40 does not
  // spill but fits 6/SM. Likewise u16: r96 without spills (5/SM at most), r80 for 6/SM with
  // a 16-byte spill.
  add(vec_kernel<Ld::kNcL1naL2_256, 4, 256, 40>, "nc.L1::no_allocate.L2::256B u4 t256 r40", 256, 0, {4, 0});
  add(vec_kernel<Ld::kNcL1naL2_256, 16, 128, 96>, "nc.L1::no_allocate.L2::256B u16 t128 r96", 128, 0,
      {2, 4, 8, 0});
  add(vec_kernel<Ld::kNcL1naL2_256, 16, 128, 80>, "nc.L1::no_allocate.L2::256B u16 t128 r80", 128, 0, {0});
  // 7. csrc's kernel asking L2 for the block's next item ahead of its loads (at 48 registers
  // the prefetch addresses made ptxas spill, at 56 too; 64 still fits 4/SM).
  add(vec_kernel<Ld::kLdg, 8, 256, 64, true>, "ldg u8 t256 r64 + prefetch.L2 next item", 256, 0, {4, 0});
  // 6. Bulk copies into a shared-memory ring: (chunk, stages, threads) and blocks/SM.
  add(bulk_kernel<16384, 4, 256, false>, "bulk 16K x4 stages t256 sync", 256, 4 * 16384, {2});
  add(bulk_kernel<16384, 4, 256, true>, "bulk 16K x4 stages t256 mbar", 256, 4 * 16384, {2});
  add(bulk_kernel<16384, 6, 256, true>, "bulk 16K x6 stages t256 mbar", 256, 6 * 16384, {2});
  add(bulk_kernel<8192, 6, 256, false>, "bulk 8K x6 stages t256 sync", 256, 6 * 8192, {4});
  add(bulk_kernel<8192, 6, 256, true>, "bulk 8K x6 stages t256 mbar", 256, 6 * 8192, {4});
  add(bulk_kernel<8192, 4, 256, true>, "bulk 8K x4 stages t256 mbar", 256, 4 * 8192, {4, 0});
  add(bulk_kernel<32768, 3, 512, false>, "bulk 32K x3 stages t512 sync", 512, 3 * 32768, {1, 2});
  add(bulk_kernel<32768, 3, 512, true>, "bulk 32K x3 stages t512 mbar", 512, 3 * 32768, {1, 2});
  for (auto& n : notes) printf("%s\n", n.c_str());

  // ---- correctness: one call per kernel on buffers 0 and 1
  bool all_ok = true;
  std::vector<double> errs(vs.size(), NAN);
  std::vector<double> hout(ITEMS);
  for (size_t vi = 0; vi < vs.size(); ++vi) {
    auto& v = vs[vi];
    if (!v.kernel || !selected(v.name)) continue;
    double worst = 0;
    for (int b = 0; b < 2; ++b) {
      CK(cudaMemsetAsync(dout, 0xff, ITEMS * sizeof(double), st));  // NaN: catches unwritten items
      v.call(b, scratch_stamps);
      CK(cudaStreamSynchronize(st));
      CK(cudaMemcpy(hout.data(), dout, ITEMS * sizeof(double), cudaMemcpyDeviceToHost));
      for (int64_t it = 0; it < ITEMS; ++it) {
        // max(|ref|, 1): an item summing to ~0 would otherwise turn rounding into a failure.
        const double e = std::fabs(hout[it] - ref[b][it]) / std::max(std::fabs(ref[b][it]), 1.0);
        worst = std::isnan(e) || std::isnan(worst) ? NAN : std::max(worst, e);
      }
    }
    errs[vi] = worst;
    const bool ok = worst < 1e-10;  // false for NaN
    all_ok &= ok;
    if (!ok) printf("FAIL %s: max rel err %.3e\n", v.name.c_str(), worst);
  }

  // ---- timing
  std::vector<cudaEvent_t> ev0(iters), ev1(iters);
  for (int i = 0; i < iters; ++i) {
    CK(cudaEventCreate(&ev0[i]));
    CK(cudaEventCreate(&ev1[i]));
  }
  struct Row {
    double med = NAN, mn = NAN, dur = NAN;
    bool timed = false;
  };
  std::vector<Row> rows(vs.size());
  std::vector<unsigned long long> hst;
  unsigned long long tick = ~0ull;  // smallest nonzero gap between two blocks' start stamps
  for (size_t vi = 0; vi < vs.size(); ++vi) {
    auto& v = vs[vi];
    if (!selected(v.name)) continue;
    for (int i = 0; i < warmup; ++i) v.call(i, scratch_stamps);
    if (v.kernel) CK(cudaMemsetAsync(dstamps, 0, size_t(iters) * slice * sizeof(unsigned long long), st));
    CK(cudaStreamSynchronize(st));
    for (int i = 0; i < iters; ++i) {
      spin_kernel<<<1, 1, 0, st>>>((unsigned long long)SPIN_NS);
      CK_LAUNCH();
      CK(cudaEventRecord(ev0[i], st));
      v.call(warmup + i, dstamps + size_t(i) * slice);
      CK(cudaEventRecord(ev1[i], st));
    }
    CK(cudaStreamSynchronize(st));
    const std::vector<double> us = elapsed_us(ev0, ev1);
    Row r;
    r.med = median(us);
    r.mn = *std::min_element(us.begin(), us.end());
    r.timed = true;
    if (v.kernel) {
      hst.resize(size_t(iters) * slice);
      CK(cudaMemcpy(hst.data(), dstamps, hst.size() * sizeof(unsigned long long), cudaMemcpyDeviceToHost));
      std::vector<double> dur;
      for (int i = 0; i < iters; ++i) {
        const unsigned long long* s = hst.data() + size_t(i) * slice;
        unsigned long long t0 = ~0ull, t1 = 0;
        bool complete = true;
        std::vector<unsigned long long> starts(v.grid);
        for (int b = 0; b < v.grid; ++b) {
          complete &= s[2 * b] != 0 && s[2 * b + 1] != 0;
          t0 = std::min(t0, s[2 * b]);
          t1 = std::max(t1, s[2 * b + 1]);
          starts[b] = s[2 * b];
        }
        if (!complete) continue;
        dur.push_back(double(t1 - t0) * 1e-3);
        std::sort(starts.begin(), starts.end());
        for (int b = 1; b < v.grid; ++b)
          if (starts[b] != starts[b - 1]) tick = std::min(tick, starts[b] - starts[b - 1]);
      }
      if (dur.size() == size_t(iters)) r.dur = median(dur);
      else
        printf("warning: %s: %zu of %d calls left unstamped blocks\n", v.name.c_str(), iters - dur.size(),
               iters);
    }
    rows[vi] = r;
  }

  // ---- table
  printf("\n%d calls per row after %d warm-up; med/min: CUDA events around the call after a %.0f us spin; "
         "dur: %%globaltimer, first block start to last block end (median); TB/s on %.0f bytes "
         "(copy: read + write)\n",
         iters, warmup, SPIN_NS * 1e-3, XBYTES);
  if (tick != ~0ull) printf("globaltimer: smallest nonzero step between block starts seen: %llu ns\n", tick);
  printf("%-50s %4s %5s %4s %5s %8s %8s %6s %8s %6s %9s\n", "variant", "regs", "lmem", "/SM", "grid",
         "med us", "min us", "TB/s", "dur us", "TB/s", "rel err");
  for (size_t vi = 0; vi < vs.size(); ++vi) {
    const auto& v = vs[vi];
    const Row& r = rows[vi];
    if (!r.timed) continue;
    char regs[16] = "-", lmem[16] = "-", per[16] = "-", grid[16] = "-";
    char dur[16] = "-", tbd[16] = "-", err[16] = "-";
    if (v.kernel) {
      snprintf(regs, sizeof regs, "%d", v.regs);
      snprintf(lmem, sizeof lmem, "%zu", v.lmem);
      snprintf(per, sizeof per, "%d", v.per_sm);
      snprintf(grid, sizeof grid, "%d", v.grid);
      snprintf(err, sizeof err, "%.1e", errs[vi]);
      if (!std::isnan(r.dur)) {
        snprintf(dur, sizeof dur, "%.2f", r.dur);
        snprintf(tbd, sizeof tbd, "%.2f", v.bytes / (r.dur * 1e-6) / 1e12);
      }
    }
    printf("%-50s %4s %5s %4s %5s %8.2f %8.2f %6.2f %8s %6s %9s\n", v.name.c_str(), regs, lmem, per, grid,
           r.med, r.mn, v.bytes / (r.med * 1e-6) / 1e12, dur, tbd, err);
  }
  printf("\n%s\n", all_ok ? "all variants within rel err 1e-10 of the host reference"
                          : "FAIL: some variants are off the host reference");
  return all_ok ? 0 : 1;
}
