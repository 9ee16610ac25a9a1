"""`make sanity`: ansible-test sanity on the collection as a site installs it.

Builds the collection from what a clean clone of this checkout holds, with the working tree's edits (galaxy.yml's
build_ignore decides what ships; tests/helpers/collection.py), installs it into a private temporary collections path (ansible-test must run at .../ansible_collections/llmfleet/fleet) and runs
`ansible-test sanity --venv` there: each sanity test's own pinned requirements, from PyPI, in ansible-test's venvs
(cached under the cache directory, so only the first run installs them). The ignore file is the one the artifact
ships, tests/sanity/ignore-<ansible-core major.minor>.txt.

ansible-test puts pip into its empty venvs with a get-pip script from ci-files.testing.ansible.com; where that host is
out of reach (a site or CI with PyPI only), this writes the script ansible-test looks for in its cache: pip's own
wheel, from PyPI, installing itself (what get-pip does).

    python tests/helpers/sanity.py [--cache DIR] [ansible-test sanity arguments, e.g. --test validate-modules]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.helpers import collection

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent

GET_PIP = '''"""pip's bootstrap for ansible-test's venvs, from pip's wheel beside this file (written by llmfleet's
tests/helpers/sanity.py). Run by ansible-test with pip install's options and the packages (pip==<version>)."""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
WHEEL = os.path.join(HERE, "{wheel}")
sys.path.insert(0, WHEEL)
from pip._internal.cli.main import main  # noqa: E402

ARGS = [a for a in sys.argv[1:] if a not in ("--no-setuptools", "--no-wheel")]
sys.exit(main(["install", "--upgrade", "--force-reinstall", "--no-index", "--find-links", HERE] + ARGS))
'''


def pip_version() -> str:
    """The pip that this ansible-test bootstraps into its venvs."""
    from ansible_test._internal.python_requirements import get_venv_packages

    class _Python:
        version = f"{sys.version_info[0]}.{sys.version_info[1]}"

    return get_venv_packages(_Python())["pip"]


def ensure_get_pip(home: Path) -> None:
    """Put pip's bootstrap script where ansible-test reads it (its cache) unless one is already there."""
    version = pip_version()
    cache = home / ".ansible" / "test" / "cache"
    script = cache / f"get_pip_{version.replace('.', '_')}.py"
    if script.exists():
        return
    cache.mkdir(parents=True, exist_ok=True, mode=0o700)
    wheel = f"pip-{version}-py3-none-any.whl"
    if not (cache / wheel).exists():
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", f"pip=={version}",
             "-d", str(cache)],
            check=True,
        )  # fmt: skip
    script.write_text(GET_PIP.format(wheel=wheel), encoding="utf-8")


def core_version() -> str:
    from ansible.release import __version__

    return ".".join(__version__.split(".")[:2])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    default_cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "llmfleet" / "sanity"
    parser.add_argument("--cache", type=Path, default=default_cache,
                        help="ansible-test's home: its venvs and pip's bootstrap, kept between runs (default: %(default)s)")  # fmt: skip
    args, rest = parser.parse_known_args(argv)
    home = args.cache
    home.mkdir(parents=True, exist_ok=True, mode=0o700)
    ignore = ROOT / "tests" / "sanity" / f"ignore-{core_version()}.txt"
    if not ignore.exists():
        print(f"sanity: {ignore.relative_to(ROOT)} is missing (ansible-core {core_version()}): write one, even empty",
              file=sys.stderr)  # fmt: skip
        return 2
    ensure_get_pip(home)
    with tempfile.TemporaryDirectory(prefix="llmfleet-sanity-") as tmp:
        # Built from a snapshot of what a clean clone holds (with the working tree's edits), not the live tree:
        # an edit during the build would break the artifact's checksums.
        try:
            artifact, where = collection.build_and_install(Path(tmp))
        except (AssertionError, subprocess.CalledProcessError) as e:
            print(f"sanity: the collection did not build or install: {e}", file=sys.stderr)
            return 2
        # Nothing of the checkout's configuration: the collection as a site has it.
        env = {k: v for k, v in os.environ.items() if not k.startswith("ANSIBLE_")}
        env.update(HOME=str(home), PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}")
        pyver = f"{sys.version_info[0]}.{sys.version_info[1]}"
        cmd = [str(BIN / "ansible-test"), "sanity", "--venv", "--python", pyver, "--color", "no", *rest]
        print(f"sanity: {artifact.name} ({artifact.stat().st_size / 2**20:.2f} MiB) in {where}: {' '.join(cmd[1:])}",
              flush=True)  # fmt: skip
        t0 = time.monotonic()
        rc = subprocess.run(cmd, check=False, cwd=where, env=env).returncode
        print(f"sanity: exit {rc} in {time.monotonic() - t0:.0f} s")
        return rc


if __name__ == "__main__":
    sys.exit(main())
