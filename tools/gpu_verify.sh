#!/bin/bash
# One full GPU run: precompile the hot kernels, the bench on a quiet GPU, then the whole gpu test tier.
# Usage on the device: source .gpu/prelude.sh && bash tools/gpu_verify.sh   (logs under $OUT, else logs/)
# Step limits (seconds) via T_COMPILE, T_BENCH, T_TEST; OPS limits the bench.
set -o pipefail
OUT=${OUT:-logs}; mkdir -p "$OUT"
export TILELANG_CACHE_DIR=${TILELANG_CACHE_DIR:-/tmp/tlcache}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; date -u +%FT%TZ
timeout ${T_COMPILE:-90} python3 -m tilefuse precompile --jobs 16 --ops per_token_cast batched_transpose \
  2>&1 | tail -3 | tee "$OUT/precompile.log"
timeout ${T_BENCH:-120} python3 -m tilefuse bench --ops ${OPS:-per_token_cast transpose} --no-compile-ref \
  --host-overhead --cold-start --json "$OUT/bench.json" --plot "$OUT/bench.png" 2>&1 | tee "$OUT/bench.log" | tail -40
timeout ${T_TEST:-240} python3 -m pytest -m gpu -n 8 -q -p no:randomly tests 2>&1 | tee "$OUT/gpu.log" \
  | grep -E "passed|failed|FAILED|ERROR" | tail -40
