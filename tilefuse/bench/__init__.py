"""The bench: ``python -m tilefuse bench`` (DESIGN.md, Benchmarks; docs/BENCHMARKS.md). Only the command line
imports it; the runtime never does.

Modules, arrows pointing one way (each imports only those below it):

- ``cli``: the command line (``main``); parses and checks the arguments, prints the tables;
- ``runner``: which cases run (``AREAS``, ``select_cases``), how each is measured, ``--list``, the kernel configs
  the cases launch (``bench_configs``); ``report``: the tables; ``extras``: host overhead, cold start, tile sweep;
- the case modules, one per area: ``quant``, ``transpose``, ``moe`` (``OPS``, ``quick_cases()``, ``grid_cases()``);
- ``peers``: the other implementations and the rules by which their outputs agree with ours;
- ``core``: the case type, the bytes a case moves, the timers, the copy ceiling, the input helpers.
"""
