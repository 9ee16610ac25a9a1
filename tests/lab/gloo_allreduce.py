#!/usr/bin/env python3
"""One rank of a gloo all_reduce across lab nodes (a minimal probe, not the NCCL checker):

    gloo_allreduce.py RANK WORLD MASTER_IP [PORT] [TIMEOUT_S]

Prints a JSON line and exits 0 when the reduced values are exact, 1 when wrong, 2 on an error gloo raised
(its timeout included), 3 when the probe's own deadline (TIMEOUT_S + 5 s after the process group's start) ends a
rank that gloo left hanging: rank 0 of a world whose addresses are wrong waits in gloo's connect past the process
group's timeout. Ends with os._exit so a broken process group cannot block interpreter exit.
"""

import datetime
import json
import os
import sys
import threading

import torch
import torch.distributed as dist

rank, world, master = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
port = int(sys.argv[4]) if len(sys.argv) > 4 else 29512
timeout = float(sys.argv[5]) if len(sys.argv) > 5 else 15
out = {"rank": rank, "world": world, "gloo_socket_ifname": os.environ.get("GLOO_SOCKET_IFNAME")}


def deadline_passed():
    # No "error" key: that is for what gloo itself raised (molecule's topology verify tells the two apart).
    out.update(ok=False, deadline=f"no result {timeout + 5:.0f} s after the process group's start")
    print(json.dumps(out), flush=True)
    os._exit(3)


watchdog = threading.Timer(timeout + 5, deadline_passed)
watchdog.daemon = True
watchdog.start()
try:
    dist.init_process_group(
        "gloo", init_method=f"tcp://{master}:{port}", rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=timeout),
    )  # fmt: skip
    t = torch.full((1024,), float(rank + 1))
    dist.all_reduce(t)
    want = world * (world + 1) / 2
    out.update(ok=bool((t == want).all()), value=float(t[0]), expected=want)
    print(json.dumps(out), flush=True)
    os._exit(0 if out["ok"] else 1)
except Exception as e:  # report and exit non-zero, whatever gloo raised
    out.update(ok=False, error=f"{type(e).__name__}: {str(e)[:300]}")
    print(json.dumps(out), flush=True)
    os._exit(2)
