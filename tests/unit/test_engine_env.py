"""Root never executes the engine's environment from a path another account can write: the NCCL check's ranks,
the engine's --help and version probes and preflight's NCCL version run as the engine's account (its uid, its
groups), or as root only from a path no other account can change; preflight names a venv another account can
change. Real processes, real ownership: the "other account" is `nobody`, the engine's account too where one is
needed (these tests need root to chown and to drop privileges)."""

from __future__ import annotations

import json
import os
import pwd
import shutil
import sys
import tempfile
from pathlib import Path

import pytest
import yaml

from llmfleet import engine_env
from llmfleet.checks import preflight
from llmfleet.checks.nccl_check import run_node_ranks
from llmfleet.engine.command import PlanError
from llmfleet.engine.node import engine_versions, help_text
from llmfleet.engine_env import EngineEnvError, popen_kwargs, unsafe_paths

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="chown and dropping privileges need root")
ROOT = Path(__file__).parents[2]
NOBODY = pwd.getpwnam("nobody")
ID_SCRIPT = '#!/bin/sh\necho "uid=$(id -u) gid=$(id -g) groups=$(id -G) home=$HOME user=$USER cwd=$(pwd)"\n'


@pytest.fixture
def public_dir():
    """A root-owned 0755 directory every account can traverse (pytest's tmp_path is root's 0700)."""
    d = Path(tempfile.mkdtemp(prefix="llmfleet-engine-env-"))
    d.chmod(0o755)
    yield d
    shutil.rmtree(d)


def venv(base: Path, body: str = ID_SCRIPT) -> Path:
    """A venv-shaped tree (bin/python, pyvenv.cfg, lib/python3.11/site-packages) owned by root, 0755."""
    for sub in ("bin", "lib/python3.11/site-packages"):
        (base / sub).mkdir(parents=True, exist_ok=True)
    for p in [base, *base.rglob("*")]:
        p.chmod(0o755)
    (base / "pyvenv.cfg").write_text("home = /usr/bin\n")
    py = base / "bin" / "python"
    py.write_text(body)
    py.chmod(0o755)
    return py


def test_root_refuses_a_venv_whose_site_packages_another_account_owns(public_dir):
    py = venv(public_dir / "venv")
    site = public_dir / "venv/lib/python3.11/site-packages"
    os.chown(site, NOBODY.pw_uid, -1)
    with pytest.raises(PlanError) as e:
        engine_versions(str(py))  # no run_as: root, and only from a path only root can change
    assert str(site) in str(e.value) and "owner nobody" in str(e.value)
    assert f"chown -R root:root {public_dir / 'venv'}" in str(e.value)


@pytest.mark.parametrize("what", ["pth", "sitecustomize", "interpreter", "parent", "group"])
def test_root_refuses_any_changeable_part_of_the_engines_environment(public_dir, what):
    py = venv(public_dir / "venv")
    site = public_dir / "venv/lib/python3.11/site-packages"
    planted = {"pth": site / "evil.pth", "sitecustomize": site / "sitecustomize.py"}.get(what)
    if planted:
        planted.write_text("import os\n")
        os.chown(planted, NOBODY.pw_uid, NOBODY.pw_gid)
        bad = planted
    elif what == "interpreter":
        os.chown(py, NOBODY.pw_uid, -1)
        bad = py
    elif what == "parent":
        public_dir.chmod(0o777)  # anyone can swap the venv for another
        bad = public_dir
    else:
        os.chown(site, 0, NOBODY.pw_gid)  # group-writable by a group that is not root's
        site.chmod(0o775)
        bad = site
    with pytest.raises(EngineEnvError) as e:
        popen_kwargs(str(py), None)
    assert str(bad) in str(e.value)
    assert unsafe_paths(str(py))[0]["path"] == str(bad)


def test_a_root_owned_venv_runs_as_root_and_a_sticky_tmp_above_it_is_fine(public_dir):
    py = venv(public_dir / "venv")
    assert unsafe_paths(str(py)) == []  # /tmp is 1777 root: others cannot rename root's entries there
    assert "uid=0 " in help_text([str(py)], "custom", 30)[0]


