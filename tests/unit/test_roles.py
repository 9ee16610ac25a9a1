"""Every role has argument_specs in sync with its defaults, a description of its own for every option,
a README generated from the spec, and a molecule scenario on the lab."""

import re
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
ROLES = sorted(p for p in (ROOT / "roles").iterdir() if p.is_dir())


def test_there_are_roles():
    assert {r.name for r in ROLES} >= {"llmfleet", "base", "report"}


@pytest.mark.parametrize("role", ROLES, ids=lambda p: p.name)
def test_argument_specs_match_defaults(role):
    defaults = yaml.safe_load((role / "defaults/main.yml").read_text()) or {}
    spec = yaml.safe_load((role / "meta/argument_specs.yml").read_text())["argument_specs"]["main"]["options"]
    optional = {k for k, o in spec.items() if not o.get("required")}
    assert optional == set(defaults), f"{role.name}: options and defaults differ: {optional ^ set(defaults)}"
    for name, opt in spec.items():
        assert name.startswith(role.name + "_"), f"{role.name}: variable {name} lacks the role prefix"
        assert opt.get("description"), f"{role.name}: {name} has no description"
        if opt.get("required"):
            assert "default" not in opt, f"{role.name}: required {name} must not have a default"
        else:
            assert opt.get("default") == defaults[name], (
                f"{role.name}: {name} default differs between spec and defaults"
            )


@pytest.mark.parametrize("role", ROLES, ids=lambda p: p.name)
def test_molecule_scenario_uses_the_lab(role):
    scen = role / "molecule/default"
    for f in ("molecule.yml", "converge.yml", "verify.yml"):
        assert (scen / f).is_file(), f"{role.name}: missing molecule/default/{f}"
    # The scenario as molecule sees it: the shared base config with the scenario's file merged on top.
    mol = yaml.safe_load((ROOT / ".config/molecule/config.yml").read_text())
    own = yaml.safe_load((scen / "molecule.yml").read_text())
    assert set(own) <= {"ansible", "scenario"}, f"{role.name}: put shared settings in .config/molecule/config.yml"
    assert mol["ansible"]["playbooks"]["create"] == "../../../../tests/molecule/create.yml"
    assert "create" not in own.get("ansible", {}).get("playbooks", {}), f"{role.name}: create is the lab's"
    seq = own.get("scenario", {}).get("test_sequence") or mol["scenario"]["test_sequence"]
    assert seq.index("converge") < seq.index("idempotence") < seq.index("verify")
    verify = (scen / "verify.yml").read_text()
    assert "ansible.builtin.assert" in verify, f"{role.name}: verify.yml asserts nothing"


# ---- every option says what it does, in its own words, and the README says what the spec says -------

MIN_WORDS = 5  # "Base name." says nothing a reader can act on


def _normalized(text):
    from tests.helpers.role_readme import as_text

    return " ".join(re.sub(r"[^\w\s]", " ", as_text(text).lower()).split())


@pytest.mark.parametrize("role", ROLES, ids=lambda p: p.name)
def test_every_option_has_its_own_description(role):
    options = spec_of(role.name)["options"]
    by_text = {}
    for name, opt in options.items():
        by_text.setdefault(_normalized(opt.get("description")), []).append(name)
    shared = [names for names in by_text.values() if len(names) > 1]
    assert not shared, f"{role.name}: options share one description (say what each one does): {shared}"
    short = [name for name, opt in options.items() if len(_normalized(opt.get("description")).split()) < MIN_WORDS]
    assert not short, f"{role.name}: descriptions shorter than {MIN_WORDS} words: {short}"


def test_role_readmes_are_generated_from_the_specs():
    import subprocess
    import sys

    cp = subprocess.run([sys.executable, str(ROOT / "tests/helpers/role_readme.py"), "--check"],
                        capture_output=True, text=True, check=False, timeout=60, cwd=ROOT)  # fmt: skip
    assert cp.returncode == 0, cp.stdout + cp.stderr


