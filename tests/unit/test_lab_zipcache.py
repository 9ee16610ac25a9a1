"""tests/lab/zipcache.py: the lab nodes' bytecode cache for modules imported from zips (AnsiballZ)."""

import os
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# Imports zipcache with its cache in CACHE, then imports `mod` from the zip ZIP; prints where mod's code says it
# came from. With FORBID set, compiling is an error: only the cache can supply the code.
SCRIPT = """
import os, sys
sys.path.insert(0, {lab!r})
import zipcache
zipcache._cache_dir = lambda: {cache!r}
if os.environ.get("FORBID"):
    def no(*a):
        raise SystemExit("compiled")
    zipcache._compile = no
sys.path.insert(0, {zip!r})
import mod
print(mod.where())
"""


def run(tmp_path, zip_path, cache, forbid=False):
    script = SCRIPT.format(lab=str(ROOT / "tests/lab"), cache=str(cache), zip=str(zip_path))
    env = {**os.environ, "FORBID": "1" if forbid else ""}
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, check=False)


def make_zip(path, body="def where():\n    return where.__code__.co_filename\n"):
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("mod.py", body)
    return path


def test_a_second_import_from_another_zip_uses_the_cached_bytecode_under_its_own_path(tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    first = run(tmp_path, make_zip(tmp_path / "a.zip"), cache)
    assert first.returncode == 0, first.stderr
    assert len(list(cache.iterdir())) == 1
    # Same source in another payload (AnsiballZ's temp path differs per run): no compile, and the code names
    # the zip it came from this time.
    second = run(tmp_path, make_zip(tmp_path / "b.zip"), cache, forbid=True)
    assert second.returncode == 0, second.stderr
    assert second.stdout.strip() == str(tmp_path / "b.zip" / "mod.py")


def test_changed_source_compiles_again(tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o700)
    assert run(tmp_path, make_zip(tmp_path / "a.zip"), cache).returncode == 0
    changed = make_zip(tmp_path / "c.zip", "def where():\n    return 'changed'\n")
    cp = run(tmp_path, changed, cache, forbid=True)
    assert cp.returncode != 0 and "compiled" in cp.stderr
    assert run(tmp_path, changed, cache).stdout.strip() == "changed"


def test_a_cache_directory_others_can_write_is_never_used(tmp_path):
    sys.path.insert(0, str(ROOT / "tests/lab"))
    try:
        import zipcache
    finally:
        sys.path.pop(0)
    import zipimport

    zipimport._compile_source = zipcache._compile  # importing it patched this process: undo
    home = tmp_path / "home"
    shared = home / ".cache" / "llmfleet-lab-zipcache" / sys.implementation.cache_tag
    shared.mkdir(parents=True)
    shared.chmod(0o777)

    class Pw:
        pw_dir = str(home)

    import pwd

    real = pwd.getpwuid
    pwd.getpwuid = lambda uid: Pw
    try:
        assert zipcache._cache_dir() is None
        shared.chmod(0o700)
        assert zipcache._cache_dir() == str(shared)
    finally:
        pwd.getpwuid = real
