#!/usr/bin/env bash
# Device run (the lent one-GPU machine): the roles themselves, through ansible-playbook, against the machine as
# one llmfleet node (ansible_connection local, inventory/device-h200): the fleet contract, preflight, base,
# topology, model_stage (a real stage of a checkpoint written on its disk, a second run that re-hashes every byte,
# then a byte flipped in the published weights found and repaired), the NCCL check on the GPU with the machine's torch, `llmfleet fit` against the real GPU memory, and the
# deployment report. Engine and acceptance do not run: the machine has no systemd for the engine's units and no
# engine (SGLang/vLLM) to serve; the script says so in its log.
#
# Usage on the device, from the repository root: bash tests/device/site_local.sh OUTDIR
# Only on a throwaway machine, as root: like a site, it creates the llmfleet account and writes /etc/llmfleet,
# /opt/llmfleet, /usr/local/bin/llmfleet, /var/lib/llmfleet and /var/tmp/llmfleet-device (removed first).
# Carried (git-ignored): .whl/ with ansible-core 2.19 and the dependencies the machine lacks (resolvelib,
# cryptography, cffi, pycparser; docs/measurements/device-runs/2026-12-04-h200x1-site/README.md has the download command).
# Exits 0 only when every step did what it must; OUTDIR gets the logs, the captured raw outputs and the reports.
set -uo pipefail
out=${1:?usage: site_local.sh OUTDIR}
mkdir -p "$out/raw"
root=$PWD
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # multicast stays off here
export PYTHONUNBUFFERED=1 ANSIBLE_NOCOLOR=1 ANSIBLE_FORCE_COLOR=0
py=${PYTHON:-$(command -v python3)}
work=/var/tmp/llmfleet-device
t0=$(date +%s)
fails=()
stamp() { echo "[$(($(date +%s) - t0))s] $*"; }
step() { # step NAME CMD...: run, log to OUTDIR/NAME.log, remember a failure
  local name=$1; shift
  stamp "$name: $*"
  "$@" >"$out/$name.log" 2>&1
  local rc=$?
  stamp "$name: rc=$rc"
  [ "$rc" -eq 0 ] || { fails+=("$name (rc $rc)"); tail -40 "$out/$name.log"; }
  return "$rc"
}

# 1. The machine as it is (each raw output later a unit-test fixture).
{
  echo "## date"; date -u +%FT%TZ
  echo "## uname"; uname -a
  echo "## os"; grep -E '^(PRETTY_NAME|VERSION_ID)=' /etc/os-release
  echo "## python"; "$py" -c 'import sys; print(sys.executable, sys.version)'
  echo "## python's path (the NCCL check's ranks run it as the engine's account)"; namei -l "$(readlink -f "$py")"
  ls -l /dev/nvidia* 2>&1
  echo "## pid1"; cat /proc/1/comm
  echo "## tools"; for t in systemctl sshd sudo ip iptables chronyc timedatectl numactl nvidia-smi useradd; do
    printf '%s: %s\n' "$t" "$(command -v "$t" || echo absent)"; done
  echo "## /run/systemd/system"; ls -d /run/systemd/system 2>&1
  echo "## hostname"; hostname; getent hosts "$(hostname)" || echo "(does not resolve)"
  echo "## machine-id"; cat /etc/machine-id 2>&1
  echo "## torch"; "$py" -c 'import torch; print(torch.__version__, torch.version.cuda, torch.cuda.nccl.version(), torch.cuda.device_count())'
  echo "## df"; df -h / /var/tmp
  echo "## nproc / mem"; nproc; grep -E 'MemTotal|MemAvailable' /proc/meminfo
} >"$out/machine.txt" 2>&1
nvidia-smi >"$out/raw/nvidia-smi.txt" 2>&1
nvidia-smi -q >"$out/raw/nvidia-smi-q.txt" 2>&1
nvidia-smi topo -m >"$out/raw/nvidia-smi-topo-m.txt" 2>&1
LC_ALL=C nvidia-smi --query-gpu="$("$py" -c 'import sys; sys.path.insert(0, "module_utils"); from llmfleet.checks.preflight import GPU_QUERY; print(GPU_QUERY)')" \
  --format=csv,noheader,nounits >"$out/raw/nvidia-smi-preflight-query.csv" 2>&1