def test_a_stale_readme_is_named_and_table_cells_stay_one_cell(tmp_path, capsys):
    from tests.helpers import role_readme

    meta = tmp_path / "roles/demo/meta"
    meta.mkdir(parents=True)
    spec = {"main": {"short_description": "Demo role", "description": ["Does a | b."], "options": {
        "demo_sep": {"type": "str", "default": "a|b", "choices": ["a|b", "c"],
                     "description": "Separator between demo_lines fields, a | b."},
        "demo_lines": {"type": "str", "default": "one\ntwo", "description": "Two lines, kept in one cell."},
        "demo_key": {"type": "str", "default": "s3cret", "no_log": True, "description": "A secret nobody reads here."},
    }}}  # fmt: skip
    (meta / "argument_specs.yml").write_text(yaml.safe_dump({"argument_specs": spec}, sort_keys=False))
    assert role_readme.main(["--check"], root=tmp_path) == 1
    assert "roles/demo/README.md" in capsys.readouterr().err
    assert role_readme.main([], root=tmp_path) == 0
    assert role_readme.main(["--check"], root=tmp_path) == 0
    text = (tmp_path / "roles/demo/README.md").read_text()
    assert "do not edit" in text and "s3cret" not in text
    rows = [line for line in text.splitlines() if line.startswith("| `demo_")]
    assert len(rows) == 3
    for row in rows:  # 5 cells = 6 bare pipes; those in values and text are escaped
        assert len(re.findall(r"(?<!\\)\|", row)) == 6, row
    assert "`a\\|b`" in rows[0] and '`"one\\ntwo"`' in rows[1]
    assert role_readme.cell("x|y\nz") == "x\\|y<br>z"
    (meta / "argument_specs.yml").write_text((meta / "argument_specs.yml").read_text().replace("Two lines", "2 lines"))
    assert role_readme.main(["--check"], root=tmp_path) == 1


def test_engine_restart_reaches_systemd_unchecked():
    # No choices: tests/integration/test_engine.py sends a bad value and expects systemd-analyze verify to refuse it.
    assert "choices" not in spec_of("engine")["options"]["engine_restart"]


# ---- the specs reject wrong types and values --------------------------------------------------------

SAMPLE = {"str": "x", "path": "/x", "int": 1, "float": 1.0, "bool": True, "list": [], "dict": {}, "raw": "x"}


def spec_of(role_name):
    return yaml.safe_load((ROOT / "roles" / role_name / "meta/argument_specs.yml").read_text())["argument_specs"][
        "main"
    ]


def rendered(value):
    """A default as ansible validates it: templated first, here against the fleet contract's defaults
    (every role depends on roles/llmfleet)."""
    import jinja2

    ctx = {"playbook_dir": "/ops/playbooks", "role_path": "/ops/roles/x"}
    ctx.update(yaml.safe_load((ROOT / "roles/llmfleet/defaults/main.yml").read_text()))
    for _ in range(3):
        if not (isinstance(value, str) and "{{" in value):
            break
        value = jinja2.Template(value).render(ctx)
    return value


def validate(role_name, values):
    """Error messages of ansible's role argument validation (what runs first when a role starts)."""
    from ansible.module_utils.common.arg_spec import ArgumentSpecValidator

    spec = spec_of(role_name)["options"]
    defaults = yaml.safe_load((ROOT / "roles" / role_name / "defaults/main.yml").read_text()) or {}
    given = {k: rendered(v) for k, v in defaults.items()}
    for name, opt in spec.items():
        if opt.get("required"):
            given.setdefault(name, (opt.get("choices") or [SAMPLE[opt.get("type", "str")]])[0])
    given.update(values)
    return ArgumentSpecValidator(spec).validate(given, validate_role_argument_spec=True).error_messages


@pytest.mark.parametrize("role", ROLES, ids=lambda p: p.name)
def test_defaults_pass_their_own_spec(role):
    assert validate(role.name, {}) == []


# Enumerated variables and the code that defines their values: the spec's choices must be exactly these.
ENUMERATED = {
    ("nccl_check", "nccl_check_backend"): ["nccl", "gloo"],  # llmfleet_nccl_check's backend choices
    ("nccl_check", "nccl_check_ops"): "llmfleet.checks.nccl_check.OPS",
}


@pytest.mark.parametrize(("role", "var"), sorted(ENUMERATED), ids=lambda v: v)
def test_enumerated_variables_have_choices(role, var):
    import importlib

    want = ENUMERATED[(role, var)]
    if isinstance(want, str):
        mod, _, attr = want.rpartition(".")
        want = list(getattr(importlib.import_module(mod), attr))
    assert spec_of(role)["options"][var].get("choices") == want


