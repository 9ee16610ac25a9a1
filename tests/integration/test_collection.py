"""site.yml from the installed collection on the lab, as a site runs it: the collection built from this checkout and
installed into an empty collections path, `ansible-playbook llmfleet.fleet.site -i inventory/lab` from a directory
outside the checkout whose ansible.cfg is the site's own (the collections path, the run callback enabled, pipelining;
none of llmfleet's settings), no ANSIBLE_* of the suite, connecting as the operator `ops` with become (the lab
inventory's group_vars). The ops host's Python finds no llmfleet package of its own: a decoy on PYTHONPATH fails any
`python -m llmfleet` that does not take the collection's package."""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import time

import pytest

from tests.helpers import collection
from tests.integration.conftest import LAB_NODES, ROOT, ssh

NODES = [f"node{i}" for i in range(1, LAB_NODES + 1)]


@pytest.fixture(scope="module")
def site(lab, tmp_path_factory):
    base = tmp_path_factory.mktemp("site")
    _, installed = collection.build_and_install(base)
    work = base / "site"
    work.mkdir()
    (work / "ansible.cfg").write_text(
        f"""[defaults]
collections_path = {installed.parents[2]}
callbacks_enabled = llmfleet.fleet.llmfleet_run
forks = 64
[ssh_connection]
pipelining = True
control_path_dir = {work}/cp
""",
        encoding="utf-8",
    )
    decoy = base / "decoy" / "llmfleet"
    decoy.mkdir(parents=True)
    (decoy / "__init__.py").write_text(
        "raise ImportError(\"the ops host's own llmfleet was imported, not the collection's package\")\n"
    )
    env = collection.site_env(installed.parents[2])
    env.pop("ANSIBLE_COLLECTIONS_PATH")  # the site's ansible.cfg names it
    env.update(ANSIBLE_CONFIG=str(work / "ansible.cfg"), PYTHONPATH=str(base / "decoy"), ANSIBLE_NOCOLOR="1")
    yield installed, work, env
    # Leave the lab as the other modules expect it: nothing serving, no unit failed, the NVMe empty.
    playbook(work, env, "llmfleet.fleet.engine_stop", "-e", f"llmfleet_report_dir={work}/reports")
    for i, n in enumerate(NODES, 1):
        ssh(lab, n, "systemctl reset-failed 'llmfleet-*' || true", check=False)
        lab.wipe_nvme(lab.node(i))


def playbook(work, env, *args, check=True):
    cp = subprocess.run([str(collection.BIN / "ansible-playbook"), "-i", str(ROOT / "inventory/lab"), *args],
                        cwd=work, env=env, capture_output=True, text=True, timeout=900, check=False)  # fmt: skip
    if check and cp.returncode != 0:
        raise AssertionError(
            f"ansible-playbook {' '.join(args)}: exit {cp.returncode}\n{cp.stdout[-6000:]}\n{cp.stderr[-3000:]}"
        )
    return cp


def test_site_from_the_installed_collection_as_ops(lab, site):
    installed, work, env = site
    reports = work / "reports"
    t0 = time.time()
    # The lab may serve from an earlier module: the ordered stop first, as an operator re-running site.yml would ask.
    playbook(work, env, "llmfleet.fleet.site", "-e", f"llmfleet_report_dir={reports}",
             "-e", "llmfleet_stop_before_checks=true")  # fmt: skip
    t1 = time.time()
    print(f"site.yml from the installed collection: {t1 - t0:.0f} s")
    # Every step passed, with the report the report role rendered with the collection's package.
    model = json.loads((reports / "demo" / "latest" / "report.json").read_text())
    assert model["status"] == "pass", model["verdict"]
    assert json.loads((reports / "acceptance-demo.json").read_text())["accepted"]
    # The collection's run callback (enabled by the site's ansible.cfg) kept how the run ended.
    run = json.loads((reports / "run-demo.json").read_text())
    assert run["outcome"] == "completed" and run["stopped"] is None, run
    # The node runtime the base role installed is the installed collection's package, on every node.
    want = hashlib.sha256((installed / "plugins/module_utils/llmfleet/__init__.py").read_bytes()).hexdigest()
    for n in NODES:
        got = ssh(lab, n, "sha256sum /opt/llmfleet/lib/llmfleet/__init__.py").stdout.split()[0]
        assert got == want, n
    # Serving, under root's systemd (become).
    assert ssh(lab, "node1", "systemctl is-active llmfleet-demo.service", check=False).stdout.strip() == "active"
    # Ansible logged in as the operator on every node (its own SSH masters: the site's control_path_dir) and became
    # root with sudo. (The lab's own root logins, the test's and any lab status check, can fall in the same window.)
    for n in NODES:
        log = ssh(lab, n, f"journalctl -q --no-pager --since=@{int(t0)} --until=@{int(t1) + 1}").stdout
        users = set(re.findall(r"Accepted publickey for (\S+) from", log))
        assert "ops" in users, (n, users)
        assert re.search(r"sudo\[\d+\]: +ops : .*USER=root", log), (n, log[-3000:])
