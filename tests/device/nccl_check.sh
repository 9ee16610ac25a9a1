#!/usr/bin/env bash
# Device run (GPU machine): the NCCL check with NCCL, one rank per GPU, values checked,
# full size sweep, PyTorch's own all_reduce timing side by side, then a rank that corrupts its buffer.
# Usage on the device: bash tests/device/nccl_check.sh OUTDIR
set -uo pipefail
out=${1:?usage: nccl_check.sh OUTDIR}
mkdir -p "$out"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # multicast stays off here
export PYTHONPATH="$PWD/module_utils${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
n=$($py -c 'import torch; print(torch.cuda.device_count())')
echo "GPUs: $n; torch $($py -c 'import torch; print(torch.__version__, torch.cuda.nccl.version())')"
$py -m llmfleet.nccl_check local --nproc "$n" --backend nccl ${SIZES:+--sizes "$SIZES"} --iters 20 --warmup 5 \
  --reference --deadline 500 >"$out/nccl_check-nccl.json"
echo "sweep rc=$?"
$py -m llmfleet.nccl_check local --nproc "$n" --backend nccl --sizes 1K,64M --iters 5 --warmup 2 \
  --corrupt-rank $((n - 1)) --deadline 200 >"$out/nccl_check-nccl-corrupt.json"
echo "corrupt rc=$? (1 expected)"
$py - "$out" <<'PY'
import json, sys
out = sys.argv[1]
d = json.load(open(f"{out}/nccl_check-nccl.json"))
print(d["verdict"])
r0 = d["ranks"][0]
print(f"{'op':<11}{'dtype':<6}{'bytes':>12}{'time_us':>11}{'busbw':>9}{'ref_busbw':>11}{'ratio':>7}{'wrong':>7}")
for x in r0.get("results", []):
    if "skipped" in x:
        continue
    ratio = (x["busbw_GBps"] / x["ref_busbw_GBps"]) if x.get("ref_busbw_GBps") else None
    print(f"{x['op']:<11}{x['dtype']:<6}{x['bytes']:>12}{x['time_us']:>11}{x['busbw_GBps']:>9}"
          f"{x.get('ref_busbw_GBps', ''):>11}{'' if ratio is None else f'{ratio:.2f}':>7}{x['wrong']:>7}")
c = json.load(open(f"{out}/nccl_check-nccl-corrupt.json"))
print("corrupt:", c["verdict"], "culprits", c["culprit_ranks"])
PY
