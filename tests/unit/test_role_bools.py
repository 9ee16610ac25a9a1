"""A role's bool variables are read with `| bool` wherever a template or a condition decides on them: from the
command line (`-e nccl_check_pairwise=false`) they arrive as the string "false", which Jinja finds true (the
pairwise rounds ran anyway) and a 2.19 `when:` refuses. A module option of type bool converts by itself, so a
bare `"{{ var }}"` handed to one is fine. (Checks one-line `when:` values and `{{ }}` on one line.)"""

import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]


def bool_vars(role: Path) -> list[str]:
    spec = yaml.safe_load((role / "meta/argument_specs.yml").read_text())
    return [k for ep in spec["argument_specs"].values() for k, v in (ep.get("options") or {}).items()
            if v.get("type") == "bool"]  # fmt: skip


def unconverted(text: str, names: list[str]) -> list[str]:
    # A bare "{{ var }}" is the value handed to a module option: the module converts it.
    exprs = [m.group(1) for m in re.finditer(r"\{\{(.*?)\}\}", text) if m.group(1).strip() not in names]
    when = re.match(r"\s*(?:-\s+)?(?:when|changed_when|failed_when|until):\s*(.+)$", text)
    if when and not when.group(1).startswith((">", "|", "[")):
        exprs.append(when.group(1))
    return [n for e in exprs for n in names if re.search(rf"\b{n}\b(?!\s*\|\s*bool)", e)]


def test_bool_role_variables_are_converted_where_they_decide():
    found = []
    for spec in sorted(ROOT.glob("roles/*/meta/argument_specs.yml")):
        role = spec.parents[1]
        names = bool_vars(role)
        for f in (
            sorted(role.glob("tasks/*.yml"))
            + sorted(role.glob("vars/*.yml"))
            + sorted(p for p in role.glob("templates/**/*") if p.is_file())
        ):
            for i, line in enumerate(f.read_text().splitlines(), 1):
                found += [f"{f.relative_to(ROOT)}:{i}: {n}" for n in unconverted(line, names)]
    assert found == [], "use `| bool`:\n" + "\n".join(found)


def test_the_scan_sees_a_string_false_decide():
    assert unconverted('    x: "{{ a if (nccl_check_pairwise and b) else [] }}"', ["nccl_check_pairwise"])
    assert unconverted("  when: not ansible_check_mode and nccl_check_fail", ["nccl_check_fail"])
    assert not unconverted("  when: nccl_check_fail | bool", ["nccl_check_fail"])
    assert unconverted("  when: acceptance_fail", ["acceptance_fail"])
    assert not unconverted('    enabled: "{{ engine_enable_at_boot }}"', ["engine_enable_at_boot"])
    assert not unconverted("      msg: set engine_require_api_key=true", ["engine_require_api_key"])
