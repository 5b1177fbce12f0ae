// The cross-spectrum path's contraction as one kernel on the float64 tensor cores of sm_90
// (docs/math.md §3.5, the fused contraction): per bin g, group and column c,
// mirror(g) W[:, c]^T B W[:, c] with B the interleaved real form of R^(g) and W the
// sub-kernels' spectra in the same row order. The GEMM route writes V = B W (53 MB on the seed
// problem) and cross_spectrum_quad_form.cu reads it back with W; here V stays in the MMAs' registers.
//
// B is never stored: R^ comes as complex values (half the bytes of B: 26.5 MB on the seed
// problem), staged 16 bytes each, and B's entries are formed as the MMA's A fragments are
// loaded. A thread's fragment rows all have the parity of lane/4 and its columns that of
// lane%4, so it always reads the same component of a staged value with the same sign.
//
// B is symmetric, so a block takes a tile p of 64 rows and a tile of 64 columns and forms
// 2 sum_{q > p} B_pq w_q + B_pp w_p: it walks the chunks of 32 rows k of W from the last down
// to its own tile, doubling its sums (exactly) before the diagonal tile. Its last two chunks
// of W staged are then its own rows, the epilogue's weights. Each of its four warps owns 32
// rows by 32 columns (2 x 4 MMA tiles); a thread's rows are added in registers, a warp's by
// shuffles and the block's two halves through shared memory, always in the same order, into
// one partial sum per (bin, row tile) and column that the finalize adds: no atomics, so the
// result does not depend on scheduling.
//
// Tile p's blocks stage ceil(R/32) - 2p chunks (seed: 4 for p = 0, 2 for p = 1), and blocks
// start about in index order as others end. Ordered by (bin, group) pair, the last wave mixes
// both and ends with heavy blocks on few SMs; so the last pairs' blocks (two waves of them) come
// by row tile, the heaviest first, and the light ones fill the tail (longest processing time
// first: the modelled makespan comes closer to the work spread evenly). Before them,
// pair order keeps a pair's blocks together in time (B's rows shared by the column tiles, W's
// by the row tiles, in L2). Which block computes a partial sum changes, not how.
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>
#include <cstdint>

#include "common/cuda/copy_async.cuh"
#include "common/cuda/reduce.cuh"
#include "common/cuda/dynamic_smem.h"
#include "cross_spectrum/cuda/cross_spectrum_kernels.h"
#include "common/cuda/mma_f64.cuh"
#include "common/cuda/pdl.cuh"

