"""The package has one source, importable as `llmfleet` and as `ansible_collections.llmfleet.fleet.plugins.module_utils.llmfleet`."""

import ast
import graphlib
import importlib
import importlib.util
import io
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

import llmfleet
from llmfleet import cli

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "plugins" / "module_utils" / "llmfleet"
# Modules that run only on the ops host and may import third-party packages (lazily).
OPS_HOST_ONLY = {"cli.py"}


def test_llmfleet_is_the_module_utils_tree():
    assert Path(llmfleet.__file__).resolve() == PKG / "__init__.py"


def test_same_source_under_both_names():
    a = importlib.import_module("llmfleet.nodeinfo")
    b = importlib.import_module("ansible_collections.llmfleet.fleet.plugins.module_utils.llmfleet.nodeinfo")
    assert a is not b  # two module objects ...
    assert Path(a.__file__).resolve() == Path(b.__file__).resolve()  # ... of one file
    assert a.meminfo_kib("MemTotal: 42 kB") == b.meminfo_kib("MemTotal: 42 kB") == 42


@pytest.mark.parametrize("path", sorted(PKG.rglob("*.py")), ids=lambda p: p.name)
def test_imports_are_relative_and_node_safe(path):
    """Absolute self-imports break under the ansible.module_utils name; third-party imports at
    module level break on nodes (only the stdlib is guaranteed there)."""
    tree = ast.parse(path.read_text())
    stdlib = sys.stdlib_module_names | {"__future__"}
    for node in tree.body:  # module level only: lazy imports inside functions are allowed
        if isinstance(node, ast.Import):
            names = [a.name.split(".")[0] for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names = [node.module.split(".")[0]]
        else:
            continue
        for name in names:
            assert name != "llmfleet", f"{path.name}:{node.lineno}: use a relative import inside the package"
            if path.name not in OPS_HOST_ONLY:
                assert name in stdlib, f"{path.name}:{node.lineno}: '{name}' is not stdlib; import it lazily"


def _module(path: Path) -> str:
    """A file's module name inside the package: `stage.store`, `cli`; the package itself is `__init__`."""
    parts = path.relative_to(PKG).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts) or "__init__"


def _is_module(name: str) -> bool:
    p = PKG.joinpath(*name.split(".")) if name != "__init__" else PKG
    return p.with_suffix(".py").is_file() or (p / "__init__.py").is_file()


def _package_imports(path: Path) -> set[str]:
    """Modules of the package one file imports (module level or lazily), by their names inside the package:
    `from .x import y`, `from ..stage import store`, `from . import x` (relative, as the package's imports are)."""
    mod = _module(path)
    package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if not (isinstance(node, ast.ImportFrom) and node.level):
            continue
        parts = package.split(".") if package not in ("", "__init__") else []
        base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
        for alias in node.names:
            name = f"{base}.{alias.name}" if base else alias.name
            out.add(name if _is_module(name) else base or "__init__")
    return out - {mod}


GRAPH = {_module(p): _package_imports(p) for p in PKG.rglob("*.py")}
# The subpackages only the ops host has (cli.OPS_HOST): on-call, the deployment report, API acceptance.
OPS_HOST = {"accept", "oncall", "report"}


def _ops_host(name: str) -> bool:
    return name.split(".", maxsplit=1)[0] in OPS_HOST


def test_the_package_import_graph_has_no_cycles():
    """Layers, not loops: pure logic (nccl_verdict, net, logobserver) below what composes it (nccl_check, plan,
    preflight, gate, wrapper, cli)."""
    order = list(graphlib.TopologicalSorter(GRAPH).static_order())  # raises CycleError on a loop
    assert set(order) == set(GRAPH)
    assert GRAPH["checks.nccl_verdict"] == GRAPH["net"] == set()
    # The log reader asks only the engine profiles (engines/ imports nothing above it) for their phrases.
    assert all(m.split(".")[0] == "engines" for m in GRAPH["engine.logobserver"])
    assert all(m.split(".")[0] == "engines" for e in GRAPH if e.startswith("engines") for m in GRAPH[e])
    gate = GRAPH["engine.gate"]  # the gate reads phases, runs no engine
    assert "engine.logobserver" in gate and not any(m.startswith("wrapper") for m in gate)
    # The rank program needs nothing else of the package; its launcher drops root through engine_env (stdlib only).
    assert GRAPH["checks.nccl_check"] == {"checks.nccl_verdict", "engine_env"} and GRAPH["engine_env"] == set()


