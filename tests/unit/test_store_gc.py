"""GC never deletes what an engine serves or will serve after a restart: revisions an installed unit
names, revisions a process names (engines close their files after loading), the revision just staged;
it collects abandoned partial dirs, and its deletions make the run changed."""

import os
import subprocess
import sys
import time

import pytest

from llmfleet.stage import staging as stage
from llmfleet.stage import store
from llmfleet.stage.manifest import build_manifest
from tests.helpers.ckpt import make_checkpoint

REV, REV2, REV3 = "1" * 40, "2" * 40, "3" * 40


def staged(tmp_path, revs):
    """Publish each revision in turn (oldest first); every one but REV3 activated, so REV2 (when
    staged) ends as current and REV3 as the newest."""
    root = tmp_path / "nvme"
    for i, rev in enumerate(revs):
        src = make_checkpoint(tmp_path / "shared" / rev[:4], shards=1, seed=i)
        req = stage.StageRequest(root=str(root), model="m", revision=rev, manifest=build_manifest(str(src)),
                                 keep=10, unit_glob=str(tmp_path / "none-*.service"), activate=rev != REV3)  # fmt: skip
        stage.stage(req, lambda rel, src=src: [stage.LocalSource(str(src))])
        time.sleep(0.01)
    return root / "m"


def test_a_revision_an_installed_unit_names_is_kept(tmp_path):
    """Before: only open files and mappings counted; a stopped (or restarting) engine's revision was deleted."""
    mdir = staged(tmp_path, [REV, REV2, REV3])
    units = tmp_path / "systemd"
    units.mkdir()
    (units / "llmfleet-glm.service").write_text(
        f"[Service]\nEnvironment=LLMFLEET_MODEL_DIR={mdir}/{REV}\nExecStart=/opt/llmfleet/bin/llmfleet exec -- vllm serve {mdir}/{REV}\n"
    )
    (units / "llmfleet-other.service").write_text(f"[Service]\nExecStart=/bin/true {mdir}/current\n")
    res = store.gc(str(mdir), keep=1, unit_glob=str(units / "llmfleet-*.service"))
    assert res["removed"] == [] and res["kept_in_use"] == [REV]
    assert res["kept"][REV] == f"named by {units / 'llmfleet-glm.service'}"
    assert (mdir / REV).is_dir()


def test_units_count_with_drop_ins_and_environment_files(tmp_path):
    mdir = staged(tmp_path, [REV, REV2, REV3])
    units = tmp_path / "systemd"
    (units / "llmfleet-a.service.d").mkdir(parents=True)
    (units / "llmfleet-a.service").write_text(
        f"[Service]\nEnvironmentFile=-{tmp_path}/engine.env\nExecStart=/bin/true\n"
    )
    (tmp_path / "engine.env").write_text(f"MODEL={mdir}/{REV}\n")
    res = store.gc(str(mdir), keep=1, unit_glob=str(units / "llmfleet-*.service"))
    assert res["kept"][REV] == f"named by {units / 'llmfleet-a.service'}"
    (tmp_path / "engine.env").write_text("MODEL=/elsewhere\n")
    (units / "llmfleet-a.service.d" / "pin.conf").write_text(
        f"[Service]\nEnvironment=M={os.path.realpath(mdir)}/{REV}\n"
    )
    res = store.gc(str(mdir), keep=1, unit_glob=str(units / "llmfleet-*.service"))
    assert res["kept_in_use"] == [REV] and res["removed"] == []


def test_an_unreadable_unit_stops_revision_deletion(tmp_path):
    mdir = staged(tmp_path, [REV, REV2, REV3])
    units = tmp_path / "systemd"
    (units / "llmfleet-a.service").mkdir(parents=True)  # reading it fails (a directory), as root or not
    res = store.gc(str(mdir), keep=1, unit_glob=str(units / "llmfleet-*.service"))
    assert res["removed"] == [] and "no revision deleted" in res["skipped"]
    assert res["kept"][REV] == "an engine unit could not be read"


