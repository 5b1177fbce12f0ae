#!/usr/bin/env bash
# temporary: one device call (not committed)
set -o pipefail
export OUT=${OUT:-/tmp/o}
scripts/gpu_check.sh build | tail -4 || exit 1
R=$(pwd)
(cd /tmp && python3 $R/scripts/profile_seed.py train contiguous cross_spectrum 2>&1 | grep -v Warn | head -14 > $OUT/seed-profile.txt)
cat $OUT/seed-profile.txt
TESTS="test_fft_energy.py test_correlation_paths.py" PYTEST_WORKERS=15 PYTEST_K="not cpu" scripts/gpu_check.sh test | tail -6
(cd /tmp && python3 $R/bench/bench_ct_bn_pool.py --problems seed,b4,s8,k3,c128,t8c64 --modes train --no-compile --algos auto --out $OUT/train 2>&1 | tail -9)
