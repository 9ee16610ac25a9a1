#!/usr/bin/env bash
# Device run (GPU machine): a deployment's GPUs named by UUID (llmfleet_gpus) resolve through NVML to the index
# CUDA sees under CUDA_DEVICE_ORDER=PCI_BUS_ID, and the NCCL check's ranks run on exactly those GPUs.
# Usage on the device: bash tests/device/gpuset.sh OUTDIR
set -uo pipefail
out=${1:?usage: gpuset.sh OUTDIR}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH="$PWD/module_utils${PYTHONPATH:+:$PYTHONPATH}"
py=${PYTHON:-python3}
$py - "$out" <<'PY' 2>&1 | tee "$out/gpuset.txt"
import json, os, subprocess, sys
from llmfleet.checks import topology
from llmfleet.engine import gpuset
from llmfleet.checks.nccl_check import run_node_ranks, visible_env

out = sys.argv[1]
topo = topology.discover("/sys", use_nvml=True)
gpus = topo["gpus"]
print("NVML GPUs:", [(g["index"], g["bdf"], g.get("uuid"), g.get("numa_node")) for g in gpus])
last = gpus[-1]
s = gpuset.resolve([last["uuid"]], len(gpus), gpus, 1)
print("llmfleet_gpus: [%s] ->" % last["uuid"], s)
env = {**os.environ, **visible_env(s["visible"])}
code = "import torch; p = torch.cuda.get_device_properties(0); print(torch.cuda.device_count(), str(p.uuid), p.pci_bus_id)"
seen = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout.split()
print("CUDA under", visible_env(s["visible"]), "sees", seen)
assert seen[0] == "1", seen
assert last["uuid"].removeprefix("GPU-") == seen[1].removeprefix("GPU-"), (last["uuid"], seen)
spec = {"python": sys.executable, "pythonpath": os.environ["PYTHONPATH"], "world": 1, "master": "127.0.0.1",
        "port": 29731, "ranks": [[0, 0]], "deadline": 120, "numa_nodes": s["numa_nodes"],
        "env": visible_env(s["visible"]),
        "args": ["--backend", "nccl", "--ops", "all_reduce,all_gather", "--sizes", "8,1M", "--iters", "3"]}
ranks = run_node_ranks(spec)
for r in ranks:
    print("rank", r.get("rank"), "ok", r.get("ok"), "gpu", r.get("gpu"), "errors", r.get("error") or r.get("culprits"))
json.dump({"gpus": gpus, "resolved": s, "cuda_sees": seen, "ranks": ranks}, open(f"{out}/gpuset.json", "w"), indent=1,
          default=str)
assert all(r.get("ok") for r in ranks) and ranks[0]["gpu"] == s["visible"], ranks
print("GPUSET OK")
PY
echo "rc=${PIPESTATUS[0]}"
