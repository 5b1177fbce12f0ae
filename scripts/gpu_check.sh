#!/usr/bin/env bash
# Everything that needs the GPU in one call (CI has none): build, CUDA tests, sanitizers, bench.
# Builds the source tree in place (an editable install against the machine's torch), runs the
# tests from the repository root (they import the tree), compute-sanitizer on
# scripts/sanitize_cases.py and the benchmark. Logs go to $OUT (default /tmp/gpu_check).
#   scripts/gpu_check.sh [build] [test] [sanitize] [profile] [ncu] [ncu-cross] [bench] [bench-full]
#                        [bench-strided] [bench-train] [bench-small] [bench-padded] [bench-eval]
#                        [bench-real] [bench-backward] [host] [memory-format] [wall] [dist]
#                        [bench-compare]
# (default: build test sanitize bench); TESTS="test_a.py test_b.py" limits the test step;
# PYTEST_WORKERS=N runs it as one pytest-xdist run of N processes (the suite in minutes);
# PYTEST_K="expr" passes -k expr to pytest (default "not cpu": the CPU-parametrized cases are
# CI's; PYTEST_K= runs everything). bench-compare: BASE_PKG=<a .tgz of, or a folder holding,
# a fused_ops package built on this machine from the tree before a change> benches the seed rows
# of both trees alternately, twice each (COMPARE_PROBLEMS to change the problems).
# PREBUILT=1: the build step uses a fused_ops/_C*.so already in the tree if it loads (built
# elsewhere against this machine's torch and Python, `TORCH_CUDA_ARCH_LIST=9.0 python setup.py
# build_ext --inplace`), and builds only if it does not: a CUDA build takes minutes here.
set -u -o pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)
export PYTHONPATH=$REPO${PYTHONPATH:+:$PYTHONPATH}  # scripts/ and bench/ import this tree
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
export MAX_JOBS=${MAX_JOBS:-16} TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} PYTHONUNBUFFERED=1
steps=${*:-build test sanitize bench}
PYTEST_K=${PYTEST_K-not cpu}
status=0

step() { echo "=== $1 ($(date -u +%H:%M:%S))"; }
want() { [[ " $steps " == *" $1 "* ]]; }

# run_bench LOG LINES ARGS...: the benchmark, its output in $OUT/LOG.log, the last LINES lines shown.
run_bench() {
  local log=$1 lines=$2
  shift 2
  python3 "$REPO/bench/bench_ct_bn_pool.py" "$@" 2>&1 | tee "$OUT/$log.log" | tail -"$lines" || status=1
}

if want build; then
  step build
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
  if [[ -n ${PREBUILT:-} ]] && python3 -c "import fused_ops._C" >"$OUT/build.log" 2>&1; then
    echo "the carried build: $(ls fused_ops/_C*.so)"
  elif ! python3 -m pip install --no-build-isolation --no-deps -e . >"$OUT/build.log" 2>&1; then
    tail -60 "$OUT/build.log"
    exit 1
  fi
  python3 -m fused_ops 2>&1 | tee "$OUT/main.txt"
fi
if want test; then
  step test
  # From the repository root: the tests import the tree (the editable install's). One file
  # at a time without xdist, so that a crash in one does not hide the others' results.
  files=$(for t in ${TESTS:-}; do echo "tests/$t"; done)
  if [[ -n ${PYTEST_WORKERS:-} ]]; then  # one run over pytest-xdist workers sharing the GPU
    python3 -m pytest ${files:-tests} -n "$PYTEST_WORKERS" -v -p no:cacheprovider -rfE \
      --tb=short ${PYTEST_K:+-k "$PYTEST_K"} >>"$OUT/pytest.log" 2>&1 || status=1
  else
    for f in ${files:-tests/test_*.py}; do
      python3 -m pytest "$f" -v -p no:cacheprovider -rfE --tb=short ${PYTEST_K:+-k "$PYTEST_K"} \
        >>"$OUT/pytest.log" 2>&1 || status=1
    done
  fi
  grep -E "^(FAILED|ERROR)|Fatal|passed|failed" "$OUT/pytest.log" | tail -30