LC_ALL=C nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits >"$out/raw/nvidia-smi-memory-total.csv" 2>&1
cat /proc/driver/nvidia/version >"$out/raw/proc-driver-nvidia-version.txt" 2>&1
# The GPU's sysfs attributes and PCI path as topology reads them (docs/topology.md), and NVML's view.
"$py" - >"$out/raw/sysfs-gpu.json" 2>&1 <<'PY'
import glob, json, os
out = {}
for d in sorted(glob.glob("/sys/bus/pci/devices/*")):
    def rd(a):
        try:
            with open(os.path.join(d, a)) as f:
                return f.read().strip()
        except OSError as e:
            return f"<{type(e).__name__}: {e.strerror}>"
    if rd("vendor") != "0x10de":
        continue
    out[os.path.basename(d)] = {"realpath": os.path.realpath(d), **{a: rd(a) for a in (
        "vendor", "device", "class", "numa_node", "local_cpulist", "current_link_speed", "current_link_width",
        "max_link_speed", "max_link_width")}}
out["/sys/devices/system/node"] = sorted(os.listdir("/sys/devices/system/node")) if os.path.isdir("/sys/devices/system/node") else None
out["/sys/class/infiniband"] = sorted(os.listdir("/sys/class/infiniband")) if os.path.isdir("/sys/class/infiniband") else None
out["/sys/class/net"] = sorted(os.listdir("/sys/class/net"))
print(json.dumps(out, indent=1))
PY
"$py" - >"$out/raw/nvml.json" 2>&1 <<'PY'
import json, pynvml
pynvml.nvmlInit()
res = {"driver": pynvml.nvmlSystemGetDriverVersion(), "cuda": pynvml.nvmlSystemGetCudaDriverVersion_v2(), "gpus": []}
for i in range(pynvml.nvmlDeviceGetCount()):
    h = pynvml.nvmlDeviceGetHandleByIndex(i)
    g = {}
    for name, fn in [("name", pynvml.nvmlDeviceGetName), ("uuid", pynvml.nvmlDeviceGetUUID),
                     ("pci", lambda h: pynvml.nvmlDeviceGetPciInfo(h).busId),
                     ("memory_total", lambda h: pynvml.nvmlDeviceGetMemoryInfo(h).total),
                     ("persistence", pynvml.nvmlDeviceGetPersistenceMode), ("mig", pynvml.nvmlDeviceGetMigMode),
                     ("ecc", pynvml.nvmlDeviceGetEccMode),
                     ("ecc_uncorrected_volatile", lambda h: pynvml.nvmlDeviceGetTotalEccErrors(h, 1, 0)),
                     ("numa", lambda h: pynvml.nvmlDeviceGetNumaNodeId(h)),
                     ("cpu_affinity", lambda h: list(pynvml.nvmlDeviceGetCpuAffinity(h, 4))),
                     ("retired_pending", lambda h: pynvml.nvmlDeviceGetRetiredPagesPendingStatus(h))]:
        try:
            v = fn(h)
            g[name] = v.decode() if isinstance(v, bytes) else v
        except Exception as e:  # what NVML refuses on this machine is itself a finding
            g[name] = f"<{type(e).__name__}: {e}>"
    res["gpus"].append(g)
print(json.dumps(res, indent=1, default=str))
PY
stamp "machine: $(grep -A1 '^## torch' "$out/machine.txt" | tail -1)"

# 2. Ansible from the carried wheels, on the machine's own Python (PyYAML, Jinja2 and MarkupSafe are there).
site=/tmp/llmfleet-ansible
step install "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl \
  || { echo "FAIL: cannot install ansible-core from .whl/"; exit 1; }
# The ops host side imports the llmfleet package (filter plugins, `python -m llmfleet report`): pip install -e
# on an ops host, the checkout's module_utils here.
export PYTHONPATH="$site:$root/module_utils" PATH="$site/bin:$PATH"
export ANSIBLE_CONFIG=$root/ansible.cfg ANSIBLE_ROLES_PATH=$root/roles ANSIBLE_HOME=/root/.ansible
"$py" -m ansible --version >>"$out/install.log" 2>&1 || true

# 3. The node's disks and the staging source: the deterministic Llama checkpoint (tests/helpers/det_model.py),
# large enough that staging moves real data (about 250 MB of bfloat16 safetensors).
rm -rf "$work" && mkdir -p "$work/nvme" "$work/shared" "$work/shared-rw" /var/lib/node_exporter/textfile_collector
step checkpoint "$py" -c '
import json, sys
sys.path.insert(0, "tests/helpers")
from det_model import write_det_model
info = write_det_model(sys.argv[1], hidden_size=1024, intermediate_size=4096, num_hidden_layers=8,
                       num_attention_heads=16, num_key_value_heads=4)
print(json.dumps({k: info[k] for k in ("dir", "files", "params")}))' "$work/shared/det-llama" || exit 1