def test_the_node_runtime_imports_nothing_of_the_ops_host_tools():
    """Nodes get the package without accept/, oncall/ and report/: no other module imports them, at module level
    or lazily (the CLI names its ops-host commands as strings and says where they run when they are absent)."""
    bad = sorted(
        f"{m} imports {i}" for m, imports in GRAPH.items() if not _ops_host(m) for i in imports if _ops_host(i)
    )
    assert bad == []
    assert OPS_HOST == set(cli.OPS_HOST) == set(runtime_action().OPS_HOST)
    assert {path.split(".")[0] for _, path, _ in cli.PLUGGED} >= OPS_HOST


def runtime_action():
    spec = importlib.util.spec_from_file_location(
        "_action_llmfleet_runtime", ROOT / "action_plugins/llmfleet_runtime.py"
    )
    action = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(action)
    return action


def runtime_files() -> list[str]:
    archive, count = runtime_action().pack(str(PKG))
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        names = tar.getnames()
    assert len(names) == count
    return names


def test_the_runtime_archive_is_the_node_side_only():
    names = runtime_files()
    # Pinned: the subpackages nodes get, and every module of the small core at the top.
    assert sorted({n.split("/")[0] for n in names if "/" in n}) == [
        "bench",
        "checks",
        "engine",
        "engines",
        "stage",
        "wrapper",
    ]
    assert {n for n in names if "/" not in n} == {p.name for p in PKG.glob("*.py")}
    assert [n for n in names if n.split("/")[0] in OPS_HOST or "__pycache__" in n or n.endswith(".pyc")] == []
    expected = sorted(
        str(p.relative_to(PKG)) for p in PKG.rglob("*")
        if p.is_file() and not _ops_host(_module(p)) and "__pycache__" not in p.parts and p.suffix != ".pyc"
    )  # fmt: skip
    assert sorted(names) == expected


def test_a_node_runs_its_commands_and_says_where_the_ops_host_ones_run(tmp_path):
    """The runtime as a node gets it (the archive, unpacked), run as the roles run it (python -m llmfleet), by a
    Python without this venv's site-packages (-S), where the whole package is installed."""
    archive, _ = runtime_action().pack(str(PKG))
    lib = tmp_path / "lib" / "llmfleet"
    lib.mkdir(parents=True)
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(lib, filter="data")
    env = {"PATH": os.environ["PATH"], "PYTHONPATH": str(lib.parent), "PYTHONDONTWRITEBYTECODE": "1"}

    def llmfleet(*argv):
        return subprocess.run([sys.executable, "-S", "-m", "llmfleet", *argv], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=60, check=False)  # fmt: skip

    top = llmfleet("--help")
    assert top.returncode == 0, top.stderr
    listed = {line.split()[0] for line in top.stdout.splitlines() if line.startswith("    ") and line[4] != " "}
    assert {name for name, _, _ in cli.PLUGGED} <= listed, "llmfleet --help on a node lists every command"
    for command in ("status", "why", "report", "accept", "warmup"):
        r = llmfleet(command, "--deployment", "demo")
        assert (r.returncode, r.stdout) == (2, ""), (command, r.stdout, r.stderr)
        assert r.stderr.startswith(f"llmfleet {command} runs on the ops host (pip install llmfleet there)"), r.stderr
        assert "Traceback" not in r.stderr
    for argv in (["fit", "--help"], ["startscan", "--help"], ["specdecode", "--help"], ["bench", "--help"],
                 ["precompile", "--help"], ["stage", "--help"], ["checkpoint", "--help"], ["topology", "--help"],
                 ["node-info", "--help"], ["exec", "--help"]):  # fmt: skip
        r = llmfleet(*argv)
        assert r.returncode == 0 and "Traceback" not in r.stderr, (argv, r.stderr[-2000:])
    with_ops = llmfleet("node-info", "--json")
    assert with_ops.returncode == 0 and '"hostname"' in with_ops.stdout, with_ops.stderr[-2000:]
