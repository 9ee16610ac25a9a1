"""`site.yml --check` before the first run, on fresh lab nodes: nothing staged anywhere, no runtime, no units. The
engine is given the fleet contract's revision, so it plans with the revision directory staging would publish and
says what it would install and start, instead of failing on a model that is not there yet. Then nothing has changed.

The first integration module in file order, so the session's fresh lab (conftest.lab) is still fresh here; when
run after others, the NVMe is wiped first (cheap: no reboot).
"""

import re

from tests.integration.conftest import LAB_NODES, run_ansible, ssh

REV = "5eed5eed5eed5eed5eed5eed5eed5eed5eed5eed"  # inventory/lab/group_vars/all.yml
REV_DIR = f"/mnt/nvme/models/demo-model/{REV}"
NODES = [f"node{i}" for i in range(1, LAB_NODES + 1)]


def test_site_check_on_a_fresh_fleet_says_what_the_engine_would_install_and_start(lab, tmp_path):
    for i, n in enumerate(NODES, 1):
        if ssh(lab, n, f"test -e {REV_DIR}", check=False).returncode == 0:
            lab.wipe_nvme(lab.node(i))
        assert ssh(lab, n, "systemctl is-active llmfleet-demo.service", check=False).stdout.strip() != "active", n

    cp = run_ansible("ansible-playbook", "playbooks/site.yml", "--check", "-e", f"llmfleet_report_dir={tmp_path}",
                     check=False)  # fmt: skip
    out = " ".join(cp.stdout.split())  # the callback folds long messages
    assert cp.returncode == 0, cp.stdout[-6000:]
    # model_stage predicts the copy; the engine plans with what it would publish instead of failing on it
    assert "shared storage read by 1 node(s)" in out, out[-6000:]
    assert "does not exist on" not in out
    for rank, n in enumerate(NODES):
        api = ", serves the API on port 30000" if rank == 0 else ""
        line = re.search(rf"check mode: {n} \(node rank {rank}{re.escape(api)}\) would install "
                         rf"/etc/systemd/system/llmfleet-demo\.service and start it once this run has put in place "
                         rf"([^:]*): (\S+/sglang serve [^']*)", out)  # fmt: skip
        assert line, (n, out[-6000:])
        assert f"the revision {REV_DIR} (model_stage)" in line.group(1), line.group(1)
        assert f"--model-path {REV_DIR} " in line.group(2) and "/current" not in line.group(2), line.group(2)
    assert (f"check mode: demo would run sglang (TP 2 x PP {LAB_NODES}) on {LAB_NODES} node(s), "
            f"{', '.join(NODES)} (the head first), loading {REV_DIR} (revision {REV})") in out, out[-4000:]  # fmt: skip
    # check mode changed nothing on the nodes
    for n in NODES:
        assert ssh(lab, n, f"test -e {REV_DIR} || test -e /etc/systemd/system/llmfleet-demo.service",
                   check=False).returncode != 0, n  # fmt: skip


def test_site_check_where_staging_reached_some_nodes_only(lab, tmp_path):
    """The case a first run leaves behind when staging stopped part-way: the revision is on node3 and node4 only.
    model_stage predicts that the others fetch it from those nodes, and the engine plans with it on every node
    (it once failed: 'engine_model_path .../current does not exist on node1, node2')."""
    have, lack = NODES[2:], NODES[:2]
    try:
        run_ansible("ansible-playbook", "playbooks/model_stage.yml", "--limit", ",".join(have),
                    "-e", f"llmfleet_report_dir={tmp_path}")  # fmt: skip
        cp = run_ansible("ansible-playbook", "playbooks/site.yml", "--check", "-e", f"llmfleet_report_dir={tmp_path}",
                         check=False)  # fmt: skip
        out = " ".join(cp.stdout.split())
        assert cp.returncode == 0, cp.stdout[-6000:]
        fetch = f"no node reads shared storage: {', '.join(lack)} fetch it from the nodes that have it"
        assert fetch in out, out[-6000:]
        assert "does not exist on" not in out
        for n in NODES:
            line = re.search(rf"check mode: {n} \(node rank \d[^)]*\) would install \S+ and start it once this run has "
                             rf"put in place ([^:]*): (\S+/sglang serve [^']*)", out)  # fmt: skip
            assert line, (n, out[-6000:])
            # staging publishes the revision where it lacks; where it is, only the runtime is still to come
            assert (f"the revision {REV_DIR} (model_stage)" in line.group(1)) == (n in lack), line.group(1)
            assert f"--model-path {REV_DIR} " in line.group(2), line.group(2)
    finally:
        for i in range(1, LAB_NODES + 1):  # leave the NVMe as found: later modules count what staging reads
            lab.wipe_nvme(lab.node(i))