namespace fused_ops {
namespace {

constexpr int kWarps = 4;
constexpr int kThreads = 32 * kWarps;
constexpr int kTile = 64;                   // rows i and columns c per block
constexpr int kChunk = 32;                  // rows k of W, and columns of B, per staged step
constexpr int kWarpTile = 32;               // rows and columns per warp
constexpr int kRowBlocks = kWarpTile / 16;  // MMA tiles per warp: the MMA's M is 16...
constexpr int kColTiles = kWarpTile / 8;    // ...and its N 8
constexpr int kPitchB = kChunk + 4;         // doubles; = 4 (mod 16): a warp's fragment loads of B,
constexpr int kPitchW = kTile + 4;          // 4 complex rows by 4 doubles, and a half-warp's of W,
                                            // 4 rows by 4 columns, fall in distinct banks
// A warp's rows are one chunk of the block's tile, which the epilogue finds staged.
static_assert(kTile == 2 * kChunk && kWarpTile == kChunk, "a block's tile is two chunks, a chunk a warp's rows");

struct Stage {
  double b[2][kTile / 2][kPitchB];  // [buffer][i / 2][k - k0]: Re, Im of R^[i / 2, (k - k0) / 2]
  double w[2][kChunk][kPitchW];     // [buffer][k - k0][column]
  double sums[2][kTile];            // [the warp's half of the rows][column]: the epilogue's
};
constexpr int kSmemBytes = sizeof(Stage);  // 54272
constexpr int kBlocksPerSm = 3;            // as its registers allow (ptxas -v); a wave of them sizes the tail

struct FormArgs {
  const double* b;       // [bins, G, Cig, 2 Cig]: R^'s complex values as doubles, R = 2 Cig
  const double* w;       // [bins, G, R, C]
  const double* mirror;  // [Mw]: weight of a bin by its last frequency index
  double* partial;       // [bins row_tiles, G, C]
  int rows, cols, mw, groups, row_tiles, col_tiles;  // rows: R
  int pairs;             // bins G
  int tail_pairs;        // the last pairs, whose blocks come by row tile
  int head_blocks;       // the blocks before theirs: (pairs - tail_pairs) row_tiles col_tiles
};

// Block x's (pair, row tile, column tile): pair-major before the tail, row-tile-major in it.
struct Item {
  int pair, row_tile, col_tile;
  __device__ Item(const FormArgs& a, int x) {
    if (x < a.head_blocks) {
      col_tile = x % a.col_tiles;
      row_tile = x / a.col_tiles % a.row_tiles;
      pair = x / a.col_tiles / a.row_tiles;
    } else {
      const int y = x - a.head_blocks, per_row_tile = a.tail_pairs * a.col_tiles;
      row_tile = y / per_row_tile;
      col_tile = y % per_row_tile % a.col_tiles;
      pair = a.pairs - a.tail_pairs + y % per_row_tile / a.col_tiles;
    }
  }
};

// This thread's pieces of a staged chunk: the n-th of R^'s (a complex value: B's real rows
// 2i, 2i + 1 and columns 2k, 2k + 1, k0 doubles into a row of R = 2 Cig doubles) at
// b + k0 + n kStepB R (if n kStepB < b_rows), of W's at w + (k0 + n kStepW) C (if
// n kStepW < R - k0 - w_row and w_column); where they go: b_to + n kStepB kPitchB and
// w_to + n kStepW kPitchW in a buffer. The same pieces at every chunk, so that only k0 varies
// in the loop.
template <int kWidth>
struct Pieces {
  static constexpr int kB = kTile / 2 * kChunk / 2 / kThreads, kW = kChunk * kTile / kWidth / kThreads;
  static constexpr int kStepB = kThreads / (kChunk / 2), kStepW = kThreads / (kTile / kWidth);  // rows
  static_assert(kTile / 2 * kChunk / 2 % kThreads == 0 && kChunk * kTile / kWidth % kThreads == 0,
                "pieces split evenly over the threads");
  const double *b, *w;
  int b_rows, b_column, w_row, b_to, w_to;
  bool w_column;

