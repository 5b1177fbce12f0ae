#!/usr/bin/env bash
# Everything that needs the GPU, in one call of the device tool (CI has no GPU):
# build against the machine's torch, run the CUDA tests, compute-sanitizer and
# the benchmark. Logs go to $OUT (default /tmp/gpu_check).
#   scripts/gpu_check.sh [build] [test] [sanitize] [profile] [ncu] [bench] [bench-full] [dist]
#                        [backward] [memory-format] [eval-variants] [x-read-variants] [bench-strided]
#                        [bench-train] [bench-eval] [bench-small] [bench-padded] [wall] [ncu-cross]
#                        [lag-stage-variants]
# (default: build test sanitize bench); TESTS="test_a.py test_b.py" limits the test step;
# PYTEST_WORKERS=N runs it as one pytest-xdist run of N processes (the suite in minutes);
# PYTEST_K="expr" passes -k expr to pytest (say, "not cpu" to leave the CPU-parametrized
# cases to CI).
set -u -o pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
export MAX_JOBS=${MAX_JOBS:-16} TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} PYTHONUNBUFFERED=1
steps=${*:-build test sanitize bench}
status=0

step() { echo "=== $1 ($(date -u +%H:%M:%S))"; }
want() { [[ " $steps " == *" $1 "* ]]; }

# run_bench LOG LINES ARGS...: the benchmark from /tmp (so the installed package is imported),
# its output in $OUT/LOG.log, the last LINES lines shown.
run_bench() {
  local log=$1 lines=$2
  shift 2
  (cd /tmp && python3 "$REPO/bench/bench_ct_bn_pool.py" "$@") 2>&1 | tee "$OUT/$log.log" | tail -"$lines" || status=1
}

if want build; then
  step build
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
  if ! python3 -m pip install --no-build-isolation --no-deps . >"$OUT/build.log" 2>&1; then
    tail -60 "$OUT/build.log"
    exit 1
  fi
  (cd /tmp && python3 -m fused_ops) 2>&1 | tee "$OUT/main.txt"
fi
if want test; then
  step test
  # From /tmp so the installed package, not the source tree, is imported; one
  # file at a time so that a crash in one does not hide the others' results.
  files=$(for t in ${TESTS:-}; do echo "$REPO/tests/$t"; done)
  if [[ -n ${PYTEST_WORKERS:-} ]]; then  # one run over pytest-xdist workers sharing the GPU
    (cd /tmp && python3 -m pytest ${files:-"$REPO"/tests} -n "$PYTEST_WORKERS" -v -p no:cacheprovider -rfE \
      --tb=short ${PYTEST_K:+-k "$PYTEST_K"}) >>"$OUT/pytest.log" 2>&1 || status=1
  else
    for f in ${files:-"$REPO"/tests/test_*.py}; do
      (cd /tmp && python3 -m pytest "$f" -v -p no:cacheprovider -rfE --tb=short ${PYTEST_K:+-k "$PYTEST_K"}) >>"$OUT/pytest.log" 2>&1 || status=1
    done
  fi
  grep -E "^(FAILED|ERROR)|Fatal|passed|failed" "$OUT/pytest.log" | tail -30
fi
if want sanitize; then
  step sanitize
  for tool in memcheck racecheck; do
    (cd /tmp && timeout 200 compute-sanitizer --tool "$tool" --error-exitcode 9 python3 "$REPO/scripts/sanitize_cases.py") \
      >"$OUT/sanitizer-$tool.log" 2>&1 || status=1
    tail -3 "$OUT/sanitizer-$tool.log"
  done
fi
if want profile; then
  step profile
  (cd /tmp && python3 "$REPO/scripts/profile_seed.py" eval && python3 "$REPO/scripts/profile_seed.py" train &&
    python3 "$REPO/scripts/profile_seed.py" eval channels_last_3d) 2>&1 | tee "$OUT/profile.log" || status=1
fi
if want ncu; then
  step ncu
  # One launch of each FFT-path kernel and of the eval kernels: occupancy, throughput, stalls.
  for k in spectral_energy weight_spectrum spatial_sum bn_finalize spatial_sum_channels_last; do
    mode=train; [[ $k == spatial_sum* || $k == bn_finalize ]] && mode=eval
    layout=contiguous; [[ $k == spatial_sum_channels_last ]] && layout=channels_last_3d
    (cd /tmp && timeout 120 ncu --kernel-name "regex:$k" --launch-skip 3 --launch-count 1 \
      --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
      --section MemoryWorkloadAnalysis python3 "$REPO/scripts/profile_seed.py" "$mode" "$layout") \
      >"$OUT/ncu-$k.log" 2>&1 || status=1
    grep -E "Duration|Registers Per|Achieved Occupancy|Theoretical Occupancy|Compute \(SM\) Throughput|Memory Throughput|Local|Stall|Block Limit|Dynamic Shared" "$OUT/ncu-$k.log" | head -24
  done
fi
if want ncu-cross; then
  step ncu-cross
  # The seed call's largest kernels on the cross-spectrum path (docs/performance.md: S stage,
  # on sm_90 cross_spectrum_mma_kernel; x's plane DFT, W stage) and t8c32's direct kernel:
  # where their warps stall, instruction mix, and the source lines that stall most (the next
  # tuning starts from these).
  for k in cross_spectrum_mma_kernel plane_dft_kernel lag_stage_kernel energy_direct_kernel; do
    args=(train contiguous cross_spectrum); [[ $k == energy_direct_kernel ]] && args=(train contiguous direct --problem t8c32)
    (cd /tmp && timeout 150 ncu --kernel-name "regex:$k" --launch-skip 3 --launch-count 1 --import-source yes \
      --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
      --section SchedulerStats --section InstructionStats --section SourceCounters \
      python3 "$REPO/scripts/profile_seed.py" "${args[@]}") >"$OUT/ncu-$k.log" 2>&1 || status=1
    grep -E "Duration|Registers Per|Achieved Occupancy|Compute \(SM\) Throughput|Issued Ipc|Warp Cycles Per Issued|Stall|Block Limit" "$OUT/ncu-$k.log" | head -20
  done
