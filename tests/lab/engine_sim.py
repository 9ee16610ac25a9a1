#!/usr/bin/env python3
"""Launcher of the llmfleet ENGINE SIMULATOR, the package engine_sim/ next to this file (see its docstring
and docs/engine-simulator.md).

    engine_sim.py sglang serve --model-path DIR [...]      (tests/lab/sim-bin/sglang)
    engine_sim.py vllm serve DIR [...]                     (tests/lab/sim-bin/vllm)
    engine_sim.py _rank -                                  (internal: one rank, config JSON on stdin)

Every simulator process runs this file (the node main process re-execs it for each rank), so
`pgrep -f engine_sim.py` finds them all (tests/integration/test_engine.py, bench/engine_bench.py).
Stdlib only until a rank imports torch; it runs from wherever the checkout is (read-only on lab nodes).
"""

import sys
from pathlib import Path

if __name__ == "__main__":
    # This directory first, whatever sys.path[0] is (python -P, PYTHONSAFEPATH): `engine_sim` is then the
    # package next to this file (a package directory wins over a module of the same name).
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from engine_sim import main

    sys.exit(main())
