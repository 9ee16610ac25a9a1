"""The NCCL check's chained phases on a GPU: two "nodes" (run_node_worlds in two threads, both on GPU 0 over
NCCL's socket transport, as the cross-node path runs there), each a single-node world of one rank and then
its rank of a two-rank world forked from the same import of torch. Every op and size exact, the deadline
agreed from both nodes' phase-1 walls, a corrupt rank of the second world named, and a rank whose head gives no TCP
answer named after --unreachable-after (docs/measurements/device-runs/*chained*).

    python3 tests/device/chained_check.py      (on the device machine; OUT=dir keeps chained.json)
"""

import json
import math
import os
import sys
import threading
import time

sys.path.insert(0, "module_utils")
from llmfleet.checks import nccl_check

out = os.environ.get("OUT", "/tmp")
# Two ranks on one GPU: NCCL's socket transport (no P2P/SHM between "nodes"), as on a fabric without RDMA;
# each "node" its own NCCL_HOSTID (spec env), so NCCL treats them as two hosts, not a duplicate GPU.
os.environ.update(NCCL_P2P_DISABLE="1", NCCL_SHM_DISABLE="1", NCCL_SOCKET_IFNAME="lo")
ARGS = ["--backend", "nccl", "--sizes", "8,64K,1M,64M", "--iters", "10", "--warmup", "3", "--timeout", "60",
        "--op-timeout", "60"]  # fmt: skip


def run(corrupt: int) -> dict:
    port = nccl_check.free_port()
    got: dict = {}

    def node(i: int) -> None:
        spec = {"python": sys.executable, "pythonpath": os.path.abspath("module_utils"), "world": 1,
                "master": "127.0.0.1", "port": nccl_check.free_port(), "deadline": 300, "ranks": [[0, 0]],
                "env": {"NCCL_HOSTID": f"llmfleet-node-{i}"},
                "args": ARGS,
                "then": {"world": 2, "master": "127.0.0.1", "port": port, "ranks": [[i, 0]], "deadline": 300,
                         "hosts": ["127.0.0.1", "127.0.0.1"], "deadline_factor": 3,
                         "args": ["--corrupt-rank", str(corrupt)]}}  # fmt: skip
        got[i] = nccl_check.run_node_worlds(spec)

    t0 = time.monotonic()
    ts = [threading.Thread(target=node, args=(i,)) for i in (0, 1)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(900)
    wall = round(time.monotonic() - t0, 1)
    singles = [got[i][0][0] for i in (0, 1)]
    fulls = [got[i][1][0] for i in (0, 1)]
    want = min(300, math.ceil(max(r["wall_s"] for r in singles) * 3 + 60))
    print(f"corrupt={corrupt}: {wall} s; phase 1 ok {[r['ok'] for r in singles]} walls {[r['wall_s'] for r in singles]}; "
          f"phase 2 ok {[r['ok'] for r in fulls]} culprits {[r.get('culprit_ranks') for r in fulls]} "
          f"deadline {[r.get('deadline_s') for r in fulls]} (want {want}); same process "
          f"{[s['forked_from'] == f['forked_from'] for s, f in zip(singles, fulls, strict=True)]}; "
          f"errors {[r.get('error') for r in singles + fulls if r.get('error')]}")  # fmt: skip
    wrong = [
        (x["op"], x["dtype"], x["bytes"], x["wrong"]) for r in fulls for x in r.get("results", []) if x.get("wrong")
    ]
    print("  wrong:", wrong[:8])
    return {"wall": wall, "want_deadline": want, "single": singles, "full": fulls}


def silent_head() -> dict:
    """A rank whose head gives no TCP answer at all (a listener with a full accept queue drops every SYN, as a
    downed fabric does) names it after --unreachable-after, not at the rendezvous timeout (60 s here)."""
    import socket

    with socket.socket() as full, socket.socket() as filler:
        full.bind(("127.0.0.2", 0))
        full.listen(0)
        filler.connect(full.getsockname())
        ip, port = full.getsockname()
        spec = {"python": sys.executable, "pythonpath": os.path.abspath("module_utils"), "world": 2, "master": ip,
                "port": port, "deadline": 120, "ranks": [[1, 0]], "env": {"NCCL_HOSTID": "llmfleet-node-1"},
                "args": [*ARGS, "--unreachable-after", "3"]}  # fmt: skip
        t0 = time.monotonic()
        (r,) = nccl_check.run_node_ranks(spec)
    print(f"silent head: {time.monotonic() - t0:.1f} s; exit {r['exit']}, store_unreachable "
          f"{r.get('store_unreachable')}: {r.get('error')}")  # fmt: skip
    return r


res = {"healthy": run(-1), "corrupt_rank_1": run(1), "silent_head": silent_head()}
json.dump(res, open(os.path.join(out, "chained.json"), "w"), indent=1)