fi
if want bench; then
  step bench
  run_bench bench-seed 20 --problems seed --no-compile --algos auto,fft,sliced_conv --out "$OUT"
fi
if want bench-strided; then
  step bench-strided
  # The strided problems in training with every algorithm that covers them (the auto rule
  # for strides rests on this; docs/performance.md).
  run_bench bench-strided 14 --problems st2,up2 --modes train --no-compile --algos auto,fft,sliced_conv,correlation,cross_spectrum --out "$OUT/strided"
fi
if want bench-train; then
  step bench-train
  # The stride-1 sweep in training with the FFT and cross-spectrum paths (the auto rule
  # for stride 1 rests on this; docs/performance.md).
  run_bench bench-train 42 --problems seed,b4,b64,c16,c128,s8,s32,k3,odd,t8,t8c32,t8c64,t8k5 --modes train --no-compile --algos auto,fft,cross_spectrum --out "$OUT/train"
fi
if want bench-small; then
  step bench-small
  # The smaller stride-1 problems in training with every algorithm, direct and cuDNN over
  # slices included: where launch latency, not work, decides (the auto rule for them).
  run_bench bench-small 44 --problems odd,t8,t8c32,t8c64,t8k5,s8,c16,b4 --modes train --no-compile --algos auto,fft,cross_spectrum,direct,sliced_conv --out "$OUT/small"
fi
if want bench-padded; then
  step bench-padded
  # Padding > 0, which the FFT, correlation and cross-spectrum paths do not cover: issue #4
  # asks for training there too to be at least as fast as eager, with less memory.
  run_bench bench-padded 12 --problems pad2,t8pad1 --modes train --no-compile --algos auto,border,direct,sliced_conv --out "$OUT/padded"
fi
if want bench-eval; then
  step bench-eval
  # The whole sweep in eval mode, fused_ops against eager (issue #3's targets).
  run_bench bench-eval 16 --problems seed,b4,b64,c16,c128,s8,s32,k3,odd,t8,t8c32 --modes eval --no-compile --out "$OUT/eval"
fi
if want wall; then
  step wall
  # Training on the seed problem, 50 calls back to back: what an eager loop sees, the larger
  # of host issue and GPU time (the bench's figures are GPU time alone).
  for algo in fft cross_spectrum; do
    (cd /tmp && python3 "$REPO/scripts/profile_seed.py" train contiguous "$algo" wall) 2>&1 | tee -a "$OUT/wall.log" || status=1
  done
fi
if want memory-format; then
  step memory-format
  # channels_last_3d inputs for all three implementations (docs/performance.md, memory formats);
  # compare with the contiguous rows of `bench` or `bench-full`.
  run_bench bench-channels-last 20 --problems seed,b4,c16,s8 --no-compile --memory-format channels_last_3d --out "$OUT"
fi
# A standalone CUDA microbenchmark (no torch): scripts/$1.cu built with nvcc and run, its
# output in $OUT/<name>.log; it exits non-zero if a variant's output is off its host reference.
microbenchmark() {
  local name=${1//_/-}
  NVCC=$(command -v nvcc || echo "${CUDA_HOME:-/usr/local/cuda}/bin/nvcc")
  if "$NVCC" -O3 -std=c++17 -arch=sm_90 "$REPO/scripts/$1.cu" -o "/tmp/$1" >"$OUT/$name-build.log" 2>&1; then
    "/tmp/$1" 2>&1 | tee "$OUT/$name.log" || status=1
  else
    tail -30 "$OUT/$name-build.log"
    status=1
  fi
}
if want eval-variants; then
  step eval-variants
  # Variants of the eval call (x pass and finalize) against a D2D copy and pure-read kernels.
  microbenchmark eval_variants
fi
if want x-read-variants; then
  step x-read-variants
  # Ways to read x in the eval x pass: load instructions, loads in flight, blocks per SM and
  # bulk copies into shared memory, against a D2D copy and cub's reduce.
  microbenchmark x_read_variants
fi
if want lag-stage-variants; then
  step lag-stage-variants
  # Ways to run a lag stage on the seed problem's shape (then its H stage): threads per column, loads in flight,
  # Q's layout, against a D2D copy and a plain read (docs/performance.md, 2026-12-01 14:31 UTC).
  microbenchmark lag_stage_variants
fi
if want backward; then
  step backward
  # Forward + backward against the unfused modules: time, peak memory, gradient error.
  (cd /tmp && python3 "$REPO/scripts/backward_check.py" cuda) 2>&1 | tee "$OUT/backward.log" || status=1
fi
if want dist; then
  step dist
  # Issue #7: synchronized statistics over NCCL, one process per GPU (needs 2 GPUs).
  (cd /tmp && timeout 300 torchrun --standalone --nproc_per_node 2 "$REPO/scripts/dist_check.py" \
    --out "$OUT") 2>&1 | tee "$OUT/dist.log" | tail -30 || status=1
fi
if want bench-full; then
  step bench-full
  # torch.compile takes 10-20 s per problem and mode, so it is timed where it matters most.
  run_bench bench 40 --compile-problems seed,b4,s8 --out "$OUT"
fi
step "done, status $status"
exit $status