  __device__ Pieces(const FormArgs& a, const double* b_pair, const double* w_pair, int row0, int col0) {
    const int r = threadIdx.x / (kChunk / 2), k = 2 * (threadIdx.x % (kChunk / 2));
    const int c = kWidth * (threadIdx.x % (kTile / kWidth));
    w_row = threadIdx.x / (kTile / kWidth);
    b = b_pair + (row0 / 2 + r) * a.rows + k;
    w = w_pair + w_row * a.cols + col0 + c;
    b_rows = (a.rows - row0) / 2 - r;
    b_column = k;
    w_column = col0 + c < a.cols;
    b_to = r * kPitchB + k;
    w_to = w_row * kPitchW + c;
  }
};

// Issues, as one group, the copies of W's rows k0 .. k0 + kChunk - 1 (the block's columns)
// and of R^'s values at those columns of B and the block's rows into buffer `buf`, zeros past
// R and C. kWidth: values per copy of W, 2 where its rows (C values) keep 16-byte pieces whole,
// else 1.
template <int kWidth>
__device__ __forceinline__ void stage_chunk(const FormArgs& a, const Pieces<kWidth>& p, int k0, Stage& st, int buf) {
  using P = Pieces<kWidth>;
  const bool b_column = p.b_column < a.rows - k0;
  const double* b = p.b + k0;
#pragma unroll
  for (int n = 0; n < P::kB; ++n) {
    const bool valid = b_column && n * P::kStepB < p.b_rows;
    copy_async_bytes<16>(&st.b[buf][0][0] + p.b_to + n * P::kStepB * kPitchB, valid ? b : a.b, valid);
    b += P::kStepB * a.rows;
  }
  const int w_rows = a.rows - k0 - p.w_row;
  const double* w = p.w + k0 * a.cols;
#pragma unroll
  for (int n = 0; n < P::kW; ++n) {
    const bool valid = p.w_column && n * P::kStepW < w_rows;
    copy_async_bytes<8 * kWidth>(&st.w[buf][0][0] + p.w_to + n * P::kStepW * kPitchW, valid ? w : a.w, valid);
    w += P::kStepW * a.cols;
  }
  copy_async_commit();
}

// The staged double of B's fragment element at row 2i + a, column 2k + b (i, k: the staged
// complex value's row and column; a, b: the parities of lane/4 and lane%4, the same for all of
// a thread's elements, mma_f64's A layout): Re R^ where a = b, Im where a = 1, b = 0 and -Im
// where a = 0, b = 1. `sign` flips the last: the high word's sign bit, an integer operation.
__device__ __forceinline__ double b_entry(const double* at, int sign) {
  return __hiloint2double(__double2hiint(*at) ^ sign, __double2loint(*at));
}

// acc += the warp's 32 rows of B's staged chunk times its 32 columns of W's. bs: B's chunk
// at this thread's fragment row (lane/4 of the warp's first) and column (lane%4), the
// component of R^'s staged value that holds it; sign: its sign bit (b_entry); ws: W's at
// row lane%4 and column lane/4 of the warp's first (mma_f64's layouts).
__device__ __forceinline__ void multiply_chunk(const double* bs, int sign, const double* ws,
                                               double (&acc)[kRowBlocks][kColTiles][4]) {
#pragma unroll
  for (int k = 0; k < kChunk; k += kMmaK) {
    double af[kRowBlocks][kMmaK / 2], bf[kColTiles][kMmaK / 4];
#pragma unroll
    for (int m = 0; m < kRowBlocks; ++m) {
#pragma unroll
      for (int v = 0; v < kMmaK / 2; ++v) {  // rows 16 m + 8 (v % 2), columns k + 4 (v / 2) further
        af[m][v] = b_entry(bs + (8 * m + 4 * (v % 2)) * kPitchB + k + 4 * (v / 2), sign);
      }
    }
#pragma unroll
    for (int n = 0; n < kColTiles; ++n) {
#pragma unroll
      for (int v = 0; v < kMmaK / 4; ++v) bf[n][v] = ws[(k + 4 * v) * kPitchW + 8 * n];
    }
#pragma unroll
    for (int m = 0; m < kRowBlocks; ++m) {
#pragma unroll
      for (int n = 0; n < kColTiles; ++n) mma_f64(acc[m][n], af[m], bf[n]);
    }
  }
}

// sums[n][j] += the thread's rows of V times W's, in column 8 n + 2 (lane%4) + j of the warp's;
// wv: W's staged rows of the warp at this thread's first accumulator (row lane/4, column
// 2 (lane%4) of the warp's first), a 16-byte aligned pair.
__device__ __forceinline__ void weigh_rows(const double (&acc)[kRowBlocks][kColTiles][4], const double* wv,
                                           double (&sums)[kColTiles][2]) {
#pragma unroll
  for (int m = 0; m < kRowBlocks; ++m) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
#pragma unroll
      for (int n = 0; n < kColTiles; ++n) {
        const double2 x = *reinterpret_cast<const double2*>(wv + (16 * m + 8 * h) * kPitchW + 8 * n);
        sums[n][0] = fma(acc[m][n][2 * h], x.x, sums[n][0]);
        sums[n][1] = fma(acc[m][n][2 * h + 1], x.y, sums[n][1]);
      }
    }
  }
}

