#!/bin/bash
# One device run for the per-token cast (issue #3): precompile, GPU tier, bench with tile sweep,
# host overhead and cold start. Usage on the device: source .gpu/prelude.sh && bash tools/ptc_run.sh
set -o pipefail
export TILELANG_CACHE_DIR=/tmp/tlcache
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
date -u +%FT%TZ
python3 -c "import sys; from tilefuse._jit import precompile_main; sys.exit(precompile_main(['--ops', 'per_token_cast', '--jobs', '16']))" 2>&1 | tail -3 | tee $OUT/precompile.log
timeout 200 python3 -m pytest -m gpu -n 8 -q -p no:randomly tests/quant/test_per_token_cast_kernel.py 2>&1 | tee $OUT/gpu.log | tail -25
timeout 220 python3 -c "import sys; from tilefuse.bench import main; sys.exit(main(sys.argv[1:]))" \
  --ops per_token_cast --no-compile-ref --host-overhead --cold-start --tiles ${TILES:-256x2,256x4,256x8,512x4,512x8,128x8} \
  --json $OUT/bench.json 2>&1 | tee $OUT/bench.log | tail -45
