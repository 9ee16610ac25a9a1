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
from ansible.plugins.loader import init_plugin_loader

from tests.helpers import ansible_cache

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location(
    "llmfleet_ansiballz_cache", Path(ansible_cache.CALLBACK_DIR) / "llmfleet_ansiballz_cache.py"
)
plugin = importlib.util.module_from_spec(spec)
spec.loader.exec_module(plugin)

MODULE = ROOT / "library" / "llmfleet_engine_cache.py"  # one of the project's modules, with module_utils imports
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
            "ansible.legacy.llmfleet_engine_cache",
            MODULE.read_bytes(),
            zf,
            WHEN,
            _builder.ExtensionManager.create(task_vars={}),
        )
    with zipfile.ZipFile(buf) as zf:
        return [(i.filename, zf.read(i)) for i in zf.infolist()], meta


@pytest.fixture(scope="module", autouse=True)
def plugin_loader():
    init_plugin_loader()  # what ansible-playbook does first: the collection loader resolves ansible.builtin


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("ANSIBLE_HOME", str(tmp_path / "ansible-home"))
    return tmp_path / "ansible-home" / "llmfleet-ansiballz-cache" / "v1"


def dirs_with(extra):
    return lambda: [str(ROOT / "module_utils"), mc._MODULE_UTILS_PATH, str(extra)]


def test_a_payload_from_the_cache_is_what_ansible_scans(home, tmp_path):
    (tmp_path / "mu").mkdir()
    spy = Counting()
    first = build(plugin.wrap(spy, dirs_with(tmp_path / "mu"), mc._make_zinfo, mc.ModuleMetadataV1))
    second = build(plugin.wrap(spy, dirs_with(tmp_path / "mu"), mc._make_zinfo, mc.ModuleMetadataV1))
    plain = build(mc.recursive_finder)
    assert spy.calls == 1, "the second build scanned again"
    assert first == plain and second == plain
    names = [n for n, _ in plain[0]]
    assert "ansible/module_utils/basic.py" in names and any(
        n.startswith("ansible/module_utils/llmfleet/") for n in names
    )
    assert len(list(home.glob("*.json"))) == 1
    assert (home.stat().st_mode & 0o777) == 0o700


def test_a_changed_module_utils_file_scans_again(home, tmp_path):
    mu = tmp_path / "mu"
    mu.mkdir()
    (mu / "x.py").write_text("A = 1\n")
    spy = Counting()
    build(plugin.wrap(spy, dirs_with(mu), mc._make_zinfo, mc.ModuleMetadataV1))
    (mu / "x.py").write_text("A = 22\n")  # another size (and mtime)
    build(plugin.wrap(spy, dirs_with(mu), mc._make_zinfo, mc.ModuleMetadataV1))
    assert spy.calls == 2


def test_a_cache_directory_others_can_write_is_never_used(home, tmp_path):
    home.mkdir(parents=True)
    os.chmod(home, 0o777)
    spy = Counting()
    for _ in range(2):
        payload = build(plugin.wrap(spy, dirs_with(tmp_path), mc._make_zinfo, mc.ModuleMetadataV1))
    assert spy.calls == 2 and list(home.iterdir()) == []
    assert payload == build(mc.recursive_finder)


def test_the_suites_enable_it_without_dropping_other_callbacks():
    env = {"ANSIBLE_CALLBACK_PLUGINS": "/x/cb", "ANSIBLE_CALLBACKS_ENABLED": "profile_tasks"}
    ansible_cache.enable(env)
    ansible_cache.enable(env)  # twice: listed once
    assert env["ANSIBLE_CALLBACK_PLUGINS"] == f"/x/cb{os.pathsep}{ansible_cache.CALLBACK_DIR}"
    assert env["ANSIBLE_CALLBACKS_ENABLED"] == "profile_tasks,llmfleet_ansiballz_cache"
