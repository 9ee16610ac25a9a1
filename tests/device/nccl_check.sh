#!/usr/bin/env bash
# Device run (GPU machine): the NCCL check side by side with nccl-tests built against torch's own NCCL
# (same sizes, same processes per GPU, both timed back to back; the check still compares every element
# of its results, outside the timed loop), the cross-node code path over NCCL's socket transport with
# the fabric env the topology code renders there, and fault injection (a corrupting rank, data damaged
# in transit, a rank that never starts). Any number of GPUs: with one, the single-node world has one
# rank, and the two cross-node "nodes" share the GPU under two NCCL_HOSTIDs.
#
# Usage on the device: bash tests/device/nccl_check.sh OUTDIR
# Carried (git-ignored): bench/device/build/nccl-tests-mpi.tar.xz (bench/device/build_nccl_tests.sh) and
# bench/device/build/nccl-tests-src (rebuilt there, single-process only, when the carried binaries fail).
set -uo pipefail
out=${1:?usage: nccl_check.sh OUTDIR}
mkdir -p "$out/nccl-tests" "$out/socket/nccl-tests"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # multicast stays off here
export PYTHONPATH="$PWD/module_utils${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
build=$PWD/bench/device/build
t0=$(date +%s)
stamp() { echo "[$(($(date +%s) - t0))s] $*"; }
verdict() { $py -c 'import json,sys; d=json.load(open(sys.argv[1])); print(d["verdict"], d["ranks"][0].get("graph_error", ""))' "$1" 2>&1 | tail -1; }

n=$($py -c 'import torch; print(torch.cuda.device_count())')
# torch's own NCCL (what an engine on this Python loads): headers and library of the nvidia-nccl wheel
nccl=$($py - <<'PY'
import glob, os, site, sys
for d in site.getsitepackages() + [site.getusersitepackages()]:
    for h in glob.glob(os.path.join(d, "nvidia", "nccl*", "include", "nccl.h")):
        print(os.path.dirname(os.path.dirname(h))); sys.exit()
PY
)
cuda=$(ls -d /usr/local/cuda-13.0 /usr/local/cuda 2>/dev/null | head -1)
tools=/tmp/nccl-tests
mkdir -p "$tools" && tar xJf "$build/nccl-tests-mpi.tar.xz" -C "$tools"
export PATH="$tools/mpich/bin:$PATH"
export LD_LIBRARY_PATH="$nccl/lib:$tools/mpich/lib:$cuda/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
{
  echo "## GPUs: $n"; nvidia-smi -L; nvidia-smi topo -m 2>&1
  $py -c 'import torch; print("torch", torch.__version__, "NCCL", torch.cuda.nccl.version())'
  echo "## torch's NCCL: $nccl"; ls -l "$nccl/lib"; grep -m3 -E "define NCCL_(MAJOR|MINOR|PATCH)" "$nccl/include/nccl.h"
  echo "## nvcc: $cuda"; "$cuda/bin/nvcc" --version | tail -2
  echo "## nccl-tests: $(cat "$build/nccl-tests-src/COMMIT" 2>/dev/null)"; ldd "$tools/bin/all_reduce_perf_mpi"
} >"$out/machine.txt" 2>&1
stamp "GPUs $n, NCCL from $nccl"

# One nccl-tests rank under mpiexec; ranks that share one GPU look like two hosts to NCCL (as cross_node.py does).
cat >/tmp/nt-rank.sh <<'EOF'
#!/bin/sh
[ -n "${NT_SHARE_GPU:-}" ] && export NCCL_HOSTID="llmfleet-node-$PMI_RANK" NCCL_TESTS_DEVICE=0
exec "$@"
EOF
chmod +x /tmp/nt-rank.sh
bin=$tools/bin sfx=_mpi
if ! timeout 60 mpiexec -n 1 /tmp/nt-rank.sh "$bin/all_reduce_perf_mpi" -b 8 -e 8 -g 1 -n 1 -w 0 >"$out/nccl-tests/probe.txt" 2>&1; then
  stamp "carried nccl-tests do not run here: building from source (single process, -g $n)"
  bin=/tmp/nccl-tests-build sfx=
  mkdir -p /tmp/ncclhome/lib && ln -sfn "$nccl/include" /tmp/ncclhome/include
  ln -sf "$nccl/lib/libnccl.so.2" /tmp/ncclhome/lib/libnccl.so
  (make -C "$build/nccl-tests-src/src" -j"$(nproc)" MPI=0 NCCL_HOME=/tmp/ncclhome CUDA_HOME="$cuda" \
    NVCC_GENCODE="-gencode=arch=compute_90,code=sm_90" BUILDDIR="$bin" \
    "$bin/all_reduce_perf" "$bin/broadcast_perf" "$bin/all_gather_perf" "$bin/sendrecv_perf" >"$out/build.log" 2>&1
   echo "build rc=$?" >>"$out/build.log") &
  building=$!
fi
# nt NPROC OUTFILE OP ARGS...: nccl-tests with NPROC processes of one GPU each (or one process, -g n, when rebuilt)
nt() {
  local np=$1 f=$2 op=$3; shift 3
  if [ -n "$sfx" ]; then timeout 150 mpiexec -n "$np" /tmp/nt-rank.sh "$bin/${op}_perf$sfx" -g 1 "$@" >"$f" 2>&1
  else timeout 150 "$bin/${op}_perf" -g "$np" "$@" >"$f" 2>&1; fi
}

