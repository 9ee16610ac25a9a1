"""The lab's nodes behave like separate bare-metal hosts."""

from tests.integration.conftest import LAB_NODES, ssh


def test_each_node_is_its_own_systemd_host(lab):
    seen = {}
    for i in range(1, LAB_NODES + 1):
        out = ssh(
            lab,
            f"node{i}",
            "hostname; cat /etc/machine-id; cat /proc/1/comm; systemctl is-system-running; "
            "ip -4 -o addr show eth0 | awk '{print $4}'",
        ).stdout.split()
        assert out[0] == f"node{i}"
        assert out[2] == "systemd"
        if out[3] != "running":  # say which unit failed: what an earlier test left behind
            failed = ssh(
                lab, f"node{i}", "systemctl --failed --no-legend --plain; systemctl list-units --state=failed -o json"
            )
            raise AssertionError(f"node{i}: systemd state {out[3]}; failed units: {failed.stdout.strip()}")
        assert out[4] == f"{lab.subnet}.{10 + i}/24"
        seen[out[1]] = i
    assert len(seen) == LAB_NODES, "machine-ids are not distinct"


def test_node_writes_never_reach_the_host(lab, tmp_path):
    marker = "/etc/llmfleet-lab-write-probe"
    ssh(lab, "node1", f"echo hi > {marker}")
    assert ssh(lab, "node1", f"cat {marker}").stdout == "hi\n"
    assert not __import__("os").path.exists(marker)
    assert ssh(lab, "node2", f"test -e {marker}", check=False).returncode == 1


def test_disks_shared_and_project_mounts(lab):
    probe = (
        f"touch /mnt/shared/x 2>&1; touch {lab.project}/x 2>&1; echo n1 > /mnt/nvme/who; cat /proc/sys/kernel/hostname"
    )
    out = ssh(lab, "node1", probe, check=False).stdout
    assert out.count("Read-only file system") == 2, out
    assert ssh(lab, "node2", "cat /mnt/nvme/who 2>/dev/null || echo private", check=False).stdout.strip() == "private"
    assert (lab.node(1).dir / "nvme/who").read_text() == "n1\n"  # the node's NVMe is a host directory (a "disk")
    assert "Read-only" in ssh(lab, "node1", "echo 1 > /proc/sys/vm/overcommit_memory", check=False).stderr


def test_nodes_reach_each_other_over_eth0(lab):
    py = "import socket; s=socket.create_connection(('node2', 22), 3); print(s.recv(7).decode())"
    assert ssh(lab, "node1", f'python3 -c "{py}"').stdout.strip() == "SSH-2.0"


def test_project_venv_runs_on_nodes(lab):
    py = lab.project / ".venv/bin/python"
    out = ssh(lab, "node1", f"{py} -c 'import llmfleet, torch; print(llmfleet.__version__, torch.__version__)'").stdout
    assert out.split()[0] == __import__("llmfleet").__version__
    assert out.split()[1].startswith("2.")


def test_up_again_is_a_no_op(lab):
    before = [lab.node(i).systemd_pid() for i in range(1, LAB_NODES + 1)]
    lab.up(LAB_NODES)
    assert [lab.node(i).systemd_pid() for i in range(1, LAB_NODES + 1)] == before


def test_ansible_connects_as_the_operator_and_becomes_root(lab):
    from tests.integration.conftest import run_ansible

    plain = run_ansible(
        "ansible", "node1", "-m", "ansible.builtin.command", "-a", "id -un", "-e", "ansible_become=false"
    )
    assert "ops" in plain.stdout.splitlines()[-1], plain.stdout
    become = run_ansible("ansible", "node1", "-m", "ansible.builtin.command", "-a", "id -un")
    assert become.stdout.splitlines()[-1].strip() == "root", become.stdout
    # Root stays possible with one variable.
    root = run_ansible("ansible", "node1", "-m", "ansible.builtin.command", "-a", "id -un", "-e", "lab_operator=root")
    assert root.stdout.splitlines()[-1].strip() == "root", root.stdout
    # The node's system Python kept the bytecode of what those module runs imported from their AnsiballZ zips
    # (tests/lab/zipcache.py), per user, in private directories.
    cache = "~/.cache/llmfleet-lab-zipcache/*"
    for user in ("ops", "root"):
        out = ssh(lab, "node1", f"sudo -u {user} -H sh -c 'stat -c %a {cache} && ls {cache} | wc -l'").stdout.split()
        assert out[0] == "700" and int(out[1]) > 10, (user, out)
