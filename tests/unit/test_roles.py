"""Every role has argument_specs in sync with its defaults, and a molecule scenario on the lab."""

from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
ROLES = sorted(p for p in (ROOT / "roles").iterdir() if p.is_dir())


def test_there_are_roles():
    assert {r.name for r in ROLES} >= {"base", "validate", "report"}


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
    mol = yaml.safe_load((scen / "molecule.yml").read_text())
    assert mol["ansible"]["playbooks"]["create"] == "../../../../tests/molecule/create.yml"
    seq = mol["scenario"]["test_sequence"]
    assert seq.index("converge") < seq.index("idempotence") < seq.index("verify")
    verify = (scen / "verify.yml").read_text()
    assert "ansible.builtin.assert" in verify, f"{role.name}: verify.yml asserts nothing"
