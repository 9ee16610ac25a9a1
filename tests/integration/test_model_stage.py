"""model_stage on the lab, with real safetensors files: corruption blocks publish, kill -9 then
resume, ENOSPC keeps the previous revision, concurrent runs respect the fleet-wide reader cap."""

import json
import os
import shutil
import subprocess
import time

import pytest

from llmfleet.stage import checkpoint, lease
from llmfleet.stage.manifest import build_manifest
from tests.helpers.ckpt import make_checkpoint
from tests.integration.conftest import LAB_NODES, ROOT, ansible_env, kill_tree, run_ansible, ssh


def rev(tag: str) -> str:
    return (tag.encode().hex() * 40)[:40]


def stage_args(tmp_path, model, revision, **extra):
    ev = {
        "llmfleet_model": model,
        "llmfleet_model_revision": revision,
        "model_stage_source": f"/mnt/shared/{model}",
        "llmfleet_report_dir": str(tmp_path),
        **extra,
    }
    return ["ansible-playbook", "playbooks/model_stage.yml", "-e", json.dumps(ev)]


def report(tmp_path, model):
    return json.loads((tmp_path / f"stage-{model}.json").read_text())["nodes"]


def node_tree(lab, node, model):
    return ssh(lab, node, f"ls -A /mnt/nvme/models/{model} 2>/dev/null; true").stdout.split()


def fresh_model(lab, model, **kw):
    d = lab.shared / model
    shutil.rmtree(d, ignore_errors=True)
    return make_checkpoint(d, **kw)


def damage_truncate(d):
    p = d / "model-00002-of-00003.safetensors"
    with open(p, "r+b") as f:
        f.truncate(os.path.getsize(p) - 100)
    return "model-00002-of-00003.safetensors: truncated"


def damage_missing(d):
    os.remove(d / "model-00003-of-00003.safetensors")
    return "model-00003-of-00003.safetensors: missing_shard"


def damage_unsafe(d):
    idx = json.loads((d / checkpoint.INDEX_NAME).read_text())
    idx["weight_map"]["model.layers.0.w0.weight"] = "../../etc/passwd"
    (d / checkpoint.INDEX_NAME).write_text(json.dumps(idx))
    return "unsafe_path"


@pytest.mark.parametrize("damage", [damage_truncate, damage_missing, damage_unsafe], ids=lambda f: f.__name__)
def test_a_damaged_source_is_never_published(lab, tmp_path, damage):
    model = f"bad-{damage.__name__[7:]}"
    d = fresh_model(lab, model)
    expect = damage(d)
    cp = run_ansible(*stage_args(tmp_path, model, rev(model)), check=False)
    out = " ".join(cp.stdout.split())
    assert cp.returncode != 0
    assert expect in out and "not publishable" in out, out[-3000:]
    for i in range(1, LAB_NODES + 1):
        tree = node_tree(lab, f"node{i}", model)
        assert rev(model) not in tree and "current" not in tree, tree


def test_a_link_out_of_the_source_is_refused_by_name(lab, tmp_path):
    """A source file linked to a root-only file on the nodes would be staged as root, readable by every
    user, and served to peers: the play fails naming the link and where it points, nothing is staged."""
    model = "link-out"
    d = fresh_model(lab, model)
    (d / "notes.txt").symlink_to("/etc/shadow")
    cp = run_ansible(*stage_args(tmp_path, model, rev(model)), check=False)
    out = " ".join(cp.stdout.split())
    assert cp.returncode != 0
    assert "notes.txt is a link to /etc/shadow, outside the source" in out, out[-3000:]
    assert "model_stage_source_allow_links_into" in out
    for i in range(1, LAB_NODES + 1):
        tree = node_tree(lab, f"node{i}", model)
        assert rev(model) not in tree and "current" not in tree, tree


def _progress(lab, node, model, revision):
    cp = ssh(lab, node, f"cat /var/lib/llmfleet/stage/{model}-{revision}.progress.json", check=False)
    return json.loads(cp.stdout) if cp.returncode == 0 and cp.stdout.strip() else {}