@pytest.mark.parametrize("how", ["argv", "environment"])
def test_a_revision_a_process_names_is_kept(tmp_path, how):
    """A running engine that closed its files: its argv (`--model=<dir>`) or environment names the revision."""
    mdir = staged(tmp_path, [REV, REV2, REV3])
    path = f"{mdir}/{REV}"
    argv = [sys.executable, "-c", "import time; time.sleep(60)"]
    env = dict(os.environ)
    if how == "argv":
        argv.append(f"--model={path}")
    else:
        env["LLMFLEET_MODEL_DIR"] = path
    holder = subprocess.Popen(argv, env=env, cwd=tmp_path)
    try:
        time.sleep(0.2)
        res = store.gc(str(mdir), keep=1, unit_glob="")
    finally:
        holder.kill()
        holder.wait()
    assert res["removed"] == [] and res["kept"][REV].startswith(f"in use by pid {holder.pid} (")
    assert store.gc(str(mdir), keep=1, unit_glob="")["removed"] == [REV]


def test_keep_0_without_activate_keeps_what_was_just_staged(tmp_path):
    """Before: keep<=0 with activate false deleted the revision the run had just published."""
    src = make_checkpoint(tmp_path / "shared" / "m", shards=1)
    req = stage.StageRequest(root=str(tmp_path / "nvme"), model="m", revision=REV, manifest=build_manifest(str(src)),
                             keep=0, activate=False, unit_glob="")  # fmt: skip
    r = stage.stage(req, lambda rel: [stage.LocalSource(str(src))])
    assert (tmp_path / "nvme" / "m" / REV).is_dir() and r["gc"]["removed"] == []
    assert r["gc"]["kept"] == {REV: "just staged"}
    again = stage.stage(req, lambda rel: [stage.LocalSource(str(src))])
    assert again["changed"] is False and (tmp_path / "nvme" / "m" / REV).is_dir()


def test_deletions_make_the_run_changed_and_are_reported(tmp_path):
    """Before: a rerun on a published revision said changed=false even when GC deleted revisions."""
    mdir = staged(tmp_path, [REV, REV2, REV3])
    src = tmp_path / "shared" / REV2[:4]
    req = stage.StageRequest(root=str(mdir.parent), model="m", revision=REV2, manifest=build_manifest(str(src)),
                             keep=1, unit_glob="")  # fmt: skip
    r = stage.stage(req, lambda rel: [stage.LocalSource(str(src))])
    assert r["bytes_copied"] == 0 and r["changed"] is True
    assert r["gc"]["removed"] == [REV]
    assert r["gc"]["kept"] == {REV2: "current; just staged", REV3: "one of the newest 1"}
    assert store.read_record(str(mdir), REV) is None


def test_abandoned_partials_are_collected_but_not_one_a_live_run_writes(tmp_path):
    mdir = staged(tmp_path, [REV2])
    (mdir / f".partial-{REV3}").mkdir()
    (mdir / f".partial-{REV3}" / "model.safetensors").write_bytes(b"x" * 100)
    os.chmod(mdir / f".partial-{REV3}", 0o555)  # a crash left it read-only: still collected
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from llmfleet.stage import store; l = store.ModelLock(sys.argv[1], 'r' * 40); "
         "l.acquire(); print('locked', flush=True); time.sleep(60)", str(mdir)],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "locked"
        res = store.gc(str(mdir), keep=1, unit_glob="")
    finally:
        holder.kill()
        holder.wait()
    assert res["removed_partials"] == []
    assert res["kept"][f".partial-{REV3}"].startswith(f"a staging run holds the model lock: pid {holder.pid} on ")
    res = store.gc(str(mdir), keep=1, unit_glob="")
    assert res["removed_partials"] == [f".partial-{REV3}"] and not (mdir / f".partial-{REV3}").exists()


def test_a_staging_run_collects_other_revisions_partials(tmp_path):
    mdir = staged(tmp_path, [REV])
    (mdir / f".partial-{REV3}").mkdir()
    src = tmp_path / "shared" / REV[:4]
    req = stage.StageRequest(root=str(mdir.parent), model="m", revision=REV, manifest=build_manifest(str(src)),
                             unit_glob="")  # fmt: skip
    r = stage.stage(req, lambda rel: [stage.LocalSource(str(src))])
    assert r["changed"] is True and r["gc"]["removed_partials"] == [f".partial-{REV3}"]
