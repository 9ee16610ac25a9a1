"""The node side runs on Python >= 3.8 (README): `make lint` checks it with vermin. Its command, as the Makefile
has it, fails on code that needs a newer Python; it may leave annotations unevaluated because every node-side file
that has one postpones them (from __future__ import annotations); and the code it passes runs under a real 3.8
where this machine has one."""

from __future__ import annotations

import ast
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
VERMIN = Path(sys.executable).parent / "vermin"
PY38 = Path.home() / ".pyenv" / "versions" / "3.8.18" / "bin" / "python"


def lint_argv() -> list[str]:
    """The vermin command of the Makefile's lint target, as the shell gets it."""
    line = next(x for x in (ROOT / "Makefile").read_text().splitlines() if x.startswith("\tvermin "))
    return shlex.split(line.replace("$$", "$"))


def node_side_files() -> list[Path]:
    """The files the lint command checks: its paths, less what its --exclude-regex options leave out."""
    argv = lint_argv()
    excludes = [re.compile(argv[i + 1]) for i, a in enumerate(argv) if a == "--exclude-regex"]
    paths = [a for i, a in enumerate(argv[1:], 1) if not a.startswith("-") and argv[i - 1] != "--exclude-regex"]
    files = sorted(p for d in paths for p in (ROOT / d).rglob("*.py"))
    return [p for p in files if not any(e.search(str(p.relative_to(ROOT))) for e in excludes)]


def test_the_lint_command_fails_on_code_that_needs_python_3_10(tmp_path):
    argv = lint_argv()
    paths = {a for i, a in enumerate(argv[1:], 1) if not a.startswith("-") and argv[i - 1] != "--exclude-regex"}
    assert paths == {"plugins/module_utils/llmfleet", "plugins/modules"}
    flags = [a for a in argv[1:] if a not in paths]
    (tmp_path / "fine.py").write_text(
        "from __future__ import annotations\n\n\ndef f(x: list[str] | None) -> dict[str, int]:\n    return {}\n"
    )
    ok = subprocess.run([str(VERMIN), *flags, str(tmp_path)], capture_output=True, text=True, check=False)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    (tmp_path / "newer.py").write_text("def g(a, b):\n    return list(zip(a, b, strict=True))\n")
    bad = subprocess.run([str(VERMIN), *flags, str(tmp_path)], capture_output=True, text=True, check=False)
    assert bad.returncode == 1, bad.stdout + bad.stderr
    assert "newer.py" in bad.stdout and "'zip(strict)' requires !2, 3.10" in bad.stdout
    assert "fine.py" not in bad.stdout


def test_the_node_side_is_what_nodes_run():
    files = {str(p.relative_to(ROOT)) for p in node_side_files()}
    assert "plugins/module_utils/llmfleet/oncall/node_probe.py" in files  # on-call sends it to nodes as source
    assert "plugins/modules/llmfleet_model_stage.py" in files
    assert "plugins/module_utils/llmfleet/stage/lease.py" in files
    assert not [f for f in files if re.match(r"plugins/module_utils/llmfleet/(accept|report|oncall/(?!node_probe))", f)]


@pytest.mark.parametrize("path", node_side_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_node_side_annotations_are_never_evaluated(path):
    """vermin runs with --no-eval-annotations: right only where annotations are postponed."""
    tree = ast.parse(path.read_text())
    annotated = any(
        isinstance(n, ast.AnnAssign)
        or (isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and (n.returns or any(
            a.annotation for a in [*n.args.args, *n.args.kwonlyargs, *n.args.posonlyargs])))
        for n in ast.walk(tree)
    )  # fmt: skip
    future = any(
        isinstance(n, ast.ImportFrom) and n.module == "__future__" and any(a.name == "annotations" for a in n.names)
        for n in tree.body
    )
    assert future or not annotated, f"{path}: add `from __future__ import annotations` (nodes may run Python 3.8)"


@pytest.mark.skipif(not PY38.exists(), reason="no Python 3.8 on this machine")
def test_the_node_side_compiles_and_imports_under_python_3_8(tmp_path):
    """A real 3.8: the runtime's modules compile and import (as `llmfleet`, as nodes import them)."""
    lib = tmp_path / "llmfleet"
    shutil.copytree(ROOT / "module_utils" / "llmfleet", lib, ignore=shutil.ignore_patterns("__pycache__"))
    for sub in ("accept", "report", "oncall"):
        shutil.rmtree(lib / sub)
    names = sorted(
        ".".join(("llmfleet", *p.relative_to(lib).with_suffix("").parts)).removesuffix(".__init__")
        for p in lib.rglob("*.py")
        if p.name != "__main__.py"
    )
    code = "import importlib, sys\nfor n in sys.argv[1:]:\n    importlib.import_module(n)\n"
    cp = subprocess.run([str(PY38), "-S", "-c", code, *names], cwd=tmp_path, env={"PYTHONPATH": str(tmp_path)},
                        capture_output=True, text=True, timeout=120, check=False)  # fmt: skip
    assert cp.returncode == 0, cp.stderr[-3000:]


@pytest.mark.skipif(not PY38.exists(), reason="no Python 3.8 on this machine")
def test_the_staging_lease_collects_its_records_under_python_3_8(tmp_path):
    """The lease's garbage collection ran itertools.pairwise (3.10): on a 3.8 node, every release failed."""
    code = (
        "import os, sys\nfrom llmfleet.stage import lease\n"
        "lz = lease.Lease(sys.argv[1], cap=1, ttl=5, host='node1', gc_after=0)\n"
        "for _ in range(3):\n    lz.acquire(timeout=5, poll=0.01)\n    lz.release()\n"
        "print(len([n for n in os.listdir(sys.argv[1]) if n.startswith('slot-')]))\n"
    )
    leases = tmp_path / "leases"
    leases.mkdir()
    cp = subprocess.run([str(PY38), "-S", "-c", code, str(leases)], env={"PYTHONPATH": str(ROOT / "module_utils")},
                        capture_output=True, text=True, timeout=60, check=False)  # fmt: skip
    assert cp.returncode == 0, cp.stderr[-3000:]
    assert cp.stdout.strip() == "1"  # only the newest record is left
