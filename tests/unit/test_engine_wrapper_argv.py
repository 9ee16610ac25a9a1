"""The wrapper's command lines (ExecStart of the engine unit and of the P/D router unit) moved from Jinja in
roles/engine/vars/main.yml into Python (llmfleet.engine.plan.wrapper_args). Old vs new, through real
ansible-playbook runs: the Jinja of before (tests/fixtures/engine-role/wrapper-jinja-before.yml, verbatim) and
the role's vars and 'Build the wrapper command line' task of now render the same argv for every host of the
lab, example-h20 and device-h200 inventories, under each profile and the options that change the argv."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from llmfleet.engine.command import PlanError
from llmfleet.engine.plan import node_plan, wrapper_args

ROOT = Path(__file__).resolve().parents[2]
BEFORE = ROOT / "tests" / "fixtures" / "engine-role" / "wrapper-jinja-before.yml"
KEY = "sk-llmfleet-wrapper-unit-0123456789"  # a fake key: it must never reach an argv
SECRET = "hf_wrapper_unit_secret_0123456789"  # noqa: S105 (a fake secret the test looks for)
REV = "5eed5eed5eed5eed5eed5eed5eed5eed5eed5eed"

# Inventories: group_vars of the project's, hosts as their hosts.yml or labctl.py writes them.
LAB_HOSTS = {"head": {"lab1": {"ansible_host": "10.77.0.11", "llmfleet_fabric_ip": "10.77.0.11"}},
             "worker": {"lab2": {"ansible_host": "10.77.0.12", "llmfleet_fabric_ip": "10.77.0.12"},
                        "lab3": {"ansible_host": "10.77.0.13", "llmfleet_fabric_ip": "10.77.0.13"}}}  # fmt: skip
H200_HOSTS = {"head": {"h200": {"ansible_host": "127.0.0.1"}}}
# Variants: play vars over the inventory's (each a play of its own in one run). `pd_role` below picks a role per host.
PD_ROLE = "{{ 'decode' if inventory_hostname == ansible_play_hosts_all[-1] else 'prefill' }}"
VARIANTS = {
    "as-is": {},
    "keyed-secrets": {
        "llmfleet_api_key": KEY,
        "engine_secret_env": {"HF_TOKEN": SECRET, "A_TOKEN": SECRET},
        "engine_health_prompt": "2+2?",
        "engine_health_expect": "4",
    },
    "vllm": {"engine_profile": "vllm"},
    "vllm-keyed-private": {
        "engine_profile": "vllm",
        "llmfleet_api_key": KEY,
        "engine_host": "10.9.8.7",
        "engine_port": 9001,
    },
    "pd": {"engine_profile": "vllm_pd", "engine_pd_role": PD_ROLE, "llmfleet_tp_size": 1, "llmfleet_pp_size": 1},
    "pd-keyed": {
        "engine_profile": "vllm_pd",
        "engine_pd_role": PD_ROLE,
        "llmfleet_tp_size": 1,
        "llmfleet_pp_size": 1,
        "llmfleet_api_key": KEY,
        "engine_pd_router_host": "127.0.0.1",
    },
    "custom": {
        "engine_profile": "custom",
        "engine_custom_argv": ["/opt/x/serve", "--port", "8000"],
        "llmfleet_api_key": KEY,
    },
    "stopped": {"engine_state": "stopped", "llmfleet_api_key": KEY},
    "no-link-no-metrics-no-health": {"engine_link": False, "llmfleet_metrics_dir": "", "engine_health": False},
    "one-node-link": {"engine_host": "::"},
}
CASES = [
    ("lab", ROOT / "inventory/lab/group_vars/all.yml", LAB_HOSTS, list(VARIANTS), {}),
    ("example-h20", ROOT / "inventory/example-h20/group_vars/all.yml", None, ["as-is", "keyed-secrets", "pd"], {}),
    # The device runs set the served name on the command line (tests/device/).
    (
        "device-h200",
        ROOT / "inventory/device-h200/group_vars/all.yml",
        H200_HOSTS,
        ["as-is", "keyed-secrets"],
        {"engine_served_model_name": "det-llama"},
    ),
]
# Inputs both sides take as given (the plan tasks', which run before the wrapper's).
PREP = [
    {"name": "Plan", "ansible.builtin.set_fact": {"_engine_plan": "{{ _engine_spec | llmfleet.fleet.llmfleet_engine_plan(engine_node_rank) }}"}},
    {"name": "P/D instance", "when": "_engine_pd | bool",
     "ansible.builtin.set_fact": {"_engine_pd_instance": {
         "name": "{{ inventory_hostname }}", "role": "{{ engine_pd_role }}",
         "url": "http://{{ _engine_fabric_ip }}:{{ _engine_port }}",
         "api_base": "http://{{ ansible_host | default(inventory_hostname) }}:{{ _engine_port }}"}}},
    {"name": "Router plan", "when": "_engine_pd | bool and inventory_hostname == _engine_head",
     "ansible.builtin.set_fact": {"_engine_router_plan": "{{ _engine_router_spec | llmfleet.fleet.llmfleet_router_plan }}"}},
]  # fmt: skip
OUT = {
    "name": "Out",
    "ansible.builtin.copy": {
        "content": "{{ {'exec': _engine_exec_args, 'router': _engine_router_exec_args} | to_json }}",
        "dest": "{{ out_dir }}/{{ variant }}/{{ inventory_hostname }}.json",
        "mode": "0644",
    },
}


def _defaults() -> dict:
    out = {}
    for role in ("llmfleet", "engine"):
        out.update(yaml.safe_load((ROOT / "roles" / role / "defaults" / "main.yml").read_text()) or {})
    return out


def _build_task() -> dict:
    tasks = yaml.safe_load((ROOT / "roles/engine/tasks/0020-install.yml").read_text())
    return next(t for t in tasks if t.get("name") == "Build the wrapper command line")


def _run(tmp: Path, side: str, case: tuple) -> Path:
    """One ansible-playbook run: a play per variant through a role `cmp` (the engine role's defaults and the
    side's vars); each host writes {exec, router} to <out>/<variant>/<host>.json."""
    inv_name, group_vars, hosts, variants, more = case
    base = tmp / f"{inv_name}-{side}"
    role = base / "roles" / "cmp"
    for d in ("defaults", "vars", "tasks"):
        (role / d).mkdir(parents=True)
    (role / "defaults/main.yml").write_text(yaml.safe_dump(_defaults(), sort_keys=False))
    if side == "old":
        (role / "vars/main.yml").write_text(BEFORE.read_text())
        tasks = [*PREP, OUT]
    else:
        (role / "vars/main.yml").write_text((ROOT / "roles/engine/vars/main.yml").read_text())
        tasks = [*PREP, _build_task(), OUT]
    (role / "tasks/main.yml").write_text(yaml.safe_dump(tasks, sort_keys=False))
    inv = base / "inventory"
    (inv / "group_vars").mkdir(parents=True)
    (inv / "group_vars/all.yml").write_text(group_vars.read_text())
    if hosts is None:
        (inv / "hosts.yml").write_text((group_vars.parent.parent / "hosts.yml").read_text())
    else:
        children = {g: {"hosts": h} for g, h in hosts.items()}
        (inv / "hosts.yml").write_text(
            yaml.safe_dump({"all": {"children": {"llmfleet_nodes": {"children": children}}}})
        )
    plays = [{"name": v, "hosts": "llmfleet_nodes", "gather_facts": False, "vars": {"variant": v, **more, **VARIANTS[v]},
              "roles": ["cmp"]} for v in variants]  # fmt: skip
    (base / "play.yml").write_text(yaml.safe_dump(plays, sort_keys=False))
    out = base / "out"
    for v in variants:
        (out / v).mkdir(parents=True)
    bindir = os.path.dirname(sys.executable)
    env = {**os.environ, "ANSIBLE_CONFIG": str(ROOT / "ansible.cfg"), "PATH": f"{bindir}:{os.environ['PATH']}",
           "ANSIBLE_NOCOLOR": "1", "ANSIBLE_LOCAL_TEMP": str(base / "ansible-tmp"),
           "ANSIBLE_ROLES_PATH": str(base / "roles")}  # fmt: skip
    extra = {"out_dir": str(out), "ansible_connection": "local", "ansible_become": False,
             "ansible_python_interpreter": sys.executable, "_engine_model_dir": f"/mnt/nvme/models/m/{REV}"}  # fmt: skip
    cp = subprocess.run(
        [f"{bindir}/ansible-playbook", "-i", str(inv / "hosts.yml"), str(base / "play.yml"), "-e", json.dumps(extra)],
        capture_output=True, text=True, check=False, timeout=300, cwd=ROOT, env=env,
    )  # fmt: skip
    assert cp.returncode == 0, (cp.stdout + cp.stderr)[-4000:]
    return out


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_the_python_wrapper_argv_is_the_jinja_one(tmp_path, case):
    inv_name, variants = case[0], case[3]
    old, new = _run(tmp_path, "old", case), _run(tmp_path, "new", case)
    files = sorted(p.relative_to(old) for p in old.rglob("*.json"))
    assert files == sorted(p.relative_to(new) for p in new.rglob("*.json"))
    assert {f.parts[0] for f in files} == set(variants)
    seen: set[str] = set()
    for f in files:
        a, b = json.loads((old / f).read_text()), json.loads((new / f).read_text())
        assert b == a, f"{inv_name} {f}"
        words = b["exec"] + b["router"]
        assert KEY not in json.dumps(words) and SECRET not in json.dumps(words), f"{inv_name} {f}: a secret in argv"
        seen |= {w for w in words if w.startswith("--link-") or w.startswith("--health-") or w.startswith("--secret")}
        seen |= {"router"} if b["router"] else set()
    # The comparison covered what the options render (not only empty groups).
    if inv_name == "lab":
        assert {"--link-listen", "--link-peers", "--link-head", "--health-url", "--health-key", "--secret-env",
                "--secret-config", "router"} <= seen, seen  # fmt: skip


def test_stopped_and_unknown_profile():
    """No health probe and no router line for a stopped deployment; an unknown profile is named, not a traceback."""
    plan = node_plan({"profile": "sglang", "model_path": "/m"}, 0)
    w = {"profile": "sglang", "node": "n1", "head": True, "started": False, "api_key": True, "record": "r",
         "status": "s", "stop_timeout": 5, "extend_timeout": 60, "health": True, "served_model_name": "m",
         "health_interval": 30, "health_timeout": 20, "health_failures": 3, "ready_prompt": "q", "ready_expect": "a",
         "port": 30000}  # fmt: skip
    out = wrapper_args(w, plan)
    assert out["health"] == [] and out["router_exec"] == []
    assert out["exec"][:12] == ["exec", "--record", "r", "--status", "s", "--ready-regex", plan["ready"]["regex"],
                                "--ready-count", "1", "--stop-timeout", "1", "--extend-timeout"]  # fmt: skip
    assert out["secret"] == ["--secret-config", "config:api-key=api-key"]
    with pytest.raises(PlanError, match="engine_profile='tgi': choose one of sglang, vllm, vllm_pd, custom"):
        wrapper_args({**w, "profile": "tgi"}, plan)