def test_kill_9_mid_copy_then_resume(lab, tmp_path):
    model, revision = "resume", rev("resume")
    fresh_model(lab, model, shards=8, tensors_per_shard=4, shape=(512, 256))  # 8 MiB
    total = build_manifest(str(lab.shared / model))["total_bytes"]
    slow = stage_args(tmp_path, model, revision, model_stage_rate_limit_mib_s=1, model_stage_threads=1)
    proc = subprocess.Popen(
        slow, cwd=ROOT, env=ansible_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
    )
    try:
        deadline = time.monotonic() + 120
        while _progress(lab, "node1", model, revision).get("done_bytes", 0) < 2 * 2**20:
            assert time.monotonic() < deadline, "staging never got going"
            assert proc.poll() is None, proc.stdout.read().decode()[-3000:]
            time.sleep(0.3)
    finally:
        kill_tree(proc.pid)
        proc.wait()
    for i in range(1, LAB_NODES + 1):  # SIGKILL the node-side staging processes, as a crash would
        ssh(lab, f"node{i}", "pkill -9 -x llmfleet-stage; true")  # the detached staging job's process name
    time.sleep(1)
    tree = node_tree(lab, "node1", model)
    assert f".partial-{revision}" in tree and revision not in tree, tree  # nothing half-done is published
    run_ansible(*stage_args(tmp_path, model, revision))
    res = report(tmp_path, model)
    assert 0 < res["node1"]["bytes_copied"] < total, res["node1"]  # resumed: verified files were kept
    for i in range(1, LAB_NODES + 1):
        out = ssh(
            lab,
            f"node{i}",
            f"{lab.project}/.venv/bin/python -m llmfleet checkpoint verify /mnt/nvme/models/{model}/current --json",
        ).stdout
        assert json.loads(out)["ok"]
        assert f".partial-{revision}" not in node_tree(lab, f"node{i}", model)
    again = run_ansible(*stage_args(tmp_path, model, revision))
    assert all(r["bytes_copied"] == 0 and not r["changed"] for r in report(tmp_path, model).values())
    # Said as what it is ("read 0.00x the revision" read like a fault).
    out = " ".join(again.stdout.split())
    assert "every node already has it: nothing to copy." in out, out[-3000:]
    assert f"revision was already on all {LAB_NODES} nodes: nothing copied, shared storage not read." in out, out[
        -3000:
    ]


def test_disk_full_keeps_the_previous_revision(lab, tmp_path):
    model = "enospc"
    small = "/mnt/nvme/small"
    ssh(lab, "node1", f"mkdir -p {small} && mount -t tmpfs -o size=16m tmpfs {small}")
    try:
        fresh_model(lab, model, shards=4, tensors_per_shard=2, shape=(512, 512))  # 4 MiB
        common = {"llmfleet_model_root": small, "model_stage_keep": 3}
        run_ansible(*stage_args(tmp_path, model, rev("a"), **common), "-l", "node1")
        assert ssh(lab, "node1", f"readlink {small}/{model}/current").stdout.strip() == rev("a")
        # not enough room by the numbers: refused before copying, naming the node and the sizes
        cp = run_ansible(
            *stage_args(tmp_path, model, rev("a2"), model_stage_free_space_margin_gb=1, **common),
            "-l",
            "node1",
            check=False,
        )
        assert cp.returncode != 0 and "GiB free, staging needs" in cp.stdout and "node1" in cp.stdout
        # room by the numbers, then the disk fills up while copying
        fresh_model(lab, model, shards=6, tensors_per_shard=2, shape=(512, 512), seed=3)  # 6 MiB
        slow = stage_args(tmp_path, model, rev("b"), model_stage_rate_limit_mib_s=2, **common)
        proc = subprocess.Popen(
            [*slow, "-l", "node1"],
            cwd=ROOT,
            env=ansible_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        deadline = time.monotonic() + 60
        while _progress(lab, "node1", model, rev("b")).get("done_bytes", 0) == 0:
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.2)
        ssh(lab, "node1", f"dd if=/dev/zero of={small}/filler bs=1M 2>/dev/null; true")
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode != 0
        assert "disk full while copying" in " ".join(out.split()), out[-3000:]
        assert ssh(lab, "node1", f"readlink {small}/{model}/current").stdout.strip() == rev("a")
        ok = ssh(lab, "node1", f"{lab.project}/.venv/bin/python -m llmfleet checkpoint verify {small}/{model}/current")
        assert ok.returncode == 0
        assert rev("b") not in node_tree(lab, "node1", model)
    finally:
        ssh(lab, "node1", f"umount {small}; rmdir {small}", check=False)


def test_concurrent_runs_never_exceed_the_reader_cap(lab, tmp_path):
    runs = []
    for model in ("conc-a", "conc-b"):
        fresh_model(lab, model, shards=4, tensors_per_shard=2, shape=(512, 512))  # 4 MiB each
        (tmp_path / model).mkdir()
        args = stage_args(
            tmp_path / model, model, rev(model), model_stage_max_source_readers=1, model_stage_rate_limit_mib_s=2
        )
        runs.append(
            subprocess.Popen(
                args, cwd=ROOT, env=ansible_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            )
        )
    outs = [p.communicate(timeout=300)[0] for p in runs]
    assert [p.returncode for p in runs] == [0, 0], [o[-2000:] for o in outs]
    log = lab.shared_rw / "llmfleet" / "leases" / "readers.log"
    records = [json.loads(line) for line in log.read_text().splitlines()]
    labels = {r["label"] for r in records if r["event"] == "acquire"}
    assert {f"conc-a@{rev('conc-a')[:12]}", f"conc-b@{rev('conc-b')[:12]}"} <= labels  # both runs read the source
    assert lease.max_overlap(lease.intervals_from_log(str(log))) == 1
