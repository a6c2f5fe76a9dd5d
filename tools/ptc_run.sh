#!/bin/bash
# One device run for the per-token cast (issue #3): precompile the registered configs and the tile-sweep
# variants together (16 workers), then the bench (kernel times, tile sweep, host overhead) on a quiet GPU,
# then the GPU tier. Usage on the device: source .gpu/prelude.sh && bash tools/ptc_run.sh
# Env: TILES (tile sweep), COLD=1 (also time a second process's first call).
set -o pipefail
export TILELANG_CACHE_DIR=/tmp/tlcache
TILES=${TILES:-256x2,256x4,128x4,512x2}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
date -u +%FT%TZ
timeout ${T_COMPILE:-80} python3 - "$TILES" <<'PY' 2>&1 | tail -5 | tee $OUT/precompile.log
import sys, time
from tilefuse import _jit, bench
work = [("per_token_cast", c) for c in _jit.registered()["per_token_cast"]]
work += bench.sweep_work(bench.parse_tiles(sys.argv[1]))
t0 = time.perf_counter()
failures = _jit.compile_many(work, _jit.current_arch(), 16)
print(f"compiled {len(work) - len(failures)}/{len(work)} kernels in {time.perf_counter() - t0:.1f} s")
for (name, cfg), exc in failures:
    print("FAILED", name, cfg, exc[:300])
PY
timeout ${T_BENCH:-60} python3 -c "import sys; from tilefuse.bench import main; sys.exit(main(sys.argv[1:]))" \
  --ops per_token_cast --no-compile-ref --host-overhead ${COLD:+--cold-start} --tiles $TILES \
  --json $OUT/bench.json 2>&1 | tee $OUT/bench.log | tail -40
timeout ${T_TEST:-100} python3 -m pytest -m gpu -n 8 -q -p no:randomly tests/quant/test_per_token_cast_kernel.py \
  2>&1 | tee $OUT/gpu.log | tail -15
