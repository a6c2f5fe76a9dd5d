#!/bin/bash
# One device run for the per-token cast (issue #3): precompile the registered configs and the tile-sweep
# variants together (16 workers), then the bench (kernel times, tile sweep, host overhead) on a quiet GPU,
# then the GPU tier. Usage on the device: source .gpu/prelude.sh && bash tools/ptc_run.sh
# Env: TILES (a tile sweep, e.g. 256x2,256x4; each tile adds 5 compiles), COLD=1 (also time a second
# process's first call), T_COMPILE / T_BENCH / T_TEST (seconds per step). Measured on the H200 (2026-11-29):
# 57 compiles did not finish in 50 s on 16 workers (42 took 27 s before); the GPU tier with -n 8 needs ~70 s.
set -o pipefail
export TILELANG_CACHE_DIR=/tmp/tlcache
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
date -u +%FT%TZ
timeout ${T_COMPILE:-90} python3 - "$TILES" <<'PY' 2>&1 | tail -5 | tee $OUT/precompile.log
import sys, time
from tilefuse import _jit, bench
work = [("per_token_cast", c) for c in _jit.registered()["per_token_cast"]]
work += bench.sweep_work(bench.parse_tiles(sys.argv[1])) if sys.argv[1] else []
t0 = time.perf_counter()
failures = _jit.compile_many(work, _jit.current_arch(), 16)
print(f"compiled {len(work) - len(failures)}/{len(work)} kernels in {time.perf_counter() - t0:.1f} s")
for (name, cfg), exc in failures:
    print("FAILED", name, cfg, exc[:300])
PY
timeout ${T_BENCH:-90} python3 -c "import sys; from tilefuse.bench import main; sys.exit(main(sys.argv[1:]))" \
  --ops per_token_cast --no-compile-ref --host-overhead ${COLD:+--cold-start} ${TILES:+--tiles $TILES} \
  --json $OUT/bench.json 2>&1 | tee $OUT/bench.log | tail -40
timeout ${T_TEST:-150} python3 -m pytest -m gpu -n 8 -q -p no:randomly tests/quant/test_per_token_cast_kernel.py \
  2>&1 | tee $OUT/gpu.log | tail -15