def test_the_help_probe_runs_as_the_engine_account_with_its_groups_and_home(public_dir):
    py = venv(public_dir / "venv")
    os.chown(public_dir / "venv/lib/python3.11/site-packages", NOBODY.pw_uid, -1)  # the engine's own: fine as it
    out, cached = help_text([str(py)], "custom", 30, run_as="nobody")
    groups = " ".join(str(g) for g in sorted(set(os.getgrouplist("nobody", NOBODY.pw_gid))))
    assert f"uid={NOBODY.pw_uid} gid={NOBODY.pw_gid} groups={groups}" in out
    assert f"home={NOBODY.pw_dir} user=nobody cwd=/" in out and not cached


def test_the_version_probe_runs_as_the_engine_account(public_dir):
    body = '#!/bin/sh\necho "{\\"versions\\": {\\"uid\\": \\"$(id -u)\\"}, \\"cuda\\": null}"\n'
    py = venv(public_dir / "venv", body)
    assert engine_versions(str(py), run_as="nobody")["versions"] == {"uid": str(NOBODY.pw_uid)}


def test_an_engine_account_not_created_yet_leaves_root_only_a_safe_path(public_dir):
    py = venv(public_dir / "venv")
    assert "uid=0 " in help_text([str(py)], "custom", 30, run_as="llmfleet-no-such-user")[0]
    os.chown(py, NOBODY.pw_uid, -1)
    with pytest.raises(PlanError, match="create the engine account llmfleet-no-such-user first"):
        help_text([str(py)], "custom", 30, run_as="llmfleet-no-such-user")


def rank_python(public_dir: Path) -> Path:
    """Stands in for the engine's Python: prints rank 0's result line with the uid and groups it ran as."""
    body = '#!/bin/sh\necho "[{\\"rank\\": 0, \\"ok\\": true, \\"uid\\": $(id -u), \\"groups\\": \\"$(id -G)\\"}]"\n'
    return venv(public_dir / "venv", body)


def spec(py: Path, **over) -> dict:
    return {"python": str(py), "world": 1, "master": "127.0.0.1", "port": 29999, "ranks": [[0, 0]], "env": {},
            "args": [], "deadline": 20, **over}  # fmt: skip


def test_the_nccl_check_ranks_run_as_the_engine_account(public_dir):
    py = rank_python(public_dir)
    got = run_node_ranks(spec(py, run_as="nobody"))
    assert got[0]["uid"] == NOBODY.pw_uid and got[0]["ok"]


def test_the_nccl_check_refuses_root_ranks_from_a_python_another_account_owns(public_dir):
    import llmfleet_nccl_check as mod

    py = rank_python(public_dir)
    os.chown(py, NOBODY.pw_uid, -1)
    res = mod.node_result(spec(py), str(py))
    assert res["failed"] and str(py) in res["msg"] and "owner nobody" in res["msg"]
    assert run_node_ranks(spec(py, run_as="nobody"))[0]["uid"] == NOBODY.pw_uid


def test_an_engine_account_that_cannot_reach_the_python_is_named(public_dir):
    import llmfleet_nccl_check as mod

    py = rank_python(public_dir)
    (public_dir / "venv").chmod(0o700)  # root's own: the engine's account cannot search it
    res = mod.node_result(spec(py, run_as="nobody"), str(py))
    assert res["failed"] and "as nobody (the engine's account: it must be able to run it" in res["msg"]
    with pytest.raises(PlanError, match="not executable by the engine's account nobody"):
        help_text([str(py)], "custom", 30, run_as="nobody")


def test_preflight_reads_nccl_as_the_engine_account(public_dir):
    py = venv(public_dir / "venv", "#!/bin/sh\nid -u\n")
    assert preflight.engine_nccl(str(py), "nobody") == str(NOBODY.pw_uid)


