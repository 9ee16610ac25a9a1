"""llmfleet.engine.reset: a deployment leaves a node by exact names, never through another account's link, and
keeps what another deployment (or a running process) still uses. On temporary trees standing in for the node's
/etc/systemd/system, /etc/llmfleet, /var/lib/llmfleet, the metrics directory, the model root and /proc."""

from __future__ import annotations

import os
import stat

import pytest

from llmfleet.engine import reset as rs

REV = "5eed5eed5eed5eed5eed5eed5eed5eed5eed5eed"
OTHER_REV = "0123456789abcdef0123456789abcdef01234567"
UNITS = ["llmfleet-demo.service", "llmfleet-demo-router.service"]


def write(path, text="x", mode=0o644):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(mode)
    return path


@pytest.fixture
def node(tmp_path):
    """A node with the deployment demo installed beside demo-b (the same naming, one character longer)."""
    units, cfg, state, metrics = tmp_path / "units", tmp_path / "etc", tmp_path / "state", tmp_path / "metrics"
    for d in ("demo", "demo-b"):
        write(units / f"llmfleet-{d}.service", f"[Service]\nExecStart=/x --model-path {tmp_path}/models/m/{REV}\n")
        write(cfg / "gpus" / f"{d}.json", "{}")
        write(cfg / "engine" / f"{d}.env", "A=1\n")
        write(cfg / "credentials" / f"{d}.api-key", "secret", 0o600)
        write(state / "engine" / d / "termination.json", "{}")
    write(units / "llmfleet-demo.service.d" / "override.conf", "[Service]\n")
    (units / "multi-user.target.wants").mkdir()
    (units / "multi-user.target.wants" / "llmfleet-demo.service").symlink_to(units / "llmfleet-demo.service")
    write(cfg / "credentials" / "demo.fabric-key", "k", 0o600)
    write(cfg / "credentials" / "demo.env-HF_TOKEN", "t", 0o600)
    write(metrics / "llmfleet_engine_demo.prom", 'x{deployment="demo"} 1\n')
    write(metrics / "llmfleet_engine_demo-b.prom", 'x{deployment="demo-b"} 1\n')
    return tmp_path


def demo_paths(n):
    return [str(n / "etc/gpus/demo.json"), str(n / "etc/engine/demo.env"), str(n / "state/engine/demo"),
            str(n / "metrics/llmfleet_engine_demo.prom")]  # fmt: skip


def run(n, check=False, **kw):
    args = {"deployment": "demo", "units": UNITS, "claim_dir": str(n / "etc/gpus"), "paths": demo_paths(n),
            "prefixes": [str(n / "etc/credentials/demo.")], "unit_dirs": [str(n / "units")],
            "unit_glob": str(n / "units/llmfleet-*.service"), "proc": str(n / "proc"), **kw}  # fmt: skip
    (n / "proc").mkdir(exist_ok=True)
    return rs.reset(check=check, **args)


def tree(root):
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if "proc" not in p.parts)


def test_check_mode_lists_everything_of_the_deployment_and_removes_nothing(node):
    before = tree(node)
    out = run(node, check=True)
    assert tree(node) == before
    removed = {os.path.relpath(p, node) for p in out["removed"]}
    assert removed == {
        "units/llmfleet-demo.service", "units/llmfleet-demo.service.d",
        "units/multi-user.target.wants/llmfleet-demo.service", "etc/gpus/demo.json", "etc/engine/demo.env",
        "state/engine/demo", "metrics/llmfleet_engine_demo.prom", "etc/credentials/demo.api-key",
        "etc/credentials/demo.env-HF_TOKEN", "etc/credentials/demo.fabric-key"}  # fmt: skip
    assert len(out["units_removed"]) == 3 and out["other_deployments"] == ["demo-b"]