BAD_VALUES = [
    # (role, variable, value, text of the error)
    ("nccl_check", "nccl_check_backend", "mpi", "value of nccl_check_backend must be one of: nccl, gloo, got: mpi"),
    ("nccl_check", "nccl_check_backend", "NCCL", "nccl_check_backend must be one of"),
    ("nccl_check", "nccl_check_ops", ["all_reduce", "alltoall"], "value of nccl_check_ops must be one or more of: all_reduce, broadcast, sendrecv, all_gather. Got no match for: alltoall"),
    ("nccl_check", "nccl_check_iters", "many", "argument 'nccl_check_iters' is of type str and we were unable to convert to int"),
    ("nccl_check", "nccl_check_pairwise", "sometimes", "argument 'nccl_check_pairwise' is of type str and we were unable to convert to bool"),
    ("nccl_check", "nccl_check_busbw_floors", 400, "argument 'nccl_check_busbw_floors' is of type int and we were unable to convert to dict"),
    ("model_stage", "model_stage_max_source_readers", "two", "argument 'model_stage_max_source_readers' is of type str and we were unable to convert to int"),
    ("model_stage", "model_stage_threads", 2.5, "argument 'model_stage_threads' is of type float and we were unable to convert to int"),
    ("model_stage", "model_stage_deep_verify", "maybe", "'model_stage_deep_verify' is of type str and we were unable to convert to bool"),
    ("preflight", "preflight_ports", ["http"], "Elements value for option 'preflight_ports' is of type str and we were unable to convert to int"),
    ("preflight", "preflight_max_clock_offset_s", "fast", "'preflight_max_clock_offset_s' is of type str and we were unable to convert to float"),
    ("topology", "topology_overrides", ["NCCL_IB_HCA", "mlx5_0"], "'topology_overrides' is of type list and we were unable to convert to dict"),
    ("topology", "topology_use_nvml", "maybe", "'topology_use_nvml' is of type str and we were unable to convert to bool"),
]  # fmt: skip


@pytest.mark.parametrize(("role", "var", "value", "text"), BAD_VALUES, ids=[f"{c[1]}={c[2]}" for c in BAD_VALUES])
def test_wrong_type_or_choice_is_rejected_naming_the_variable(role, var, value, text):
    errors = validate(role, {var: value})
    assert any(text in e for e in errors), errors