template <int kWidth>
__global__ void __launch_bounds__(kThreads, kBlocksPerSm) quad_form_mma_kernel(FormArgs a) {
  extern __shared__ __align__(16) unsigned char smem[];
  pdl_chain_start();
  Stage& st = *reinterpret_cast<Stage*>(smem);
  const Item item(a, static_cast<int>(blockIdx.x));
  const int col_tile = item.col_tile, row_tile = item.row_tile, pair = item.pair;  // pair: bin G + group
  const int bin = pair / a.groups, group = pair % a.groups;
  const double weight = a.mirror[bin % a.mw];  // loaded now, not after the last barrier
  const int row0 = kTile * row_tile, col0 = kTile * col_tile;
  const double* b = a.b + int64_t(pair) * (a.rows / 2) * a.rows;
  const double* w = a.w + int64_t(pair) * a.rows * a.cols;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t4 = lane % 4;
  const int half = warp / 2, wr = kWarpTile * half, wc = kWarpTile * (warp % 2);
  const bool active = row0 + wr < a.rows && col0 + wc < a.cols;  // else its V is zeros
  // B's row wr + g and column t4 (b_entry): R^'s row (wr + g) / 2, column t4 / 2, its imaginary
  // part where g and t4 differ in parity, negated where g is even and t4 odd.
  const int b_at = (wr + g) / 2 * kPitchB + (t4 & 2) + ((g ^ t4) & 1);
  const int b_sign = static_cast<int>(static_cast<unsigned>(~g & t4 & 1) << 31);
  const int chunks = (a.rows - row0 + kChunk - 1) / kChunk;

  const Pieces<kWidth> pieces(a, b, w, row0, col0);
  double acc[kRowBlocks][kColTiles][4] = {};
  stage_chunk(a, pieces, row0 + (chunks - 1) * kChunk, st, 0);
  for (int t = chunks - 1; t >= 0; --t) {
    const int buf = (chunks - 1 - t) & 1;
    copy_async_wait<0>();
    __syncthreads();  // chunk t staged for all; chunk t + 1's buffer read by all
    if (t > 0) stage_chunk(a, pieces, row0 + (t - 1) * kChunk, st, buf ^ 1);
    if (t == kTile / kChunk - 1) {  // the off-diagonal tiles' terms are all in
#pragma unroll
      for (int m = 0; m < kRowBlocks; ++m)
#pragma unroll
        for (int n = 0; n < kColTiles; ++n)
#pragma unroll
          for (int e = 0; e < 4; ++e) acc[m][n][e] *= 2;
    }
    if (active) multiply_chunk(&st.b[buf][0][0] + b_at, b_sign, &st.w[buf][t4][wc + g], acc);
  }

  // The warp's rows are chunk `half`, staged last but `half` (two chunks when active).
  double sums[kColTiles][2] = {};
  if (active) weigh_rows(acc, &st.w[(chunks - 1 - half) & 1][g][wc + 2 * t4], sums);
#pragma unroll
  for (int n = 0; n < kColTiles; ++n) {  // over lane / 4
    sums[n][0] = butterfly_sum<4, 16>(sums[n][0]);
    sums[n][1] = butterfly_sum<4, 16>(sums[n][1]);
  }
  if (g == 0) {
#pragma unroll
    for (int n = 0; n < kColTiles; ++n) {
      st.sums[half][wc + 8 * n + 2 * t4] = sums[n][0];
      st.sums[half][wc + 8 * n + 2 * t4 + 1] = sums[n][1];
    }
  }
  __syncthreads();
  const int column = threadIdx.x;
  if (column >= kTile || col0 + column >= a.cols) return;
  const int64_t row = int64_t(bin) * a.row_tiles + row_tile;
  a.partial[(row * a.groups + group) * a.cols + col0 + column] = weight * (st.sums[0][column] + st.sums[1][column]);
}