def test_removes_only_the_deployment_then_nothing_is_left_to_remove(node):
    out = run(node)
    assert not out["refused"] and len(out["removed"]) == 10
    left = tree(node)
    assert not [p for p in left if "demo." in p or p.endswith(("/demo", "demo.service", "demo.json", "demo.prom"))]
    # demo-b, whose names start the same, is untouched
    for p in ("units/llmfleet-demo-b.service", "etc/gpus/demo-b.json", "etc/engine/demo-b.env",
              "etc/credentials/demo-b.api-key", "state/engine/demo-b/termination.json",
              "metrics/llmfleet_engine_demo-b.prom", "units/multi-user.target.wants"):  # fmt: skip
        assert p in left, p
    again = run(node)
    assert again["removed"] == [] and again["kept"] == [] and again["units_removed"] == []


def test_a_planted_link_is_unlinked_never_followed(node):
    victim = write(node / "victim" / "keep.txt", "precious")
    sd = node / "state/engine/demo"
    (sd / "cache").mkdir()
    (sd / "cache" / "to-victim").symlink_to(victim.parent)
    (sd / "victim-file").symlink_to(victim)
    # the deployment's env file swapped for a link to a file root must not remove
    (node / "etc/engine/demo.env").unlink()
    (node / "etc/engine/demo.env").symlink_to(victim)
    run(node)
    assert victim.read_text() == "precious" and not sd.exists() and not os.path.lexists(node / "etc/engine/demo.env")


def test_a_path_behind_another_accounts_link_is_refused(node):
    # A directory anyone may write, holding a link a non-root account could have made: root does not follow it.
    open_dir = node / "open"
    open_dir.mkdir()
    open_dir.chmod(0o777)
    (open_dir / "lnk").symlink_to(node / "state")
    out = run(node, paths=[str(open_dir / "lnk" / "engine" / "demo")])
    assert out["refused"] and "symlink" in out["refused"][0] and str(open_dir / "lnk") in out["refused"][0]
    assert (node / "state/engine/demo/termination.json").exists()


def test_labelled_textfiles_go_only_when_they_are_the_deployments(node):
    m = node / "metrics"
    write(m / "llmfleet_nccl_check.prom", 'llmfleet_collective_ok{deployment="demo",node="node1"} 1\n')
    out = run(node, labelled=[str(m / "llmfleet_nccl_check.prom")])
    assert str(m / "llmfleet_nccl_check.prom") in out["removed"] and not (m / "llmfleet_nccl_check.prom").exists()
    write(m / "llmfleet_nccl_check.prom", 'llmfleet_collective_ok{deployment="demo-b",node="node1"} 1\n')
    out = run(node, labelled=[str(m / "llmfleet_nccl_check.prom")])
    assert (m / "llmfleet_nccl_check.prom").exists() and out["kept"][0]["path"].endswith("llmfleet_nccl_check.prom")
    # a FIFO (or a link) at the name is never opened
    (m / "llmfleet_nccl_check.prom").unlink()
    os.mkfifo(m / "llmfleet_nccl_check.prom")
    out = run(node, labelled=[str(m / "llmfleet_nccl_check.prom")])
    assert stat.S_ISFIFO(os.lstat(m / "llmfleet_nccl_check.prom").st_mode) and out["kept"] == []


def staged(n, rev=REV):
    mdir = n / "models" / "m"
    write(mdir / rev / "config.json", "{}", 0o444)
    (mdir / rev).chmod(0o555)
    write(mdir / ".records" / f"{rev}.json", "{}")
    if not os.path.lexists(mdir / "current"):
        (mdir / "current").symlink_to(rev)
    return mdir


def test_a_revision_another_deployments_unit_names_stays(node):
    mdir = staged(node)
    out = run(node, revisions=[str(mdir / REV)])
    assert (mdir / REV / "config.json").exists()
    assert out["kept"] == [{"path": str(mdir / REV), "why": f"named by {node}/units/llmfleet-demo-b.service"}]


def test_the_revision_current_and_the_empty_model_dir_go_when_no_one_else_uses_them(node):
    mdir = staged(node)
    (node / "units/llmfleet-demo-b.service").write_text("[Service]\nExecStart=/x\n")
    check = run(node, check=True, revisions=[str(mdir / REV)])
    assert (mdir / REV).is_dir()
    assert {str(mdir / REV), str(mdir / ".records" / f"{REV}.json"), str(mdir / "current"), str(mdir)} <= set(
        check["removed"]
    )
    out = run(node, revisions=[str(mdir / REV)])
    assert not mdir.exists() and (node / "models").is_dir()
    assert [p for p in out["removed"] if p.startswith(str(mdir))] == [
        p for p in check["removed"] if p.startswith(str(mdir))
    ]


