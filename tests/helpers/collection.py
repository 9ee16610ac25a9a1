"""The collection llmfleet.fleet built and installed as a site gets it, for the tests (tests/unit/test_collection.py,
tests/integration/test_collection.py): `ansible-galaxy collection build` on what a clean clone of this checkout
holds (tracked and not-ignored files, the working tree's edits, links kept as links), then `ansible-galaxy
collection install` into an empty collections path."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def version() -> str:
    return str(yaml.safe_load((ROOT / "galaxy.yml").read_text(encoding="utf-8"))["version"])


def clean_clone(dest: Path) -> None:
    """What `git clone` of this checkout would hold, with the working tree's edits."""
    out = subprocess.run(
        ["git", "-C", str(ROOT), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        check=True, capture_output=True,
    ).stdout  # fmt: skip
    for rel in filter(None, out.decode().split("\0")):
        src = ROOT / rel
        if not src.is_symlink() and not src.exists():
            continue  # deleted in the working tree, not yet committed
        dst = dest / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        if src.is_symlink():
            os.symlink(os.readlink(src), dst)
        elif src.is_file():
            shutil.copy2(src, dst)


def site_env(collections: Path, home: str | None = None) -> dict:
    """A site's shell: no ANSIBLE_* of the checkout or the suite (but where Ansible keeps its own temp files), no
    llmfleet on PYTHONPATH, this venv's Ansible on PATH."""
    env = {
        "PATH": f"{BIN}{os.pathsep}/usr/bin{os.pathsep}/bin{os.pathsep}/usr/sbin{os.pathsep}/sbin",
        "HOME": home or os.environ.get("HOME", "/root"),
        "LC_ALL": "C.UTF-8",
        "ANSIBLE_COLLECTIONS_PATH": str(collections),
    }
    if home is None and os.environ.get("ANSIBLE_HOME"):
        env["ANSIBLE_HOME"] = os.environ["ANSIBLE_HOME"]  # private to this user (the Makefile's)
    return env


def build_and_install(base: Path) -> tuple[Path, Path]:
    """(the artifact, the installed collection's directory) under base: base/clone, base/dist, base/collections."""
    src, out, collections = base / "clone", base / "dist", base / "collections"
    clean_clone(src)
    subprocess.run([str(BIN / "ansible-galaxy"), "collection", "build", "--output-path", str(out), str(src)],
                   check=True, capture_output=True, text=True)  # fmt: skip
    artifact = out / f"llmfleet-fleet-{version()}.tar.gz"
    if not artifact.is_file():
        raise AssertionError(f"no {artifact.name} in {sorted(p.name for p in out.iterdir())}")
    collections.mkdir()
    r = subprocess.run([str(BIN / "ansible-galaxy"), "collection", "install", "-p", str(collections), str(artifact)],
                       check=False, cwd=base, env=site_env(collections, home=str(base)), capture_output=True,
                       text=True)  # fmt: skip
    if r.returncode != 0:
        raise AssertionError(f"ansible-galaxy collection install: exit {r.returncode}\n{r.stdout}\n{r.stderr}")
    installed = collections / "ansible_collections" / "llmfleet" / "fleet"
    if not (installed / "MANIFEST.json").is_file():
        raise AssertionError(f"nothing installed in {installed}")
    return artifact, installed