# 1. The cross-node code path (2 ranks, socket transport); the CPU-only build above may run meanwhile.
stamp "cross-node path"
timeout 400 $py bench/device/cross_node.py --out "$out/cross-node" >"$out/cross-node.txt" 2>&1
stamp "cross-node rc=$? (0 = every scenario as expected)"; cat "$out/cross-node.txt"
[ -n "${building:-}" ] && { wait "$building"; stamp "$(tail -1 "$out/build.log")"; }

# 2. One node, one rank per GPU: nccl-tests eager (its default) and one CUDA graph per timed loop (-G 1).
for op in all_reduce broadcast all_gather sendrecv; do
  lo=8 hi=1073741824
  [ "$op" = all_gather ] && lo=$((8 * n)) hi=$((1073741824 * n))  # nccl-tests' all_gather size is the output
  for dt in float bfloat16; do
    nt "$n" "$out/nccl-tests/$op-$dt-eager.txt" $op -b $lo -e $hi -f 2 -w 5 -n 20 -d $dt
    nt "$n" "$out/nccl-tests/$op-$dt-graph.txt" $op -b $lo -e $hi -f 2 -w 5 -n 20 -d $dt -G 1
    stamp "nccl-tests $op $dt rc=$? $(grep -h 'Avg bus' "$out/nccl-tests/$op-$dt-eager.txt")"
  done
done
sizes=$($py -c 'print(",".join(str(2**k) for k in range(3, 31)))')
for timing in auto eager; do
  timeout 500 $py -m llmfleet.checks.nccl_check local --nproc "$n" --backend nccl --sizes "$sizes" --iters 20 --warmup 5 \
    --reps 3 --timing $timing --reference --deadline 450 >"$out/check-$timing.json" 2>"$out/check-$timing.err"
  stamp "check ($timing timing) rc=$? $(verdict "$out/check-$timing.json")"
done

# 3. Faults inside one node: a rank whose buffer is wrong, data damaged after it arrived.
timeout 200 $py -m llmfleet.checks.nccl_check local --nproc "$n" --backend nccl --sizes 1K,64M --iters 5 --warmup 2 \
  --corrupt-rank $((n - 1)) --deadline 180 >"$out/check-corrupt-rank.json" 2>&1
stamp "corrupt rank $((n - 1)) rc=$? (1 expected): $(verdict "$out/check-corrupt-rank.json")"
if [ "$n" -ge 2 ]; then
  timeout 200 $py -m llmfleet.checks.nccl_check local --nproc "$n" --backend nccl --sizes 1K,64M --iters 5 --warmup 2 \
    --corrupt-transit 1:0 --deadline 180 >"$out/check-transit.json" 2>&1
  stamp "transit 0->1 rc=$? (1 expected): $(verdict "$out/check-transit.json")"
fi
$py bench/device/nccl_compare.py --nccl-tests "$out/nccl-tests" --ours "$out/check-auto.json" \
  --ours-eager "$out/check-eager.json" --out "$out/compare.md" >/dev/null
stamp "compare (one node) rc=$? (0 = every goal met)"; grep -E "^- " "$out/compare.md"

# 4. Two ranks over NCCL's socket transport (the cross-node path), fp32, both tools: eager, then graphs.
if [ -n "$sfx" ]; then
  (
    eval "$($py -c 'import json,shlex,sys; e=json.load(open(sys.argv[1]))["env"]; print(" ".join(f"export {k}={shlex.quote(v)};" for k, v in e.items()))' "$out/cross-node/topology.json")"
    export NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1
    [ "$n" -lt 2 ] && export NT_SHARE_GPU=1
    for op in all_reduce broadcast all_gather sendrecv; do
      lo=8 hi=67108864; [ "$op" = all_gather ] && lo=16 hi=134217728
      nt 2 "$out/socket/nccl-tests/$op-float-eager.txt" $op -b $lo -e $hi -f 2 -w 5 -n 20 -d float
      stamp "socket nccl-tests $op rc=$? $(grep -h 'Avg bus' "$out/socket/nccl-tests/$op-float-eager.txt")"
    done
  )
  ssizes=$($py -c 'print(",".join(str(2**k) for k in range(3, 27)))')
  timeout 300 $py bench/device/cross_node.py --out "$out/socket" --bench "$out/socket/check-eager.json" --sizes "$ssizes" \
    --iters 20 --warmup 5 --dtypes fp32 --timing eager >"$out/socket/check-eager.txt" 2>&1
  stamp "socket check eager rc=$? $(tail -1 "$out/socket/check-eager.txt")"
  $py bench/device/nccl_compare.py --nccl-tests "$out/socket/nccl-tests" --ours "$out/socket/check-eager.json" \
    --out "$out/socket/compare.md" >/dev/null
  stamp "compare (socket, eager both) rc=$?"; grep -E "^- " "$out/socket/compare.md"
  # Graph capture over a host-staged transport is not what the role uses (multi-node worlds time eagerly):
  # tried last, with a short deadline, to learn whether it works.
  timeout 150 $py bench/device/cross_node.py --out "$out/socket" --bench "$out/socket/check-auto.json" --sizes "$ssizes" \
    --iters 20 --warmup 5 --dtypes fp32 --timing auto --deadline 120 >"$out/socket/check-auto.txt" 2>&1
  stamp "socket check auto (graph, eager too from 1 MiB) rc=$? $(tail -1 "$out/socket/check-auto.txt")"
fi
stamp "done"
