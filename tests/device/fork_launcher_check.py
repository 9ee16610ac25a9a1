"""The NCCL check's launcher on a GPU: run_node_ranks (one import of torch per NUMA node, ranks forked from it),
bound and unbound, every op and size exact, and an injected transit fault caught (docs/measurements/device-runs/*fork-launcher*).

    python3 tests/device/fork_launcher_check.py      (on the device machine; OUT=dir keeps fork.json)
"""

import json
import os
import sys
import time

sys.path.insert(0, "module_utils")
from llmfleet.checks import nccl_check

out = os.environ.get("OUT", "/tmp")
res = {}
for numa in ([0], []):
    spec = {
        "python": sys.executable,
        "pythonpath": os.path.abspath("module_utils"),
        "world": 1,
        "master": "127.0.0.1",
        "port": nccl_check.free_port(),
        "deadline": 300,
        "ranks": [[0, 0]],
        "numa_nodes": numa,
        "args": ["--backend", "nccl", "--sizes", "8,64K,1M,64M,1G", "--iters", "20", "--warmup", "5"],
    }
    t0 = time.monotonic()
    r = nccl_check.run_node_ranks(spec)
    res[f"numa={numa}"] = {"wall": round(time.monotonic() - t0, 1), "ranks": r}
    print(
        numa,
        round(time.monotonic() - t0, 1),
        "s",
        r[0].get("ok"),
        r[0].get("error"),
        r[0].get("forked_from"),
        [
            (x["op"], x["bytes"], x.get("time_us"), x.get("wrong"), x.get("timing"))
            for x in r[0].get("results", [])
            if "skipped" not in x
        ][:14],
    )
# A wrong contribution is still caught on the GPU with the repeated-period expected values.
spec["args"] = spec["args"] + ["--corrupt-transit", "0:0"]
r = nccl_check.run_node_ranks({**spec, "port": nccl_check.free_port()})
print(
    "transit",
    r[0].get("ok"),
    [(x["op"], x["bytes"], x["wrong"]) for x in r[0].get("results", []) if x.get("wrong")][:8],
)
json.dump(res, open(os.path.join(out, "fork.json"), "w"), indent=1)
