"""Run chosen bench rows once each inside a CUDA profiler range, for Nsight Compute.

Usage on the device (``source .gpu/prelude.sh`` first):
  ncu --clock-control none --profile-from-start off --set full -o $OUT/prof \
      python3 tools/ncu_cases.py OP[:SHAPE_SUBSTRING] ...
Every selected case is built and called twice first (kernel loads, allocator warm-up), outside the range;
then each is called once inside it, so ncu sees exactly one launch of each kernel of each case.
"""
import sys

import torch

from tilefuse import bench


def main(argv: list[str]) -> int:
    wanted = [a.partition(":") for a in argv]
    picked = []
    for case in bench._cases():
        for name, _, shape in wanted:
            if case.name == name:
                label, inputs = case.make("cuda", 1.0)
                if shape in label:
                    picked.append((case, label, inputs))
                    break
    for case, label, inputs in picked:
        case.run(*inputs)
        case.run(*inputs)
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    for case, label, inputs in picked:
        print(f"profiling {case.name} | {label}", flush=True)
        case.run(*inputs)
        torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