fi
if want sanitize; then
  step sanitize
  # racecheck runs the cases an order of magnitude slower than memcheck: both tools at once,
  # each over SANITIZE_SHARDS processes that share the cases (sanitize_cases.py --shard).
  shards=${SANITIZE_SHARDS:-4}
  pids=()
  for tool in memcheck racecheck; do
    limit=${MEMCHECK_S:-300}; [[ $tool == racecheck ]] && limit=${RACECHECK_S:-540}
    for ((i = 0; i < shards; i++)); do
      timeout "$limit" compute-sanitizer --tool "$tool" --error-exitcode 9 \
        python3 "$REPO/scripts/sanitize_cases.py" --shard "$i/$shards" >"$OUT/sanitizer-$tool-$i.log" 2>&1 &
      pids+=($!)
    done
  done
  for pid in "${pids[@]}"; do wait "$pid" || status=1; done
  for tool in memcheck racecheck; do  # one log per tool, each shard's summary shown
    for ((i = 0; i < shards; i++)); do
      echo "$tool $i/$shards: $(grep -E "SUMMARY|cases ran" "$OUT/sanitizer-$tool-$i.log" | tr '\n' ' ')"
      cat "$OUT/sanitizer-$tool-$i.log" >>"$OUT/sanitizer-$tool.log" && rm "$OUT/sanitizer-$tool-$i.log"
    done
  done
fi
if want profile; then
  step profile
  (python3 scripts/profile_seed.py eval && python3 scripts/profile_seed.py train &&
    python3 scripts/profile_seed.py step && python3 scripts/profile_seed.py eval channels_last_3d) 2>&1 |
    tee "$OUT/profile.log" || status=1
fi
if want ncu; then
  step ncu
  # One launch of each FFT-path kernel and of the eval kernels: occupancy, throughput, stalls.
  for k in spectral_energy weight_spectrum spatial_sum bn_finalize spatial_sum_channels_last; do
    mode=train; [[ $k == spatial_sum* || $k == bn_finalize ]] && mode=eval
    layout=contiguous; [[ $k == spatial_sum_channels_last ]] && layout=channels_last_3d
    timeout 120 ncu --kernel-name "regex:$k" --launch-skip 3 --launch-count 1 \
      --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
      --section MemoryWorkloadAnalysis python3 scripts/profile_seed.py "$mode" "$layout" \
      >"$OUT/ncu-$k.log" 2>&1 || status=1
    grep -E "Duration|Registers Per|Achieved Occupancy|Theoretical Occupancy|Compute \(SM\) Throughput|Memory Throughput|Local|Stall|Block Limit|Dynamic Shared" "$OUT/ncu-$k.log" | head -24
  done
fi
if want ncu-cross; then
  step ncu-cross
  # The seed call's largest kernels on the cross-spectrum path (S stage, x's plane DFT, W stage)
  # and t8c32's direct kernel: where their warps stall, instruction mix, and the source lines
  # that stall most.
  for k in cross_spectrum_mma_kernel plane_dft_kernel lag_stage_kernel energy_direct_kernel; do
    args=(train contiguous cross_spectrum); [[ $k == energy_direct_kernel ]] && args=(train contiguous direct --problem t8c32)
    timeout 150 ncu --kernel-name "regex:$k" --launch-skip 3 --launch-count 1 --import-source yes \
      --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
      --section SchedulerStats --section InstructionStats --section SourceCounters \
      python3 scripts/profile_seed.py "${args[@]}" >"$OUT/ncu-$k.log" 2>&1 || status=1
    grep -E "Duration|Registers Per|Achieved Occupancy|Compute \(SM\) Throughput|Issued Ipc|Warp Cycles Per Issued|Stall|Block Limit" "$OUT/ncu-$k.log" | head -20
  done
