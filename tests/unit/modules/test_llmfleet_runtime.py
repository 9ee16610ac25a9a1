"""llmfleet_runtime (action plugin + node module): the runtime package packed the same way every time, sent only when
the node's differs, compiled and swapped in whole; the metrics directory set; check mode changing nothing; bad
Pythons, unsafe directories, packages that do not compile and tampered archives refused."""

import grp
import hashlib
import importlib.util
import io
import marshal
import os
import stat
import sys
import tarfile
from pathlib import Path
from types import SimpleNamespace

import pytest
from ansible.errors import AnsibleActionFail

import llmfleet_runtime as mod
from tests.unit.module_utils import AnsibleExitJson, AnsibleFailJson, set_module_args
from tests.unit.modules.util import ACTIONS, fail, run, undocumented

pytestmark = pytest.mark.usefixtures("module_exits")

_spec = importlib.util.spec_from_file_location("llmfleet_runtime_action", ACTIONS / "llmfleet_runtime.py")
action = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(action)

GROUP = grp.getgrgid(os.getegid()).gr_name


def package(d: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        (d / rel).parent.mkdir(parents=True, exist_ok=True)
        (d / rel).write_text(text)
    return d


def args(tmp: Path, archive: bytes | None = None, lib_mode: int = 0o755, **kw) -> dict:
    lib = tmp / "opt" / "lib"
    lib.mkdir(parents=True, exist_ok=True)  # llmfleet_files makes it in the base role
    os.chmod(lib, lib_mode)
    a = {"lib_dir": str(lib), "python": sys.executable, "archive_sha256": hashlib.sha256(archive or b"").hexdigest()}
    if archive is not None:
        (tmp / "archive.tar.gz").write_bytes(archive)
        a["archive"] = str(tmp / "archive.tar.gz")
    return {**a, **kw}


def test_the_archive_is_the_same_bytes_every_time_and_leaves_caches_out(tmp_path):
    src = package(tmp_path / "pkg", {"__init__.py": "v = 1\n", "sub/a.py": "x\n", "__pycache__/c.pyc": "", "b.pyc": ""})
    one, n = action.pack(str(src))
    os.utime(src / "sub" / "a.py", (1, 1))
    assert action.pack(str(src) + "/") == (one, n) and n == 2
    with tarfile.open(fileobj=io.BytesIO(one)) as tar:
        assert [(m.name, m.uid, m.mtime, m.mode) for m in tar] == [
            ("__init__.py", 0, 0, 0o644),
            ("sub/a.py", 0, 0, 0o644),
        ]


def test_a_source_without_the_package_is_named(tmp_path):
    with pytest.raises(AnsibleActionFail, match=rf"src={tmp_path} holds no llmfleet package .*base_runtime_src"):
        action.pack(str(tmp_path))


def test_install_then_nothing_to_do(tmp_path):
    archive, _ = action.pack(str(package(tmp_path / "pkg", {"__init__.py": "v = 1\n", "old.py": "o = 1\n"})))
    first = run(mod, args(tmp_path, archive=None, archive_sha256=hashlib.sha256(archive).hexdigest()))
    assert first["needs_archive"] is True and first["installed"] is True  # the action sends it and runs again
    assert first["changed_paths"] == []
    lib = tmp_path / "opt" / "lib"
    res = run(mod, args(tmp_path, archive))
    assert res["changed"] and res["installed"] and res["package_files"] == 2
    assert (lib / "llmfleet" / "old.py").read_text() == "o = 1\n"
    assert (lib / "llmfleet" / ".archive-sha256").read_text().strip() == hashlib.sha256(archive).hexdigest()
    (pyc,) = (lib / "llmfleet" / "__pycache__").glob("old.*.pyc")
    code = marshal.loads(pyc.read_bytes()[16:])  # noqa: S302 (the .pyc this test just had compiled)
    assert code.co_filename == str(lib / "llmfleet" / "old.py"), "compiled with the path it is imported from"
    assert sorted(os.listdir(lib)) == ["llmfleet"]
    again = run(mod, args(tmp_path, archive))
    assert again["changed"] is False and again["installed"] is False and again["changed_paths"] == []
    assert not undocumented(mod, again)

    # A new package replaces the old one whole: a module it no longer has is gone.
    newer, _ = action.pack(str(package(tmp_path / "pkg2", {"__init__.py": "v = 2\n"})))
    res = run(mod, args(tmp_path, newer))
    assert res["installed"] and res["changed_paths"] == [str(lib / "llmfleet")]
    assert not (lib / "llmfleet" / "old.py").exists() and (lib / "llmfleet" / "__init__.py").read_text() == "v = 2\n"


def test_check_mode_says_what_would_change_and_changes_nothing(tmp_path):
    archive, _ = action.pack(str(package(tmp_path / "pkg", {"__init__.py": ""})))
    res = run(mod, args(tmp_path, archive), check=True)
    assert res["changed"] and res["installed"]
    assert res["changed_paths"] == [str(tmp_path / "opt" / "lib" / "llmfleet")]
    assert os.listdir(tmp_path / "opt" / "lib") == []


@pytest.mark.parametrize("python", ["/nonexistent/python3", "/bin/false"])
def test_an_unusable_python_is_named_before_anything_changes(tmp_path, python):
    archive, _ = action.pack(str(package(tmp_path / "pkg", {"__init__.py": ""})))
    res = fail(mod, args(tmp_path, archive, python=python))
    assert f"{python} is not a usable Python >= 3.8" in res["msg"] and "Set base_python" in res["msg"]
    assert os.listdir(tmp_path / "opt" / "lib") == []


def test_metrics_dir_must_exist_and_gets_the_group_and_sticky_mode(tmp_path):
    res = fail(mod, args(tmp_path, metrics_dir=str(tmp_path / "textfile"), metrics_group=GROUP))
    assert f"llmfleet_metrics_dir {tmp_path / 'textfile'} is not a directory. Install node_exporter" in res["msg"]
    (tmp_path / "textfile").mkdir(mode=0o755)
    archive, _ = action.pack(str(package(tmp_path / "pkg", {"__init__.py": ""})))
    res = run(mod, args(tmp_path, archive, metrics_dir=str(tmp_path / "textfile"), metrics_group=GROUP))
    assert str(tmp_path / "textfile") in res["changed_paths"]
    assert stat.S_IMODE(os.stat(tmp_path / "textfile").st_mode) == 0o1775


def test_a_lib_dir_others_can_write_is_refused(tmp_path):
    archive, _ = action.pack(str(package(tmp_path / "pkg", {"__init__.py": ""})))
    res = fail(mod, args(tmp_path, archive, lib_mode=0o777))
    assert "must be root-owned and writable by nobody else" in res["msg"]
    assert not (tmp_path / "opt" / "lib" / "llmfleet").exists()


def test_a_tampered_archive_is_refused_and_the_old_package_stays(tmp_path):
    good, _ = action.pack(str(package(tmp_path / "pkg", {"__init__.py": "v = 1\n"})))
    run(mod, args(tmp_path, good))
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        info = tarfile.TarInfo("../../escaped.py")
        info.size = 2
        tar.addfile(info, io.BytesIO(b"x\n"))
    res = fail(mod, args(tmp_path, buf.getvalue()))
    assert "'../../escaped.py', which is not a plain file of the package" in res["msg"]
    lib = tmp_path / "opt" / "lib"
    assert sorted(os.listdir(lib)) == ["llmfleet"] and (lib / "llmfleet" / "__init__.py").read_text() == "v = 1\n"
    assert not (tmp_path / "escaped.py").exists()


def test_a_package_that_does_not_compile_is_not_installed_and_the_old_one_stays(tmp_path):
    good, _ = action.pack(str(package(tmp_path / "pkg", {"__init__.py": "v = 1\n"})))
    run(mod, args(tmp_path, good))
    bad, _ = action.pack(str(package(tmp_path / "pkg2", {"__init__.py": "v = 2\n", "broken.py": "def (:\n"})))
    res = fail(mod, args(tmp_path, bad))
    assert "cannot compile the llmfleet package (nothing was installed, the old package stays)" in res["msg"]
    assert "broken.py" in res["msg"]
    lib = tmp_path / "opt" / "lib"
    assert sorted(os.listdir(lib)) == ["llmfleet"] and (lib / "llmfleet" / "__init__.py").read_text() == "v = 1\n"
    assert fail(mod, args(tmp_path, bad))["msg"] == res["msg"], "the next run tries again"


def node_call(module_args: dict, check: bool = False) -> dict:
    with set_module_args({**module_args, "_ansible_check_mode": check}):
        try:
            mod.main()
        except (AnsibleExitJson, AnsibleFailJson) as e:
            return e.args[0]
    raise AssertionError("the module neither exited nor failed")


def test_the_action_sends_the_archive_only_when_the_node_needs_it(tmp_path, monkeypatch):
    src = package(tmp_path / "pkg", {"__init__.py": "v = 1\n"})
    calls, sent = [], []
    remote = tmp_path / "remote-tmp"

    def execute(self, name, module_args, task_vars):
        calls.append(sorted(module_args))
        return node_call(module_args)

    def make_tmp(self):
        remote.mkdir()
        self._connection._shell.tmpdir = str(remote)
        return str(remote)

    def transfer(self, path, data):
        sent.append(len(data))
        Path(path).write_bytes(data)

    def remove(self, path):
        assert path == str(remote)
        for p in remote.iterdir():
            p.unlink()
        remote.rmdir()
        self._connection._shell.tmpdir = None

    monkeypatch.setattr(action.ActionModule, "_execute_module", execute)
    monkeypatch.setattr(action.ActionModule, "_make_tmp_path", make_tmp)
    monkeypatch.setattr(action.ActionModule, "_transfer_data", transfer)
    monkeypatch.setattr(action.ActionModule, "_fixup_perms2", lambda self, paths: None)
    monkeypatch.setattr(action.ActionModule, "_remove_tmp_path", remove)

    def act(check=False):
        a = args(tmp_path)
        a.pop("archive_sha256")
        task = SimpleNamespace(args={**a, "src": str(src)}, async_val=0, check_mode=check, action="llmfleet_runtime",
                               diff=False)  # fmt: skip
        shell = SimpleNamespace(tmpdir=None, join_path=os.path.join)
        conn = SimpleNamespace(_shell=shell)
        am = action.ActionModule(task, conn, play_context=None, loader=None, templar=None, shared_loader_obj=None)
        am._load_name = "llmfleet_runtime"
        return am.run(task_vars={})

    res = act()
    assert res["changed"] and res["installed"] and res["package_files"] == 1 and len(sent) == 1
    assert "archive" in calls[1] and "archive" not in calls[0] and "src" not in calls[0]
    assert res["changed_paths"] == [str(tmp_path / "opt" / "lib" / "llmfleet")] and not remote.exists()
    calls.clear()
    res = act()
    assert res["changed"] is False and len(calls) == 1 and len(sent) == 1, "unchanged: one module run, no transfer"
    assert "needs_archive" not in res
