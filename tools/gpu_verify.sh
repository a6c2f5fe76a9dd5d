#!/bin/bash
# One full GPU run: the bench on a quiet GPU, then the gpu test tier.
# Usage on the device: source .gpu/prelude.sh && bash tools/gpu_verify.sh   (logs under $OUT, else logs/)
# A kernel cache packed here by tools/pack_kernel_cache.sh (.gpu/kcache.tar.xz) is unpacked first, so the
# device compiles only what changed since. Env: T_BENCH, T_TEST (step limits, seconds), OPS (bench ops),
# BENCH_ARGS (extra bench flags, e.g. "--compare --warm-jobs 16"), GRID=1 (the whole grid, not only the --quick rows), TESTS (test paths, default the whole tier; "none" skips the tests; the
# knob-variant tests, which compile on the device, run second under T_KNOB_TEST with KNOB_WORKERS pytest workers
# unless SKIP_KNOB_TESTS=1; KNOB_ONLY=1 runs only them),
# PRECOMPILE=1 (compile every registered config missing from the cache first; T_COMPILE limits it),
# COMPILE_REF=1 (also time torch.compile of each reference: minutes of compiling),
# VARIANTS=FILE (after the bench: for each line "OPS|KNOBS", the bench of OPS again with TILEFUSE_KNOBS=KNOBS;
# pack those kernels first with VARIANTS=FILE bash tools/pack_kernel_cache.sh; T_VARIANT limits each; with
# MATCH=REGEX the bench and every variant run the grid cases the regex picks, and a side-by-side table of all
# runs closes the log).
set -o pipefail
OUT=${OUT:-logs}; mkdir -p "$OUT"
export TILELANG_CACHE_DIR=${TILELANG_CACHE_DIR:-/tmp/tlcache}
if [ -f .gpu/kcache.tar.xz ]; then
  mkdir -p "$TILELANG_CACHE_DIR/tilefuse" && tar -C "$TILELANG_CACHE_DIR/tilefuse" -xJf .gpu/kcache.tar.xz
  echo "kernel cache: $(ls "$TILELANG_CACHE_DIR/tilefuse" | wc -l) libraries"
fi
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; date -u +%FT%TZ
# the native launch extension (tilefuse._native) for this host's torch: built once, before anything times
python3 -c "import time; from tilefuse import _native as n; t = time.time(); m = n.module(); \
print('native launcher:', 'ready' if m else n.error(), '(%.1f s)' % (time.time() - t))" 2>&1 | tail -3 | tee "$OUT/native.log"
if [ -n "${PRECOMPILE:-}" ]; then  # compile what the packed cache lacks, 16 at a time
  timeout ${T_COMPILE:-300} python3 -m tilefuse precompile --jobs 16 2>&1 | grep -E "^compiled|^FAILED|^native" | tee "$OUT/precompile.log"
fi
if [ "${OPS:-}" != "none" ]; then
  timeout ${T_BENCH:-240} python3 -m tilefuse bench $([ -z "${GRID:-}${MATCH:-}" ] && echo --quick) ${OPS:+--ops $OPS} \
    ${MATCH:+--match "$MATCH"} \
    $([ -z "${COMPILE_REF:-}" ] && echo --no-compile-ref) \
    ${BENCH_ARGS:-} \
    --json "$OUT/bench.json" 2>&1 | tee "$OUT/bench.log" | tail -60
fi
if [ -n "${VARIANTS:-}" ]; then
  n=0
  while IFS='|' read -r vops vknobs; do
    case "$vops" in ''|'#'*) continue ;; esac
    n=$((n + 1)); echo "## variant $n: $vops | $vknobs" | tee -a "$OUT/variants.log"
    TILEFUSE_KNOBS="$vknobs" timeout ${T_VARIANT:-90} python3 -m tilefuse bench $([ -z "${MATCH:-}" ] && echo --quick) \
      --ops $vops ${MATCH:+--match "$MATCH" --warm-jobs 16} --no-compile-ref \
      --json "$OUT/variant-$n.json" 2>&1 | grep -E "^  " | tee -a "$OUT/variants.log"
  done < "$VARIANTS"
  python3 -m tilefuse bench --report "$OUT/bench.json" $(ls "$OUT"/variant-*.json | sort -V) --side-by-side \
    --markdown "$OUT/variants.md" > /dev/null && cat "$OUT/variants.md"
fi
if [ "${TESTS:-}" != "none" ]; then  # the knob-variant tests compile on the device: run them after the rest
  if [ -z "${KNOB_ONLY:-}" ]; then
    timeout ${T_TEST:-300} python3 -m pytest -m "gpu and not knobs" -n 8 -q -p no:randomly ${TESTS:-tests} 2>&1 \
      | tee "$OUT/gpu.log" | grep -E "passed|failed|FAILED|ERROR" | tail -40
  fi
  if [ -z "${SKIP_KNOB_TESTS:-}" ]; then
    timeout ${T_KNOB_TEST:-300} python3 -m pytest -m "gpu and knobs" -n ${KNOB_WORKERS:-8} -q -p no:randomly ${TESTS:-tests} 2>&1 \
      | tee "$OUT/gpu_knobs.log" | grep -E "passed|failed|FAILED|ERROR" | tail -20
  fi
fi
date -u +%FT%TZ