fi
if want bench-compare; then
  step bench-compare
  base=${BASE_PKG:?bench-compare needs BASE_PKG}
  if [[ -f $base ]]; then mkdir -p /tmp/fused_ops_base && tar -xzf "$base" -C /tmp/fused_ops_base; base=/tmp/fused_ops_base; fi
  for round in 1 2; do
    for side in before after; do
      path=$REPO; [[ $side == before ]] && path=$base
      # From /tmp, so that PYTHONPATH decides: the package before, or this tree.
      (cd /tmp && PYTHONPATH=$path python3 -c "import fused_ops; print('== $side $round:', fused_ops.__file__)" &&
        PYTHONPATH=$path python3 "$REPO/bench/bench_ct_bn_pool.py" --problems "${COMPARE_PROBLEMS:-seed}" \
          --modes eval,train --no-compile --out "$OUT/compare-$side$round") 2>&1 |
        tee -a "$OUT/bench-compare.log" | grep -E "^(==|shape|[a-z0-9]+ +(eval|train) )" || status=1
    done
  done
fi
if want bench; then
  step bench
  run_bench bench-seed 20 --problems seed --no-compile --algos auto,fft,sliced_conv --out "$OUT"
fi
if want bench-real; then
  step bench-real
  # The real-layer sweep (decoder families, batch 1 to 32, float32 and bfloat16): GPU time,
  # eager-loop time, peak memory and accuracy of both modes against eager in one run.
  python3 "$REPO/bench/check_problems.py" >"$OUT/check-problems.log" 2>&1 || { status=1; tail -5 "$OUT/check-problems.log"; }
  run_bench bench-real 70 --sweep real --dtypes float32,bfloat16 --modes eval,train --no-compile --out "$OUT/real"
fi
if want bench-backward; then
  step bench-backward
  # Training steps (forward + backward) on each backward route where it applies, eager in the
  # same run: the measurement CUDA's backward dispatch awaits (docs/dispatch.md).
  for route in aten spectral gram; do
    problems=seed,k3,t8k5; [[ $route == gram ]] && problems=up2,k2s2-c128-s16-b8,deep-c512-s8-b8
    [[ $route == aten ]] && problems=seed,k3,t8k5,up2,k2s2-c128-s16-b8,deep-c512-s8-b8
    run_bench "bench-backward-$route" 12 --problems "$problems" --modes train --passes step \
      --no-compile --reps 20 --backward "$route" --out "$OUT/backward"
  done
fi
if want host; then
  step host
  # Host time per call (issue, ATen ops, the op's dispatch) by the CPU profiler.
  python3 scripts/host_time.py 2>&1 | grep -v -E "^(USDT|ERROR|WARNING):" | tee "$OUT/host.log" || status=1
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
  # Padding > 0, which the FFT, correlation and cross-spectrum paths do not cover.
  run_bench bench-padded 12 --problems pad2,t8pad1 --modes train --no-compile --algos auto,border,direct,sliced_conv --out "$OUT/padded"
fi
if want bench-eval; then
  step bench-eval
  # The whole sweep in eval mode, fused_ops against eager.
  run_bench bench-eval 16 --problems seed,b4,b64,c16,c128,s8,s32,k3,odd,t8,t8c32 --modes eval --no-compile --out "$OUT/eval"
fi
if want wall; then
  step wall
  # Training on the seed problem, 50 calls back to back: what an eager loop sees, the larger
  # of host issue and GPU time (the bench's figures are GPU time alone).
  for algo in fft cross_spectrum; do
    python3 scripts/profile_seed.py train contiguous "$algo" wall 2>&1 | tee -a "$OUT/wall.log" || status=1
  done
fi
if want memory-format; then
  step memory-format
  # channels_last_3d inputs for all three implementations (docs/performance.md, memory formats);
  # compare with the contiguous rows of `bench` or `bench-full`.
  run_bench bench-channels-last 20 --problems seed,b4,c16,s8 --no-compile --memory-format channels_last_3d --out "$OUT"
fi
if want dist; then
  step dist
  # Synchronized statistics over NCCL, one process per GPU (needs 2 GPUs).
  timeout 300 torchrun --standalone --nproc_per_node 2 scripts/dist_check.py --out "$OUT" \
    2>&1 | tee "$OUT/dist.log" | tail -30 || status=1
fi
if want bench-full; then
  step bench-full
  # torch.compile takes 10-20 s per problem and mode, so it is timed where it matters most.
  run_bench bench 40 --compile-problems seed,b4,s8 --out "$OUT"
fi
step "done, status $status"
exit $status
