"""The fleet's facts have one owner each: llmfleet.facts holds the rule, the contract (roles/llmfleet), the modules,
the staging code, the CLI and the report call it; the engine is given the revision instead of reading it back out of
`current`; the older variable names still work for one release, with a warning."""

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from ansible.errors import AnsibleFilterError

from llmfleet import facts
from llmfleet.engine.node import model_identity
from llmfleet.report import sections
from llmfleet.stage.staging import StageError, check_revision

ROOT = Path(__file__).resolve().parents[2]
REV = "5eed" * 10


def _plugin(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "filter_plugins" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


FILTERS = _plugin("llmfleet_facts").FilterModule().filters()


# ---- one validator per fact ----------------------------------------------------------------------


@pytest.mark.parametrize("rev", [REV, "0" * 40, "0123456789abcdef0123456789abcdef01234567"])
def test_a_pinned_commit_is_a_revision(rev):
    assert facts.revision_problem(rev) is None


@pytest.mark.parametrize("rev", ["main", "v1.0", "A" * 40, "a" * 39, "a" * 41, f"{REV}\n", "", None, 40])
def test_anything_else_is_refused_naming_the_variable_and_the_fix(rev):
    problem = facts.revision_problem(rev, "llmfleet_model_revision")
    assert problem.startswith(f"llmfleet_model_revision={rev!r} is not a 40-hex commit id")
    assert "pin the commit" in problem


@pytest.mark.parametrize("name", ["main", "demo", "glm-h20", "a", "a1", "a" * 42])
def test_deployment_names(name):
    assert facts.deployment_problem(name) is None


@pytest.mark.parametrize("name", ["", "Demo", "1demo", "demo-", "de_mo", "x/y", "a" * 43, "demo\n", None])
def test_bad_deployment_names_are_refused(name):
    assert facts.deployment_problem(name) == (
        f"llmfleet_deployment={name!r} is not a deployment name: use {facts.DEPLOYMENT_RULE} "
        "(the unit is llmfleet-<name>.service)"
    )


@pytest.mark.parametrize("model", ["glm-5", "demo-model", "qwen3.8-2.4t-fp8", "M"])
def test_model_directory_names(model):
    assert facts.model_problem(model) is None


@pytest.mark.parametrize("model", ["", ".hidden", "..", "a/b", "/abs", None])
def test_a_model_name_that_is_not_a_plain_directory_name_is_refused(model):
    assert facts.model_problem(model).startswith(f"llmfleet_model={model!r} is not a model directory name")


def test_range_problem_names_the_first_value_out_of_range_and_where_it_is_set():
    ranges = {"threads": (1, None, "set by the role variable model_stage_threads"), "port": (0, 65535, None)}
    assert facts.range_problem({"threads": 4, "port": 80}, ranges) is None
    assert facts.range_problem({"threads": None}, ranges) is None  # not given: not checked
    assert facts.range_problem({"threads": 0, "port": 70000}, ranges) == (
        "threads=0 is out of range (set by the role variable model_stage_threads): it must be >= 1"
    )
    assert facts.range_problem({"port": 70000}, ranges) == "port=70000 is out of range: it must be between 0 and 65535"


def test_the_staging_modules_take_the_role_variables_bounds_from_one_table():
    """model_stage_threads >= 1 is written once (facts.STAGE_RANGES): the role and both modules read it."""
    sys.path.insert(0, str(ROOT / "plugins" / "modules"))
    try:
        import llmfleet_model_manifest
        import llmfleet_model_stage
    finally:
        sys.path.remove(str(ROOT / "plugins" / "modules"))
    for mod in (llmfleet_model_stage, llmfleet_model_manifest):
        one_file = Path(facts.range_problem.__code__.co_filename).resolve()  # imported by two names, one source
        assert Path(mod.range_problem.__code__.co_filename).resolve() == one_file
        assert mod.RANGES["threads"] == (1, None, "set by the role variable model_stage_threads")
        assert mod.RANGES["max_source_readers"][:2] == facts.STAGE_RANGES["model_stage_max_source_readers"][:2]
    assert llmfleet_model_stage.RANGES["serve_port"][:2] == (0, 65535)
    assert llmfleet_model_stage.RANGES["lease_ttl"] == (1, None, None)


def test_the_staging_code_and_the_cli_refuse_a_branch_name_with_the_same_rule():
    with pytest.raises(StageError, match=r"^revision='main' is not a 40-hex commit id"):
        check_revision("main")
    check_revision(REV)
    cp = subprocess.run([sys.executable, "-m", "llmfleet", "stage", "/nonexistent", "--model", "m", "--revision",
                         "main"], capture_output=True, text=True, check=False, cwd=ROOT)  # fmt: skip
    assert cp.returncode == 2 and "'main' is not a 40-hex commit id" in cp.stderr, cp.stderr


def test_one_40_hex_pattern_in_the_code():
    """The revision's rule lives in llmfleet.facts only: no module, role or filter spells the pattern again."""
    hits = []
    for top in ("plugins", "roles"):
        for p in (ROOT / top).rglob("*"):
            if p.suffix in (".py", ".yml", ".j2") and p.is_file() and p.name != "facts.py":
                if re.search(r"\{40\}", p.read_text(errors="replace")):
                    hits.append(str(p.relative_to(ROOT)))
    assert hits == []


# ---- the filters the roles call -------------------------------------------------------------------


def test_the_filters_are_the_packages_rules():
    assert FILTERS["llmfleet_revision_problem"](REV) == ""
    assert FILTERS["llmfleet_revision_problem"]("main") == facts.revision_problem("main")
    assert FILTERS["llmfleet_deployment_problem"]("Bad") == facts.deployment_problem("Bad")
    assert FILTERS["llmfleet_model_problem"]("a/b") == facts.model_problem("a/b")


def test_stage_range_problems_are_every_setting_out_of_range_with_why():
    f = FILTERS["llmfleet_stage_range_problems"]
    assert f({"model_stage_threads": "4", "model_stage_peer_port": 0}) == []
    assert f({"model_stage_threads": 0, "model_stage_peer_port": 70000, "model_stage_keep": "x"}) == [
        "model_stage_threads=0 is out of range: it must be >= 1 (concurrent copies per node)",
        "model_stage_peer_port=70000 is out of range: it must be between 0 and 65535 (a TCP port, 0 = derived)",
        "model_stage_keep='x' is not a number",
    ]
    with pytest.raises(AnsibleFilterError, match="model_stage_bogus is not a model_stage setting"):
        f({"model_stage_bogus": 1})


def test_the_engine_model_directory_is_where_the_store_publishes_the_revision():
    assert (
        FILTERS["llmfleet_revision_dir"]("/mnt/nvme/models", "demo-model", REV) == f"/mnt/nvme/models/demo-model/{REV}"
    )
    with pytest.raises(AnsibleFilterError, match="is not a 40-hex commit id"):
        FILTERS["llmfleet_revision_dir"]("/mnt/nvme/models", "demo-model", "main")
    with pytest.raises(AnsibleFilterError, match="is not a model directory name"):
        FILTERS["llmfleet_revision_dir"]("/mnt/nvme/models", "../etc", REV)


# ---- the revision is given, not read back ----------------------------------------------------------


def test_the_fingerprint_takes_the_given_revision_not_the_name_behind_a_link(tmp_path):
    (tmp_path / "m" / "other").mkdir(parents=True)
    (tmp_path / "m" / "current").symlink_to("other")
    assert model_identity(str(tmp_path / "m" / "current"), REV)["model_revision"] == REV
    # an engine_model_path override without a pinned revision: the directory's own name, as before
    assert model_identity(str(tmp_path / "m" / "current"))["model_revision"] == "other"


def test_the_report_takes_the_revision_from_the_record_not_from_a_path():
    engine = {"engine": "sglang", "model": "demo", "ok": True, "gates": [], "revision": REV,
              "model_path": "/mnt/shared/checkpoints/demo"}  # fmt: skip
    assert sections.engine(engine)["revision"] == REV
    assert sections.inventory(None, None, None, engine, None)["deployment"]["revision"] == REV
    # a path that ends in 40 hex is not read as the revision: the record (or the staging record) says it
    path_only = {**engine, "model_path": f"/mnt/nvme/models/demo/{'f' * 40}"}
    del path_only["revision"]
    assert sections.engine(path_only)["revision"] is None
    stage = {"model": "demo", "revision": REV}
    assert sections.inventory(None, None, None, path_only, stage)["deployment"]["revision"] == REV
    assert not hasattr(sections, "revision_of")


# ---- the older names, through Ansible -----------------------------------------------------------------

PLAY = """
- name: The contract's model facts
  hosts: all
  gather_facts: false
  roles:
    - role: llmfleet
  tasks:
    - name: Show them
      ansible.builtin.debug:
        msg: "FACTS {{ [llmfleet_model, llmfleet_model_revision, llmfleet_model_root] | to_json }}"
"""
INVENTORY = (
    "all: {children: {llmfleet_nodes: {children: {head: {hosts: {localhost: {llmfleet_fabric_ip: 127.0.0.1}}}}}}}\n"
)


def contract(tmp_path, **extra):
    (tmp_path / "play.yml").write_text(PLAY)
    (tmp_path / "inventory.yml").write_text(INVENTORY)
    bindir = os.path.dirname(sys.executable)
    env = {**os.environ, "ANSIBLE_CONFIG": str(ROOT / "ansible.cfg"), "PATH": f"{bindir}:{os.environ['PATH']}",
           "ANSIBLE_NOCOLOR": "1", "ANSIBLE_LOCAL_TEMP": str(tmp_path / "ansible-tmp")}  # fmt: skip
    cp = subprocess.run(
        [f"{bindir}/ansible-playbook", "-i", str(tmp_path / "inventory.yml"), "-c", "local", str(tmp_path / "play.yml"),
         "-e", json.dumps({"ansible_python_interpreter": sys.executable, **extra})],
        capture_output=True, text=True, check=False, timeout=120, cwd=ROOT, env=env,
    )  # fmt: skip
    out = " ".join((cp.stdout + cp.stderr).split())
    m = re.search(r"FACTS (\[.*?\])", out.replace("\\", ""))
    return cp.returncode, out, json.loads(m.group(1)) if m else None


def test_the_older_names_still_set_the_contracts_facts_with_a_warning(tmp_path):
    rc, out, got = contract(tmp_path, model_stage_model="m", model_stage_revision=REV, model_stage_root="/srv/models")
    assert rc == 0, out[-3000:]
    assert got == ["m", REV, "/srv/models"]
    assert ("DEPRECATED: model_stage_model, model_stage_revision, model_stage_root - rename to llmfleet_model, "
            "llmfleet_model_revision, llmfleet_model_root") in out, out[-3000:]  # fmt: skip


def test_the_new_names_alone_warn_of_nothing(tmp_path):
    rc, out, got = contract(tmp_path, llmfleet_model="m", llmfleet_model_revision=REV, llmfleet_nvme_path="/nv")
    assert rc == 0, out[-3000:]
    assert got == ["m", REV, "/nv/models"] and "DEPRECATED" not in out


def _units(*states):
    return [{"item": unit, "status": {"ActiveState": state}} for unit, state in states]


def test_the_serving_guard_sees_every_unit_of_the_deployment_replicas_too():
    """The guard of the steps that would disturb a serving deployment (roles/llmfleet/tasks/not_serving.yml) reads
    the deployment's unit and, with llmfleet_replicas, each replica's: a replicated deployment serves although
    llmfleet-<deployment>.service does not exist."""
    serving = FILTERS["llmfleet_serving_units"]
    one = [
        ("node1", _units(("llmfleet-demo.service", "active"))),
        ("node2", _units(("llmfleet-demo.service", "active"))),
    ]
    assert serving(one) == "node1, node2 (llmfleet-demo.service is running)"
    replicas = [
        ("node1", _units(("llmfleet-demo.service", "inactive"), ("llmfleet-demo-r0.service", "active"))),
        ("node3", _units(("llmfleet-demo.service", "inactive"), ("llmfleet-demo-r1.service", "activating"))),
        ("node4", _units(("llmfleet-demo.service", "inactive"), ("llmfleet-demo-r1.service", "failed"))),
    ]
    assert (
        serving(replicas) == "node1 (llmfleet-demo-r0.service is running); node3 (llmfleet-demo-r1.service is running)"
    )
    assert serving([("node1", []), ("node2", _units(("llmfleet-demo.service", "inactive")))]) == ""
