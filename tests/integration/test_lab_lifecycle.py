"""Bring-up and teardown are idempotent and leave nothing behind (own lab name and subnet, so
this runs beside the shared session lab)."""

import pytest

from tests.lab import labctl


@pytest.fixture
def scratch_lab(tmp_path):
    lab = labctl.Lab(name="lct", subnet="10.78.0", state_root=tmp_path)
    yield lab
    lab.down()


def test_down_leaves_nothing(scratch_lab):
    lab = scratch_lab
    lab.up(2)
    lab.up(2)  # idempotent
    left = lab.leftovers()
    # The detector must see a running lab, otherwise "nothing left" below would prove nothing.
    assert len(left["netns"]) == 2 and len(left["processes"]) >= 4 and left["cgroups"]
    assert {"lct-node1", "lct-node2", "lct-br0"} <= set(left["links"])
    pids = [lab.node(i).systemd_pid() for i in (1, 2)]
    lab.down()
    lab.down()  # idempotent
    assert lab.leftovers() == {"netns": [], "links": [], "processes": [], "cgroups": [], "mounts": []}
    for pid in pids:
        assert labctl._proc_state(pid) is None, f"node systemd {pid} still running"


def test_shrinking_stops_extra_nodes(scratch_lab):
    lab = scratch_lab
    lab.up(3)
    n3 = lab.node(3).systemd_pid()
    lab.up(2)
    assert labctl._proc_state(n3) is None
    assert lab.leftovers()["netns"] == ["lct-node1", "lct-node2"]
    assert "lct-node3" not in (lab.state / "hosts").read_text() and "node3" not in (lab.state / "hosts").read_text()


def test_stale_pieces_are_cleaned(scratch_lab):
    """A crashed run can leave a netns/link/cgroup without a node: down removes them anyway."""
    lab = scratch_lab
    labctl.run(["ip", "netns", "add", "lct-node7"])
    lab.cgroup.mkdir(exist_ok=True)
    (lab.cgroup / "node7").mkdir()
    lab.down()
    assert lab.leftovers() == {"netns": [], "links": [], "processes": [], "cgroups": [], "mounts": []}


def test_fresh_reboots_running_nodes_and_forgets_their_units(scratch_lab):
    """`make demo` leaves engine units running; the test session's lab must not inherit them."""
    lab = scratch_lab
    lab.up(1)
    node = lab.node(1)
    node.nsenter("systemd-run", "--unit=left-by-demo", "sleep", "600", check=True)
    assert node.nsenter("systemctl", "is-active", "left-by-demo").stdout.strip() == "active"
    before = node.systemd_pid()
    lab.up(1)  # reuse: the leftover is still there
    assert node.systemd_pid() == before
    lab.up(1, fresh=True)
    assert node.systemd_pid() != before
    assert node.nsenter("systemctl", "is-active", "left-by-demo").stdout.strip() == "inactive"


def test_nodes_have_an_operator_account_with_sudo(scratch_lab):
    lab = scratch_lab
    lab.up(1)
    node = lab.node(1)
    out = node.nsenter("su", "-s", "/bin/sh", "ops", "-c", "id -un; sudo -n id -u").stdout.split()
    assert out == ["ops", "0"], out
    keys = node.nsenter("stat", "-c", "%U %a", "/home/ops/.ssh/authorized_keys").stdout.split()
    assert keys == ["ops", "600"]


def test_a_checkout_cloned_again_at_the_same_path_is_not_reused(tmp_path):
    """A node mounts the checkout's directory, not its path: after `rm -rf X && git clone … X` a running
    node would show the old, deleted tree (no .venv), so `up` must boot it again."""
    proj = tmp_path / "checkout"
    proj.mkdir()
    (proj / "marker").write_text("old")
    lab = labctl.Lab(name="lcu", subnet="10.79.0", state_root=tmp_path / "state", project=proj)
    try:
        lab.up(1)
        before = lab.node(1).systemd_pid()
        lab.up(1)
        assert lab.node(1).systemd_pid() == before  # same checkout: reused
        import shutil

        shutil.rmtree(proj)
        proj.mkdir()
        (proj / "marker").write_text("new")
        lab.up(1)
        assert lab.node(1).systemd_pid() != before
        assert lab.node(1).nsenter("cat", f"{proj}/marker").stdout == "new"
    finally:
        lab.down()
