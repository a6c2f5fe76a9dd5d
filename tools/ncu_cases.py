"""Run chosen bench rows once each inside a CUDA profiler range, for Nsight Compute.

Usage on the device (``source .gpu/prelude.sh`` first):
  ncu --clock-control none --profile-from-start off --set full -o $OUT/prof \
      python3 tools/ncu_cases.py [--peer tk2] OP[:SHAPE_SUBSTRING] ... grid:OP:REGEX ...
``grid:OP:REGEX`` picks every grid case of OP whose label the regex finds (``bench --list --match``).
``OP[:SHAPE_SUBSTRING]`` picks the ``--quick`` rows of OP whose label contains the substring.
``--peer P`` also calls each picked case on peer P (``tilefuse.bench.peers``), right after ours, so both
implementations' kernels sit side by side in the report. Every selected case is built and called twice first
(kernel loads, allocator warm-up), outside the range; then each is called once inside it, so ncu sees exactly
one launch of each kernel of each case.
"""
import sys

import torch

from tilefuse.bench.runner import _peer_fn, case_label, select_cases


def main(argv: list[str]) -> int:
    peer = None
    if argv[:1] == ["--peer"]:
        peer, argv = argv[1], argv[2:]
    wanted = [a.partition(":") for a in argv if not a.startswith("grid:")]
    picked = []
    for case in select_cases(True, None):
        if any(case.name == name and shape in case_label(case) for name, _, shape in wanted):
            label, inputs = case.make("cuda", 1.0)
            picked.append((case, label, inputs))
    for a in argv:
        if a.startswith("grid:"):
            _, op, regex = a.split(":", 2)
            for case in select_cases(False, [op], match=regex):
                label, inputs = case.make("cuda", 1.0)
                picked.append((case, label, inputs))
    calls = []
    for case, label, inputs in picked:
        calls.append((f"{case.name} | {label}", case.run, inputs))
        fn = _peer_fn(case, peer) if peer else None
        if fn is not None:
            calls.append((f"{peer}: {case.name} | {label}", fn, inputs))
    for _, fn, inputs in calls:
        fn(*inputs)
        fn(*inputs)
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    for name, fn, inputs in calls:
        print(f"profiling {name}", flush=True)
        fn(*inputs)
        torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