def test_preflight_fails_a_venv_another_account_can_change_and_warns_on_the_engines_own(public_dir):
    py = venv(public_dir / "venv")
    site = public_dir / "venv/lib/python3.11/site-packages"
    row = lambda env: preflight._engine_env_row("n1", env)  # noqa: E731
    assert row(preflight.engine_env_writers(str(py), "nobody"))[0]["status"] == "pass"
    os.chown(site, NOBODY.pw_uid, -1)  # the engine's account (nobody here) owns site-packages
    warned = row(preflight.engine_env_writers(str(py), "nobody"))[0]
    assert warned["status"] == "warn" and str(site) in warned["message"] and "owner nobody" in warned["message"]
    failed = row(preflight.engine_env_writers(str(py), "root"))[0]  # any other account
    assert failed["status"] == "fail" and str(site) in failed["message"]
    assert f"chown -R root:root {public_dir / 'venv'}" in failed["message"]
    site.chmod(0o777)  # every user
    failed = row(preflight.engine_env_writers(str(py), "nobody"))[0]
    assert failed["status"] == "fail" and "every user" in failed["message"]


def test_preflight_measure_reports_the_engine_env(public_dir, tmp_path):
    py = venv(public_dir / "venv")
    os.chown(py, NOBODY.pw_uid, -1)
    m = preflight.measure(sys_root=str(tmp_path), nvme_path=str(tmp_path), clock_source=str(tmp_path / "no"),
                          engine_env=str(py), engine_user="root")  # fmt: skip
    assert [f["path"] for f in m["engine_env"]["others"]] == [str(py)]
    rows = [r for r in preflight.evaluate({"n1": m}, {"expect_gpus": False}) if r["check"] == "engine_env"]
    assert [r["status"] for r in rows] == ["fail"]


def test_the_lab_engine_python_passes():
    """The lab's engine Python is this project's venv (root's): nothing there is another account's."""
    assert unsafe_paths(sys.executable) == [] or os.stat(sys.executable).st_uid != 0


def test_no_task_runs_the_engine_python_as_root():
    """A command task that execs llmfleet_engine_python runs it as the engine account (runuser with the account the
    plan's probe names), never as root unconditionally."""
    bad = []
    for f in sorted(ROOT.glob("roles/*/tasks/*.yml")):
        for task in yaml.safe_load(f.read_text()) or []:
            for key in ("ansible.builtin.command", "ansible.builtin.shell"):
                text = json.dumps(task.get(key) or "")
                if "llmfleet_engine_python" in text and not ("runuser" in text and "engine_run_as" in json.dumps(task)):
                    bad.append(f"{f.relative_to(ROOT)}: {task.get('name')}")
    assert bad == []


def test_every_module_task_that_runs_the_engine_names_the_account():
    """The modules that exec the engine's program (its --help, the NCCL check's ranks) are told the engine account in
    every task, so root runs nothing from the engine's environment when the account exists."""
    bad = []
    for f in sorted(ROOT.glob("roles/*/tasks/*.yml")):
        for task in yaml.safe_load(f.read_text()) or []:
            for key in ("llmfleet_engine_flags", "llmfleet_nccl_check"):
                if key in task and not str((task[key] or {}).get("run_as", "")).strip():
                    bad.append(f"{f.relative_to(ROOT)}: {task.get('name')}")
    assert bad == []


def test_writers_names_each_kind_of_account():
    st = os.stat_result((0o40777, 0, 0, 0, NOBODY.pw_uid, NOBODY.pw_gid, 0, 0, 0, 0))
    assert engine_env.writers(st) == ["its owner nobody", f"group {engine_env._group(NOBODY.pw_gid)}", "every user"]
    sticky = os.stat_result((0o41777, 0, 0, 0, 0, 0, 0, 0, 0, 0))
    assert engine_env.writers(sticky, ancestor=True) == []
    assert engine_env.writers(sticky) == ["every user"]


def test_the_plan_probe_names_the_account_the_fit_probe_runs_as(public_dir):
    import llmfleet_engine_probe as probe

    py = venv(public_dir / "venv")
    assert probe.engine_run_as("nobody", str(py)) == "nobody"
    assert probe.engine_run_as("llmfleet-no-such-user", str(py)) == ""  # root, from a path only root can change
    os.chown(py, NOBODY.pw_uid, -1)
    with pytest.raises(probe.ProbeError, match="owner nobody"):
        probe.engine_run_as("llmfleet-no-such-user", str(py))
