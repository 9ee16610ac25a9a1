"""The fleet as the on-call commands read it from an Ansible inventory (ansible-core's own reader + Templar)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import yaml
from test_oncall_fakes import lab_inventory

from llmfleet import fleet_inventory
from llmfleet.fleet_inventory import DEFAULTS, InventoryError, load_fleet, node_order, parse_extra_vars, parse_ssh_args

ROOT = Path(__file__).resolve().parents[2]


def _inventory(
    tmp_path: Path, groups: dict, all_vars: dict | None = None, host_vars: dict | None = None, name: str = "inv"
) -> Path:
    """hosts.yml: groups is {group: [hosts]} under llmfleet_nodes (in that order)."""
    children = {g: {"hosts": {h: (host_vars or {}).get(h) for h in hs}} for g, hs in groups.items()}
    inv = {"all": {"children": {"llmfleet_nodes": {"children": children}}, "vars": all_vars or {}}}
    d = tmp_path / name
    d.mkdir()
    (d / "hosts.yml").write_text(json.dumps(inv))
    return d


def test_lab_inventory_resolves_templated_connection_vars(tmp_path):
    """inventory/lab's group_vars template ansible_user/ansible_become from lab_operator: they must resolve."""
    inv, lab = lab_inventory(tmp_path)
    fleet = load_fleet([str(inv)])
    assert fleet.deployment == "demo" and fleet.unit() == "llmfleet-demo.service"
    assert fleet.router_unit() == "llmfleet-demo-router.service"
    assert [n.name for n in fleet.nodes] == ["node1", "node2", "node3"] and fleet.head.head and fleet.head.rank == 0
    n = fleet.nodes[1]
    assert n.ssh.user == "ops" and n.become is True and n.become_user == "root"
    assert n.ssh.config_file == str(lab.ssh_config) and n.ssh.host == "10.99.0.12"
    assert n.engine_dir == "/var/lib/llmfleet/engine/demo"
    assert n.probe_argv("{}") == ["sudo", "-n", "-u", "root", "--", "/usr/bin/python3", "-I", "-S", "-", "{}"]


def test_extra_vars_override_like_ansible(tmp_path):
    inv, _ = lab_inventory(tmp_path)
    fleet = load_fleet([str(inv)], extra_vars={"lab_operator": "root"})
    n = fleet.nodes[0]
    assert n.ssh.user == "root" and n.become is False
    assert n.probe_argv("{}") == ["/usr/bin/python3", "-I", "-S", "-", "{}"]


def test_example_inventory():
    fleet = load_fleet([str(ROOT / "inventory" / "example-h20")])
    assert fleet.deployment == "glm-h20"
    assert [n.name for n in fleet.nodes] == ["h20-node01", "h20-node02", "h20-node03", "h20-node04"]
    assert fleet.nodes[2].ssh.host == "192.0.2.13" and fleet.nodes[2].become
    assert fleet.nodes[0].ssh.config_file is None


def test_head_first_then_inventory_order(tmp_path):
    inv = _inventory(tmp_path, {"worker": ["w2", "w1"], "head": ["h"], "more": ["w0"]})
    fleet = load_fleet([str(inv)])
    assert [n.name for n in fleet.nodes] == ["h", "w2", "w1", "w0"]
    assert [n.rank for n in fleet.nodes] == [0, 1, 2, 3]


