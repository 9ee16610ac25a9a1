#!/usr/bin/env bash
# Device run (GPU machine): topology discovery for real - NVML, sysfs fallback, nvidia-smi topo -m.
# Usage on the device: bash tests/device/topology.sh OUTDIR
set -uo pipefail
out=${1:?usage: topology.sh OUTDIR}
mkdir -p "$out"
# NVLink multicast stays off on shared machines (and in what llmfleet renders there).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH="$PWD/module_utils${PYTHONPATH:+:$PYTHONPATH}"
py=${PYTHON:-python3}
ip=$($py -c 'import socket; s=socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.connect(("10.255.255.255", 1)); print(s.getsockname()[0])' 2>/dev/null || echo 127.0.0.1)
{
  echo "## uname"; uname -a
  echo "## nvidia-smi"; nvidia-smi
  echo "## nvidia-smi -q (pci, numa)"; nvidia-smi -q | grep -iE "Bus Id|NUMA|Product Name|Persistence|MIG Mode" | head -40
  echo "## python"; $py -c 'import sys, pynvml; print(sys.version); print("nvidia-ml-py", pynvml.__version__ if hasattr(pynvml, "__version__") else "?")'
  echo "## sysfs GPUs"
  for d in /sys/bus/pci/devices/*; do
    if [ "$(cat "$d/vendor")" = 0x10de ]; then echo "$(basename "$d") class=$(cat "$d/class") numa=$(cat "$d/numa_node") cpus=$(cat "$d/local_cpulist" 2>/dev/null) -> $(readlink -f "$d")"; fi
  done
  echo "## infiniband"; ls -l /sys/class/infiniband 2>&1
  echo "## net"; ls -l /sys/class/net
  echo "## fabric ip guess: $ip"
} >"$out/machine.txt" 2>&1
nvidia-smi topo -m >"$out/nvidia-smi-topo-m.txt" 2>&1
$py -m llmfleet topology --node-ip "$ip" --override NCCL_NVLS_ENABLE=0 --json >"$out/topology-nvml.json" 2>"$out/topology-nvml.err"
echo "nvml rc=$?"
$py -m llmfleet topology --node-ip "$ip" --no-nvml --json >"$out/topology-sysfs.json" 2>"$out/topology-sysfs.err"
echo "sysfs rc=$?"
$py -m llmfleet topology --node-ip "$ip" --override NCCL_NVLS_ENABLE=0 >"$out/topology.txt" 2>&1
echo "text rc=$?"
$py - "$out" <<'PY'
import json, sys
out = sys.argv[1]
a = json.load(open(f"{out}/topology-nvml.json"))
b = json.load(open(f"{out}/topology-sysfs.json"))
for g in a["topology"]["gpus"]:
    print("nvml GPU", g["index"], g["bdf"], g.get("model"), g.get("memory_bytes"), "numa", g["numa_node"], "via", g.get("numa_source"), "nvlinks", g.get("nvlinks"))
print("sysfs GPUs", [(g["index"], g["bdf"], g["numa_node"]) for g in b["topology"]["gpus"]])
print("same order", [g["bdf"] for g in a["topology"]["gpus"]] == [g["bdf"] for g in b["topology"]["gpus"]])
print("env", json.dumps(a["env"], sort_keys=True))
print("warnings", a["warnings"])
PY
cat "$out/topology.txt"