template <int kWidth>
void launch(const FormArgs& a, int64_t blocks, cudaStream_t stream) {
  allow_dynamic_smem(quad_form_mma_kernel<kWidth>, kSmemBytes);
  launch_overlapping(quad_form_mma_kernel<kWidth>, dim3(static_cast<unsigned>(blocks)), dim3(kThreads),
                     static_cast<size_t>(kSmemBytes), stream, a);
}

int64_t tiles(int64_t n) { return (n + kTile - 1) / kTile; }

}  // namespace

bool quad_forms_mma_supported(const at::Tensor& blocks, const at::Tensor& w_hat) {
  const int64_t rows = w_hat.size(4), cols = w_hat.size(5), pairs = w_hat.numel() / std::max<int64_t>(rows * cols, 1);
  const int64_t alignment = cols % 2 == 0 ? 16 : 8;  // the copies of W: launch<2> or launch<1>
  // Offsets within a (bin, group) pair are int, up to a tile past R and C (R^'s: R / 2 rows of R
  // doubles), and so is the block index. R^'s values are copied 16 bytes at a time.
  if (w_hat.numel() == 0 || !blocks.is_contiguous() || !w_hat.is_contiguous() ||
      reinterpret_cast<std::uintptr_t>(blocks.data_ptr()) % 16 != 0 ||
      reinterpret_cast<std::uintptr_t>(w_hat.data_ptr()) % alignment != 0 ||
      (rows + kTile) * (std::max(rows, cols) + kTile) >= (int64_t(1) << 31) ||
      pairs * tiles(rows) * tiles(cols) >= (int64_t(1) << 31) || kSmemBytes > dynamic_smem_limit()) {
    return false;
  }
  return compiled_for_sm90(reinterpret_cast<const void*>(quad_form_mma_kernel<2>), w_hat.device());
}

at::Tensor quad_forms_mma_cuda(const at::Tensor& blocks, const at::Tensor& w_hat, const at::Tensor& mirror) {
  const c10::cuda::CUDAGuard guard(w_hat.device());
  const at::Tensor m = mirror.contiguous();  // a no-op here
  FormArgs a;
  a.b = reinterpret_cast<const double*>(blocks.data_ptr());  // complex128: Re, Im adjacent
  a.w = w_hat.data_ptr<double>();
  a.mirror = m.data_ptr<double>();
  a.rows = static_cast<int>(w_hat.size(4));
  a.cols = static_cast<int>(w_hat.size(5));
  a.mw = static_cast<int>(w_hat.size(2));
  a.groups = static_cast<int>(w_hat.size(3));
  a.row_tiles = static_cast<int>(tiles(a.rows));
  a.col_tiles = static_cast<int>(tiles(a.cols));
  const int64_t bins = w_hat.size(0) * w_hat.size(1) * w_hat.size(2);
  auto partial = at::empty({bins * a.row_tiles, a.groups, a.cols}, w_hat.options());
  a.partial = partial.data_ptr<double>();
  const int64_t per_pair = int64_t(a.row_tiles) * a.col_tiles, pairs = bins * a.groups;
  const int64_t count = pairs * per_pair;
  // The tail: the pairs of two waves' blocks (all of them in a smaller grid). Both bounded by
  // count < 2^31 (quad_forms_mma_supported).
  const int64_t wave = int64_t(at::cuda::getCurrentDeviceProperties()->multiProcessorCount) * kBlocksPerSm;
  a.pairs = static_cast<int>(pairs);
  a.tail_pairs = static_cast<int>(std::min(pairs, (2 * wave + per_pair - 1) / per_pair));
  a.head_blocks = static_cast<int>(count - a.tail_pairs * per_pair);
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  if (a.cols % 2 == 0) {
    launch<2>(a, count, stream);
  } else {
    launch<1>(a, count, stream);
  }
  return partial;
}

}  // namespace fused_ops