# 4. The inventory's one host: the machine's own name when it resolves to an address of this machine, else
# localhost (preflight checks that every node name resolves to its fabric IP).
read -r node ip < <("$py" - <<'PY'
import socket
name = socket.gethostname()
try:
    ip = socket.gethostbyname(name)
    with socket.socket() as s:
        s.bind((ip, 0))  # an address of this machine
except OSError:
    name, ip = "localhost", "127.0.0.1"
print(name, ip)
PY
)
cat >inventory/device-h200/hosts.yml <<EOF
# Written by tests/device/site_local.sh on $(date -u +%FT%TZ).
all:
  children:
    llmfleet_nodes:
      children:
        head:
          hosts:
            $node:
              llmfleet_fabric_ip: $ip
EOF
stamp "node $node, fabric IP $ip"

# 5. site.yml as an operator runs it; the engine and acceptance plays are left out (see the header).
play() { "$py" -m ansible playbook -i inventory/device-h200 "$@"; }
echo "skipped: tags engine, acceptance (no systemd on this machine for the engine's units; no SGLang/vLLM here)" \
  >"$out/skipped.txt"
step site play playbooks/site.yml --skip-tags engine,acceptance -v

# 6. Again: nothing may change, and every staged byte is hashed again (model_stage_deep_verify).
step site-again play playbooks/site.yml --skip-tags engine,acceptance,nccl_check -e model_stage_deep_verify=true
if ! grep -qE ' : ok=[0-9]+ +changed=0 ' "$out/site-again.log"; then
  fails+=("site-again (a second run changed something)"); grep -E '^changed:' -B3 "$out/site-again.log" | head -30
fi

# 6b. A byte of the published weights flipped on disk (a disk or filesystem fault): the staging play with
# model_stage_deep_verify must find it and repair the revision, whose file then matches the source again.
model=$(readlink -f "$work/nvme/models/det-llama/current")
want=$(sha256sum "$work/shared/det-llama/model.safetensors" | cut -d' ' -f1)
"$py" -c 'import sys; f = open(sys.argv[1], "r+b"); f.seek(1 << 20); b = f.read(1); f.seek(1 << 20); f.write(bytes([b[0] ^ 1]))' \
  "$model/model.safetensors"
step stage-repair play playbooks/model_stage.yml -e model_stage_deep_verify=true
model=$(readlink -f "$work/nvme/models/det-llama/current")
got=$(sha256sum "$model/model.safetensors" | cut -d' ' -f1)
stamp "after the repair: model.safetensors sha256 $got, source $want"
grep -qE ' : ok=[0-9]+ +changed=[1-9]' "$out/stage-repair.log" || fails+=("stage-repair (no change reported)")
[ "$got" = "$want" ] || fails+=("stage-repair (the staged file still differs from the source)")

# 7. llmfleet fit on the staged revision, against the GPU's real memory (nvidia-smi memory.total), with the CLI
# the base role installed.
step fit-vllm /usr/local/bin/llmfleet fit "$model" --engine vllm --tp 1 --max-model-len 2048 --max-seqs 64 --json
step fit-sglang /usr/local/bin/llmfleet fit "$model" --engine sglang --tp 1 --mem-fraction 0.85 --max-model-len 2048
# One request of 20M tokens (152 GiB of KV) no H200 holds: fit must say no (exit 1) from the same memory figure.
/usr/local/bin/llmfleet fit "$model" --engine vllm --tp 1 --max-model-len 20000000 >"$out/fit-too-big.log" 2>&1
rc=$?; stamp "fit-too-big: rc=$rc (1 = does not fit)"; [ "$rc" -eq 1 ] || fails+=("fit-too-big (rc $rc, not 1)")

# 8. What came back: the reports (HTML, md, JSON, records), the node's files, the metrics.
cp -a "$work/nvme/models" "$out/raw/models-tree" 2>/dev/null; rm -f "$out"/raw/models-tree/*/*/*.safetensors
{
  echo "## /etc/llmfleet"; ls -la /etc/llmfleet; echo "## fabric.env"; cat /etc/llmfleet/fabric.env
  echo "## /opt/llmfleet/lib"; ls -la /opt/llmfleet/lib; echo "## /var/lib/llmfleet"; ls -laR /var/lib/llmfleet | head -60
  echo "## staged"; ls -laR "$work/nvme/models" | head -60
  echo "## metrics"; ls -la /var/lib/node_exporter/textfile_collector; cat /var/lib/node_exporter/textfile_collector/*.prom
  echo "## id llmfleet"; id llmfleet
} >"$out/node-files.txt" 2>&1
cp -a "$root/reports" "$out/reports"
stamp "done; failed steps: ${#fails[@]} ${fails[*]:-}"
[ "${#fails[@]}" -eq 0 ]
