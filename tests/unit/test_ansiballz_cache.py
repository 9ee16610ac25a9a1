"""The test suites' AnsiballZ scan cache (tests/ansible_plugins/callback/llmfleet_ansiballz_cache.py): a payload
built from the cache holds exactly what Ansible's own scan puts in it; any change to a module_utils directory
scans again; a directory others can write is never used."""

from __future__ import annotations

import datetime
import importlib.util
import io
import os
import zipfile
from pathlib import Path

import pytest
from ansible.executor import module_common as mc
from ansible.executor.module_common import _builder

from tests.helpers import ansible_cache

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location(
    "llmfleet_ansiballz_cache", Path(ansible_cache.CALLBACK_DIR) / "llmfleet_ansiballz_cache.py"
)
plugin = importlib.util.module_from_spec(spec)
spec.loader.exec_module(plugin)

MODULE = (
    ROOT / "plugins" / "modules" / "llmfleet_engine_cache.py"
)  # one of the project's modules, with module_utils imports
COLLECTION = "llmfleet.fleet"  # where its module_utils come from (tests/conftest.py sets up the collection loader)
WHEN = datetime.datetime(2026, 12, 2, tzinfo=datetime.UTC)


class Counting:
    def __init__(self):
        self.calls = 0

    def __call__(self, *args):
        self.calls += 1
        return mc.recursive_finder(*args)


def build(finder):
    """What the scan writes into a payload (names and bytes, in order) and the module's metadata."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        meta = finder(
            "llmfleet_engine_cache",
            "ansible_collections.llmfleet.fleet.plugins.modules.llmfleet_engine_cache",
            MODULE.read_bytes(),
            zf,
            WHEN,
            _builder.ExtensionManager.create(task_vars={}),
        )
    with zipfile.ZipFile(buf) as zf:
        return [(i.filename, zf.read(i)) for i in zf.infolist()], meta


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("ANSIBLE_HOME", str(tmp_path / "ansible-home"))
    return tmp_path / "ansible-home" / "llmfleet-ansiballz-cache" / "v1"


def dirs_with(extra):
    return lambda: [str(ROOT / "plugins" / "module_utils"), mc._MODULE_UTILS_PATH, str(extra)]


def cached(spy, extra, covered=frozenset({COLLECTION})):
    return plugin.wrap(spy, dirs_with(extra), mc._make_zinfo, mc.ModuleMetadataV1, lambda: set(covered))


def test_a_payload_from_the_cache_is_what_ansible_scans(home, tmp_path):
    (tmp_path / "mu").mkdir()
    spy = Counting()
    first = build(cached(spy, tmp_path / "mu"))
    second = build(cached(spy, tmp_path / "mu"))
    plain = build(mc.recursive_finder)
    assert spy.calls == 1, "the second build scanned again"
    assert first == plain and second == plain
    names = [n for n, _ in plain[0]]
    assert "ansible/module_utils/basic.py" in names and any(
        n.startswith("ansible_collections/llmfleet/fleet/plugins/module_utils/llmfleet/") for n in names
    )
    assert len(list(home.glob("*.json"))) == 1
    assert (home.stat().st_mode & 0o777) == 0o700


def test_module_utils_from_a_collection_outside_the_fingerprint_are_never_cached(home, tmp_path):
    spy = Counting()
    for _ in range(2):
        payload = build(cached(spy, tmp_path, covered=frozenset()))
    assert spy.calls == 2 and list(home.glob("*.json")) == []
    assert payload == build(mc.recursive_finder)


def test_the_fingerprint_covers_the_collections_on_the_collection_paths():
    utils = plugin.collection_utils()
    assert Path(utils[COLLECTION]).resolve() == (ROOT / "plugins" / "module_utils").resolve()


def test_a_changed_module_utils_file_scans_again(home, tmp_path):
    mu = tmp_path / "mu"
    mu.mkdir()
    (mu / "x.py").write_text("A = 1\n")
    spy = Counting()
    build(cached(spy, mu))
    (mu / "x.py").write_text("A = 22\n")  # another size (and mtime)
    build(cached(spy, mu))
    assert spy.calls == 2


def test_a_cache_directory_others_can_write_is_never_used(home, tmp_path):
    home.mkdir(parents=True)
    os.chmod(home, 0o777)
    spy = Counting()
    for _ in range(2):
        payload = build(cached(spy, tmp_path))
    assert spy.calls == 2 and list(home.iterdir()) == []
    assert payload == build(mc.recursive_finder)


def test_the_suites_enable_it_without_dropping_other_callbacks():
    env = {"ANSIBLE_CALLBACK_PLUGINS": "/x/cb", "ANSIBLE_CALLBACKS_ENABLED": "profile_tasks"}
    ansible_cache.enable(env)
    ansible_cache.enable(env)  # twice: listed once
    assert env["ANSIBLE_CALLBACK_PLUGINS"] == f"/x/cb{os.pathsep}{ansible_cache.CALLBACK_DIR}"
    assert env["ANSIBLE_CALLBACKS_ENABLED"] == "profile_tasks,llmfleet_ansiballz_cache"
