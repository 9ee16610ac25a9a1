"""The package has one source, importable as `llmfleet` and as `ansible.module_utils.llmfleet`."""

import ast
import graphlib
import importlib
import sys
from pathlib import Path

import pytest

import llmfleet

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "module_utils" / "llmfleet"
# Modules that run only on the ops host and may import third-party packages (lazily).
OPS_HOST_ONLY = {"cli.py"}


def test_llmfleet_is_the_module_utils_tree():
    assert Path(llmfleet.__file__).resolve() == PKG / "__init__.py"


def test_same_source_under_both_names():
    a = importlib.import_module("llmfleet.nodeinfo")
    b = importlib.import_module("ansible.module_utils.llmfleet.nodeinfo")
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


def _package_imports(path: Path) -> set[str]:
    """Sibling modules one file imports (module level or lazily): `from .x import y`, `from . import x`."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            names = [node.module] if node.module else [a.name for a in node.names]
            out.update(n.split(".")[0] for n in names if (PKG / f"{n.split('.')[0]}.py").exists())
    return out


def test_the_package_import_graph_has_no_cycles():
    """Layers, not loops: pure logic (nccl_verdict, net, nodeinfo, engine, logobserver) below what composes
    it (nccl_check, plan, preflight, gate, wrapper, cli)."""
    graph = {p.stem: _package_imports(p) for p in PKG.glob("*.py")}
    order = list(graphlib.TopologicalSorter(graph).static_order())  # raises CycleError on a loop
    assert set(order) == set(graph)
    assert graph["nccl_verdict"] == graph["net"] == graph["logobserver"] == set()
    assert graph["gate"] >= {"logobserver"} and "wrapper" not in graph["gate"]  # the gate reads phases, runs no engine
    # The rank program needs nothing else of the package; its launcher drops root through engine_env (stdlib only).
    assert graph["nccl_check"] == {"nccl_verdict", "engine_env"} and graph["engine_env"] == set()