# Ranges are checked by each role's first tasks (ansible.builtin.assert); run them through ansible-playbook.
PLAYBOOK = """
- name: Start a role with bad variables
  hosts: all
  gather_facts: false
  roles:
    - role: "{{ role_under_test }}"
"""
# One node, the head: the fleet contract's layout checks pass, so each case fails on its own variable.
INVENTORY = """
all:
  children:
    llmfleet_nodes:
      children:
        head:
          hosts:
            localhost: {llmfleet_fabric_ip: 127.0.0.1}
"""
STAGE_REQUIRED = {"llmfleet_model": "m", "llmfleet_model_revision": "c" * 40, "model_stage_source": "/nonexistent"}
RANGES = [
    # (role, extra vars, text of the failure)
    ("model_stage", {**STAGE_REQUIRED, "model_stage_max_source_readers": 0}, "model_stage_max_source_readers=0 is out of range: it must be >= 1"),
    ("model_stage", {**STAGE_REQUIRED, "model_stage_threads": -1}, "model_stage_threads=-1 is out of range: it must be >= 1"),
    ("model_stage", {**STAGE_REQUIRED, "model_stage_keep": 0}, "model_stage_keep=0 is out of range: it must be >= 1"),
    ("model_stage", {**STAGE_REQUIRED, "model_stage_peer_port": 70000}, "model_stage_peer_port=70000 is out of range: it must be between 0 and 65535"),
    ("nccl_check", {"nccl_check_ranks_per_node": 0}, "nccl_check_ranks_per_node=0 is out of range: it must be >= 1"),
    ("nccl_check", {"nccl_check_iters": 0}, "nccl_check_iters=0 is out of range"),
    ("nccl_check", {"nccl_check_port": 0, "nccl_check_deadline": 0},
     "nccl_check_port=0 is out of range: it must be between 1 and 65000 (a TCP port; the phases use the next ports "
     "too); nccl_check_deadline=0 is out of range: it must be >= 1 (seconds)"),
    ("nccl_check", {"nccl_check_timeout": 20, "nccl_check_unreachable_after": 30},
     "nccl_check_unreachable_after=30 is out of range: it must be between 1 and 20 (seconds, within the rendezvous "
     "timeout nccl_check_timeout)"),
    ("nccl_check", {"nccl_check_sizes": ["8", "1X"]}, "nccl_check_sizes item 1X: not a size in bytes per rank"),
    ("nccl_check", {"nccl_check_sizes": ["8", "1M"]}, "nccl_check_reference_size=1G is not one of nccl_check_sizes"),
    ("nccl_check", {"nccl_check_backend": "mpi"}, "value of nccl_check_backend must be one of: nccl, gloo, got: mpi"),
    ("preflight", {"preflight_ports": [0, 29500]}, "preflight_ports=[0, 29500]: 0 is not a TCP port (1-65535)"),
    ("preflight", {"preflight_max_clock_offset_s": 0}, "preflight_max_clock_offset_s=0 is out of range: it must be > 0"),
    ("llmfleet", {"llmfleet_gpus_per_node": -8}, "llmfleet_gpus_per_node=-8 is out of range: it must be >= 1"),
    ("llmfleet", {"llmfleet_tp_size": 8, "llmfleet_pp_size": 2}, "over 1 nodes = 16 ranks per node, but llmfleet_gpus_per_node=8"),
    # The facts the contract owns, by the package's rules (llmfleet.facts).
    ("llmfleet", {"llmfleet_model_revision": "main"}, "llmfleet_model_revision='main' is not a 40-hex commit id"),
    ("llmfleet", {"llmfleet_model": "../etc"}, "llmfleet_model='../etc' is not a model directory name"),
    ("llmfleet", {"llmfleet_deployment": "Demo_1"}, "llmfleet_deployment='Demo_1' is not a deployment name"),
    # The older names still set the facts, and are checked as them.
    ("llmfleet", {"model_stage_revision": "main"}, "llmfleet_model_revision='main' is not a 40-hex commit id"),
    ("llmfleet", {"model_stage_revision": "a" * 40, "llmfleet_model_revision": "b" * 40},
     f"model_stage_revision={'a' * 40} and llmfleet_model_revision={'b' * 40} disagree"),
    ("model_stage", {"model_stage_source": "/nonexistent"}, "Staging needs llmfleet_model"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("role", "extra", "text"), RANGES, ids=["{}={}".format(*list(c[1].items())[-1]) for c in RANGES]
)
def test_out_of_range_variables_fail_before_the_role_does_anything(tmp_path, role, extra, text):
    import json
    import os
    import subprocess
    import sys

    (tmp_path / "play.yml").write_text(PLAYBOOK)
    (tmp_path / "inventory.yml").write_text(INVENTORY)
    bindir = os.path.dirname(sys.executable)
    env = {**os.environ, "ANSIBLE_CONFIG": str(ROOT / "ansible.cfg"), "PATH": f"{bindir}:{os.environ['PATH']}",
           "ANSIBLE_NOCOLOR": "1", "ANSIBLE_LOCAL_TEMP": str(tmp_path / "ansible-tmp")}  # fmt: skip
    cp = subprocess.run(
        [f"{bindir}/ansible-playbook", "-i", str(tmp_path / "inventory.yml"), "-c", "local", str(tmp_path / "play.yml"),
         "-e", json.dumps({"role_under_test": role, **extra})],
        capture_output=True, text=True, check=False, timeout=120, cwd=ROOT, env=env,
    )  # fmt: skip
    out = " ".join((cp.stdout + cp.stderr).split())  # the callback folds long messages
    assert cp.returncode == 2, out
    assert text in out, out
    # the role stopped at its first tasks: ansible's argument validation, the role's own validate file or
    # the fleet contract's checks (roles/llmfleet, which every role runs first)
    assert "Validation of arguments failed" in out or re.search(
        rf"Origin: \S+/roles/({role}/tasks/(0005|0010)-validate|llmfleet/tasks/00\d0-\w+)\.yml", out
    )
    assert "changed=0" in out and "Traceback" not in out


# ---- the fleet contract -----------------------------------------------------------------------------

# llmfleet_* names that are not contract variables: per-host inventory facts, facts set by modules,
# result fields, the node group's default name, filters and modules (their names share the prefix).
NOT_CONTRACT = {
    "llmfleet_fabric_ip",
    "llmfleet_lab",
    "llmfleet_topology",
    "llmfleet_nodes",
    "llmfleet_version",
    # the run, not the inventory: playbooks/run_start.yml makes the id once per run from what each playbook tells it
    "llmfleet_run_id",
    "llmfleet_run_started",
    "llmfleet_run_playbook",
    "llmfleet_run_steps",
    "llmfleet_run_continue",
    # prefixes of the metrics files the roles write (llmfleet_stage_<model>.prom, ...; docs/metrics.md)
    "llmfleet_acceptance_",
    "llmfleet_bench_",
    "llmfleet_engine_ready_",
    "llmfleet_stage_",
}


def test_every_shared_variable_a_role_reads_is_declared_once_by_the_contract():
    contract = set(spec_of("llmfleet")["options"])
    plugins = list((ROOT / "filter_plugins").glob("llmfleet_*.py"))
    filters = {p.stem for p in plugins} | {f for p in plugins for f in re.findall(r'"(llmfleet_\w+)": ', p.read_text())}
    modules = {p.stem for p in (ROOT / "library").glob("llmfleet_*.py")}
    used = set()
    for f in (
        list((ROOT / "roles").rglob("*.yml"))
        + list((ROOT / "roles").rglob("*.j2"))
        + list((ROOT / "playbooks").glob("*.yml"))
    ):
        if "molecule" in f.parts:
            continue
        used |= set(re.findall(r"\b(llmfleet_\w+)\b", f.read_text()))
    undeclared = used - contract - filters - modules - NOT_CONTRACT
    assert not undeclared, (
        f"llmfleet_* variables read by roles but not declared in roles/llmfleet: {sorted(undeclared)}"
    )
    # Declared once: no other role declares a contract variable (their options carry their own prefix).
    for role in ROLES:
        if role.name != "llmfleet":
            assert not contract & set(spec_of(role.name)["options"]), role.name
