#!/bin/bash
# Compile every registered kernel config for sm_90 here (no GPU needed) and pack tilefuse's exported
# libraries into .gpu/kcache.tar.xz, which tools/gpu_verify.sh unpacks on the device: the GPU machine then
# spends its time measuring instead of compiling. Libraries are keyed by a digest of their kernel module, so
# an edited kernel is simply recompiled on the device. Usage: bash tools/pack_kernel_cache.sh [--ops NAME ...]
set -o pipefail  # a failed config is reported and skipped; the rest is still packed
# BENCH_ONLY=1 packs only the configs the bench launches (minutes sooner; the GPU tests then compile the rest)
python3 -m tilefuse precompile --jobs "${JOBS:-2}" --arch sm_90 ${BENCH_ONLY:+--bench} "$@" 2>&1 | grep -E "^FAILED|^compiled" | tail -8
# SWEEP="256x4,256x4x4" also compiles the per_token_cast tile-sweep variants of ``bench --tiles``;
# VARIANTS=FILE also compiles, for each line "OPS|KNOBS" of FILE, the bench configs of OPS with TILEFUSE_KNOBS=KNOBS
# (the knob sweep of tools/gpu_verify.sh)
# only the libraries of the current sources (older digests stay behind)
cat > /tmp/kcache_list.py <<'PY'
import os
import sys

from tilefuse import _jit
from tilefuse.bench import extras, runner

if __name__ == "__main__":  # compile_many spawns workers that re-import this file
    if os.environ.get("BENCH_ONLY"):
        work = runner.bench_configs()
    else:
        work = [(name, cfg) for name, cfgs in _jit.registered().items() for cfg in cfgs]
    extra = []
    if os.environ.get("SWEEP"):
        sweep = extras.sweep_work(extras.parse_tiles(os.environ["SWEEP"]))
        todo = [w for w in sweep if not os.path.exists(_jit._lib_path(*w, "sm_90"))]
        for (name, cfg), err in _jit.compile_many(todo, "sm_90", int(os.environ.get("JOBS", "2"))):
            print("FAILED", name, cfg, err[:200], file=sys.stderr)
        work += sweep
    variants = os.environ.get("VARIANTS")
    for line in (open(variants).read().splitlines() if variants else []):
        if line.strip() and not line.startswith("#"):
            ops, _, knob_text = line.partition("|")
            env = dict(os.environ, TILEFUSE_KNOBS=knob_text.strip())
            import subprocess

            subprocess.run([sys.executable, "-m", "tilefuse", "precompile", "--bench", "--arch", "sm_90", "--jobs",
                            os.environ.get("JOBS", "2"), "--ops", *ops.split()], env=env, check=False)
            listing = subprocess.run([sys.executable, "-c", "import sys; from tilefuse import _jit; from tilefuse.bench.runner import bench_configs; "
                                      "[print(_jit._lib_path(n, c, 'sm_90')) for n, c in bench_configs(sys.argv[1:])]",
                                      *ops.split()], env=env, capture_output=True, text=True).stdout.split()
            extra += [p for p in listing if os.path.exists(p)]
    with open(sys.argv[1], "w") as f:
        for name, cfg in work:
            path = _jit._lib_path(name, cfg, "sm_90")
            if os.path.exists(path):
                f.write(os.path.basename(path) + "\n")
        for path in extra:
            f.write(os.path.basename(path) + "\n")
PY
PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" python3 /tmp/kcache_list.py /tmp/kcache.list 2>&1 | grep FAILED
# TESTS="tests/mhc tests/engram" also packs every library those tests' compile tier builds (the configs the GPU
# tests launch, beyond the registered ones): about 1 MB for mhc and engram
if [ -n "${TESTS:-}" ]; then
  rm -f /tmp/kcache_tests.log
  TILEFUSE_LIB_LOG=/tmp/kcache_tests.log python3 -m pytest -q -n "${JOBS:-2}" -p no:randomly -m compile $TESTS | tail -1
  sort -u /tmp/kcache_tests.log | while read -r p; do [ -f "$p" ] && basename "$p"; done >> /tmp/kcache.list
  sort -u -o /tmp/kcache.list /tmp/kcache.list
fi
dir="${TILEFUSE_CACHE_DIR:-${TILELANG_CACHE_DIR:-$HOME/.tilelang/cache}/tilefuse}"
mkdir -p .gpu && tar -C "$dir" -cJf .gpu/kcache.tar.xz -T /tmp/kcache.list
echo "$(wc -l < /tmp/kcache.list) libraries, $(du -h .gpu/kcache.tar.xz | cut -f1)"
