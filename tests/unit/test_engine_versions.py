"""engine_versions: what the compile-cache fingerprint hashes, as the engine's own Python sees it, without
importing torch (the import cost 3-4 s of every converge on the lab for one string)."""

import sys

import pytest

from llmfleet.engine.node import engine_versions


@pytest.mark.parametrize(
    ("line", "cuda"),
    [("cuda: Optional[str] = '12.8'", "12.8"), ("cuda = '13.0'", "13.0"), ("cuda: Optional[str] = None", None)],
)
def test_torch_cuda_comes_from_version_py_without_importing_torch(tmp_path, monkeypatch, line, cuda):
    pkg = tmp_path / "site" / "torch"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise SystemExit('torch was imported')\n")
    (pkg / "version.py").write_text(f"from typing import Optional\n__version__ = '2.9.1'\n{line}\nhip = None\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "site"))
    assert engine_versions(sys.executable)["cuda"] == cuda


def test_no_torch_means_no_cuda(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    got = engine_versions("/usr/bin/python3")
    assert set(got) == {"versions", "cuda"}