def test_the_model_dir_stays_with_another_revision_and_current_stays_on_it(node):
    mdir = staged(node)
    staged(node, OTHER_REV)
    (mdir / "current").unlink()
    (mdir / "current").symlink_to(OTHER_REV)
    (node / "units/llmfleet-demo-b.service").write_text("[Service]\nExecStart=/x\n")
    run(node, revisions=[str(mdir / REV)])
    assert not (mdir / REV).exists() and (mdir / OTHER_REV).is_dir() and os.readlink(mdir / "current") == OTHER_REV


def fake_pid(n, pid, cgroup, argv):
    p = n / "proc" / str(pid)
    p.mkdir(parents=True)
    (p / "cgroup").write_text(f"0::{cgroup}\n")
    (p / "cmdline").write_bytes(b"\0".join(a.encode() for a in argv))
    (p / "comm").write_text(argv[0] + "\n")


def test_a_process_outside_the_deployment_keeps_the_revision_its_own_engine_does_not(node):
    mdir = staged(node)
    (node / "units/llmfleet-demo-b.service").write_text("[Service]\nExecStart=/x\n")
    (node / "proc").mkdir()
    # check mode: the deployment's own engine still runs (a real reset has stopped it)
    fake_pid(node, 4242, "/system.slice/llmfleet-demo.service", ["sglang", "--model-path", f"{mdir}/{REV}"])
    out = run(node, check=True, revisions=[str(mdir / REV)])
    assert str(mdir / REV) in out["removed"] and out["kept"] == []
    fake_pid(node, 4343, "/user.slice/session-1.scope", ["python", f"{mdir}/{REV}/config.json"])
    out = run(node, revisions=[str(mdir / REV)])
    assert (mdir / REV).is_dir() and out["kept"][0]["why"] == "in use by pid 4343 (python)"


def test_a_revision_path_must_be_a_revision(node):
    with pytest.raises(ValueError, match="not a revision directory"):
        run(node, revisions=[str(node / "models" / "m" / "current")])


def test_the_runtime_stays_while_another_deployment_is_installed(node):
    rt = write(node / "opt/llmfleet/lib/llmfleet/__init__.py").parent.parent.parent
    out = run(node, shared=[str(rt)])
    assert rt.is_dir() and out["kept"] == [{"path": str(rt), "why": "still used by deployment(s) demo-b on this node"}]
    # counted from the units too: a unit file without a claim (a deployment stopped with its claim released)
    (node / "etc/gpus/demo-b.json").unlink()
    assert run(node, shared=[str(rt)])["kept"] and rt.is_dir()
    (node / "units/llmfleet-demo-b.service").unlink()
    out = run(node, shared=[str(rt)])
    assert not rt.exists() and str(rt) in out["removed"]


def test_with_no_deployment_named_every_installed_one_counts(node):
    """The base role's runtime removal names none: the deployment's own claim keeps the runtime too."""
    for d in ("demo-b",):
        (node / "etc/gpus" / f"{d}.json").unlink()
        (node / "units" / f"llmfleet-{d}.service").unlink()
    rt = write(node / "opt/llmfleet/bin").parent
    out = rs.reset(deployment="", units=[], claim_dir=str(node / "etc/gpus"), shared=[str(rt)],
                   unit_dirs=[str(node / "units")])  # fmt: skip
    assert out["other_deployments"] == ["demo"] and rt.is_dir()


def test_other_deployments_counts_a_router_unit_as_its_deployments(tmp_path):
    for f in ("llmfleet-pd.service", "llmfleet-pd-router.service", "llmfleet-demo.service", "sshd.service"):
        write(tmp_path / f)
    (tmp_path / "llmfleet-x.service.d").mkdir()
    assert rs.other_deployments("demo", str(tmp_path / "none"), UNITS, [str(tmp_path)]) == ["pd"]
