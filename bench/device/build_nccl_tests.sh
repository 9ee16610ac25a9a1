#!/usr/bin/env bash
# Build nccl-tests (the four benchmarks the NCCL check is compared with) on this machine, for Hopper
# (sm_90), with MPI (MPICH from its PyPI wheel, so several processes - one per GPU, or two sharing one
# GPU under two NCCL_HOSTIDs - can run one world), against the NCCL that torch uses on the GPU machine
# (the nvidia-nccl-cu13 wheel of the same version). The device script (tests/device/nccl_check.sh)
# runs them with torch's own libnccl.so.2, and rebuilds there from the same source if they do not run.
#
#   bash bench/device/build_nccl_tests.sh SRC_GIT_DIR [NCCL_VERSION [MPICH_VERSION]]
# SRC_GIT_DIR: a clone of github.com/NVIDIA/nccl-tests (e.g. the search tool's fetch of it).
# Output (git-ignored, carried to the device): bench/device/build/nccl-tests-src (git archive of HEAD,
# with COMMIT) and bench/device/build/nccl-tests-mpi.tar.xz (bin/*_perf_mpi, mpich/{bin,lib}).
set -euo pipefail
src_git=${1:?usage: build_nccl_tests.sh SRC_GIT_DIR [NCCL_VERSION [MPICH_VERSION]]}
nccl_version=${2:-2.28.9}
mpich_version=${3:-5.0.2}
here=$(cd "$(dirname "$0")" && pwd)/build
cuda=${CUDA_HOME:-/usr/local/cuda-13.0}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

rm -rf "$here/nccl-tests-src" "$here/nccl-tests-mpi.tar.xz"
mkdir -p "$here/nccl-tests-src"
git -C "$src_git" archive HEAD | tar -x -C "$here/nccl-tests-src"
git -C "$src_git" rev-parse HEAD >"$here/nccl-tests-src/COMMIT"

python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_18_x86_64 \
  --platform manylinux_2_28_x86_64 -d "$tmp/whl" "nvidia-nccl-cu13==$nccl_version" "mpich==$mpich_version"
(cd "$tmp" && unzip -q whl/nvidia_nccl*.whl 'nvidia/nccl/*' && unzip -q whl/mpich-*.whl)
mpi=$(echo "$tmp"/mpich-*.data/data)
mkdir -p "$tmp/home/lib"
ln -s "$tmp/nvidia/nccl/include" "$tmp/home/include"
ln -s "$tmp/nvidia/nccl/lib/libnccl.so.2" "$tmp/home/lib/libnccl.so"

b=$tmp/build
make -C "$here/nccl-tests-src/src" -j"$(nproc)" MPI=1 MPI_HOME="$mpi" NAME_SUFFIX=_mpi NCCL_HOME="$tmp/home" \
  CUDA_HOME="$cuda" CUDARTLIB=cudart_static NVCC_GENCODE="-gencode=arch=compute_90,code=sm_90" BUILDDIR="$b" \
  "$b/all_reduce_perf_mpi" "$b/broadcast_perf_mpi" "$b/all_gather_perf_mpi" "$b/sendrecv_perf_mpi"
pkg=$tmp/pkg
mkdir -p "$pkg/bin" "$pkg/mpich/bin" "$pkg/mpich/lib"
for t in all_reduce broadcast all_gather sendrecv; do strip -o "$pkg/bin/${t}_perf_mpi" "$b/${t}_perf_mpi"; done
cp "$mpi/bin/mpiexec.hydra" "$mpi/bin/hydra_pmi_proxy" "$pkg/mpich/bin/"
ln -s mpiexec.hydra "$pkg/mpich/bin/mpiexec"
cp -a "$mpi/lib/libmpi.so.12" "$mpi/lib/mpich" "$pkg/mpich/lib/"
tar cJf "$here/nccl-tests-mpi.tar.xz" -C "$pkg" .
echo "nccl-tests $(cat "$here/nccl-tests-src/COMMIT"), NCCL $nccl_version, MPICH $mpich_version: $here/nccl-tests-mpi.tar.xz"