@pytest.mark.parametrize(
    ("hosts", "heads"),
    [(["a", "b", "c"], ["b"]), (["a", "b"], []), (["a", "b"], ["x"]), (["c", "b", "a"], ["a", "c"]), ([], ["a"])],
)
def test_node_order_is_the_filter_plugins_rule(hosts, heads):
    """The roles' node ranks come from filter_plugins' llmfleet_node_order: on-call must agree with it."""
    spec = importlib.util.spec_from_file_location("llmfleet_filters", ROOT / "filter_plugins" / "llmfleet_filters.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert node_order(hosts, heads) == mod.llmfleet_node_order(hosts, heads)


def test_defaults_are_the_roles_defaults():
    """DEFAULTS mirrors the roles' defaults; a role default changing must change it too."""
    roles = {}
    for role in ("llmfleet", "engine"):
        roles.update(yaml.safe_load((ROOT / "roles" / role / "defaults" / "main.yml").read_text()))
    for key, value in DEFAULTS.items():
        assert key in roles, f"{key} is no longer a role default"
        assert roles[key] == value, f"{key}: role default {roles[key]!r}, on-call assumes {value!r}"


def test_role_derived_paths_follow_inventory_overrides(tmp_path):
    inv = _inventory(
        tmp_path,
        {"head": ["h"]},
        {"llmfleet_state_dir": "/srv/llm", "llmfleet_config_dir": "/srv/etc", "engine_profile": "vllm"},
        {"h": {"engine_port": 9000, "ansible_python_interpreter": "auto_silent"}},
    )
    n = load_fleet([str(inv)], deployment="other").head
    assert n.engine_dir == "/srv/llm/engine/other"
    assert n.fabric_env == "/srv/etc/fabric.env"
    assert (n.profile, n.engine_port, n.python) == ("vllm", 9000, "/usr/bin/python3")


def test_ssh_settings_from_host_vars(tmp_path):
    cfg = tmp_path / "ssh_config"
    cfg.write_text("Host *\n  User nobody\n")
    inv = _inventory(
        tmp_path,
        {"head": ["h"]},
        host_vars={
            "h": {
                "ansible_host": "10.0.0.5",
                "ansible_port": "2222",
                "ansible_user": "op",
                "ansible_ssh_private_key_file": "~/keys/id",
                "ansible_ssh_common_args": f"-F {cfg} -o StrictHostKeyChecking=no -i /k2",
                "ansible_host_key_checking": "false",
            }
        },
    )
    s = load_fleet([str(inv)]).head.ssh
    assert (s.host, s.port, s.user, s.config_file) == ("10.0.0.5", 2222, "op", str(cfg))
    assert s.key_files == [str(Path("~/keys/id").expanduser()), "/k2"]
    assert s.options == {"stricthostkeychecking": "no"} and s.host_key_checking is False


@pytest.mark.parametrize(
    ("text", "expect"),
    [
        ("", (None, {}, [])),
        ("-F /x/ssh_config", ("/x/ssh_config", {}, [])),
        ("-F/x -oUser=bob -o 'ProxyJump jump' -C -v", ("/x", {"user": "bob", "proxyjump": "jump"}, [])),
        ("-o StrictHostKeyChecking=no -o StrictHostKeyChecking=yes", (None, {"stricthostkeychecking": "no"}, [])),
        (
            "-p 2200 -l alice -J bastion -i /k",
            (None, {"port": "2200", "user": "alice", "proxyjump": "bastion"}, ["/k"]),
        ),
    ],
)
def test_parse_ssh_args(text, expect):
    assert parse_ssh_args(text) == expect


@pytest.mark.parametrize("text", ["-F", "-o 'unterminated"])
def test_parse_ssh_args_bad(text):
    with pytest.raises(InventoryError, match="ansible_ssh_common_args"):
        parse_ssh_args(text)


def test_extra_vars():
    assert parse_extra_vars(["a=1", "b=x=y"]) == {"a": "1", "b": "x=y"}
    with pytest.raises(InventoryError, match="KEY=VALUE"):
        parse_extra_vars(["novalue"])


def test_no_inventory(tmp_path, monkeypatch):
    with pytest.raises(InventoryError, match=r"nope: no such file"):
        load_fleet([str(tmp_path / "nope")])
    monkeypatch.setattr(fleet_inventory, "default_sources", lambda: ["/etc/ansible/none-here"])
    with pytest.raises(InventoryError, match=r"none given: pass -i INVENTORY"):
        load_fleet(None)


def test_no_hosts(tmp_path):
    (tmp_path / "hosts.yml").write_text("all: {}\n")
    with pytest.raises(InventoryError, match="no hosts"):
        load_fleet([str(tmp_path / "hosts.yml")])


def test_no_such_group(tmp_path):
    inv = _inventory(tmp_path, {"head": ["h"]}, {"llmfleet_node_group": "gpu_nodes"})
    with pytest.raises(
        InventoryError, match=r"no group 'gpu_nodes' \(llmfleet_node_group\); groups: head, llmfleet_nodes"
    ):
        load_fleet([str(inv)])


@pytest.mark.parametrize(("groups", "holds"), [({"head": ["a", "b"]}, "['a', 'b']"), ({"worker": ["a"]}, "none")])
def test_exactly_one_head(tmp_path, groups, holds):
    inv = _inventory(tmp_path, groups)
    with pytest.raises(InventoryError, match=rf"'head' \(llmfleet_head_group\) must hold exactly one host.*{holds}"):
        load_fleet([str(inv)])


def test_bad_deployment_names(tmp_path):
    inv = _inventory(tmp_path, {"head": ["h"]})
    with pytest.raises(InventoryError, match="deployment 'Bad_Name'"):
        load_fleet([str(inv)], deployment="Bad_Name")
    inv2 = _inventory(tmp_path, {"head": ["h"]}, {"llmfleet_deployment": "x/y"}, name="inv2")
    with pytest.raises(InventoryError, match="llmfleet_deployment 'x/y' is not a valid"):
        load_fleet([str(inv2)])


def test_nodes_disagree_on_deployment(tmp_path):
    inv = _inventory(tmp_path, {"head": ["h"], "worker": ["w"]}, host_vars={"w": {"llmfleet_deployment": "other"}})
    with pytest.raises(InventoryError, match=r"nodes disagree on llmfleet_deployment \(main: h; other: w\)"):
        load_fleet([str(inv)])


def test_unresolvable_variable_names_host_and_variable(tmp_path):
    inv = _inventory(tmp_path, {"head": ["h"]}, {"ansible_user": "{{ no_such_var }}"})
    with pytest.raises(InventoryError, match=r"host h: cannot resolve ansible_user"):
        load_fleet([str(inv)])


def test_only_used_variables_are_templated(tmp_path):
    """A variable on-call does not use (a vaulted API key, a broken template) never stops it."""
    inv = _inventory(tmp_path, {"head": ["h"]}, {"llmfleet_api_key": "{{ vault_key_not_loaded }}"})
    assert load_fleet([str(inv)]).head.name == "h"


def test_become_method_other_than_sudo_is_refused(tmp_path):
    inv = _inventory(tmp_path, {"head": ["h"]}, {"ansible_become": True, "ansible_become_method": "su"})
    with pytest.raises(InventoryError, match=r"ansible_become_method 'su'.*sudo -n"):
        load_fleet([str(inv)])


def test_missing_ssh_config_file(tmp_path):
    inv = _inventory(tmp_path, {"head": ["h"]}, {"ansible_ssh_common_args": "-F /nowhere/ssh_config"})
    with pytest.raises(InventoryError, match=r"host h: ssh config /nowhere/ssh_config .*no such file"):
        load_fleet([str(inv)])


def test_unsupported_connection(tmp_path):
    inv = _inventory(tmp_path, {"head": ["h"]}, {"ansible_connection": "winrm"})
    with pytest.raises(InventoryError, match="ansible_connection 'winrm' is not supported"):
        load_fleet([str(inv)])


def test_limit_narrows_the_fleet_like_ansible_playbook(tmp_path):
    """--limit: a deployment on part of an inventory (the lab runs one on node1-2 of 3). Ranks follow the kept
    nodes; a limit without the head, or matching nothing, is refused with what to do."""
    inv, _ = lab_inventory(tmp_path)
    fleet = load_fleet([str(inv)], limit="node1,node2")
    assert [(n.name, n.rank) for n in fleet.nodes] == [("node1", 0), ("node2", 1)]
    assert [n.name for n in load_fleet([str(inv)], limit="all:!node2").nodes] == ["node1", "node3"]
    with pytest.raises(InventoryError, match=r"leaves out the head node1 .*include the head"):
        load_fleet([str(inv)], limit="node2,node3")
    with pytest.raises(InventoryError, match=r"--limit 'nodeX' matches no host of 'llmfleet_nodes'"):
        load_fleet([str(inv)], limit="nodeX")
