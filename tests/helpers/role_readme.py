"""Write roles/<role>/README.md from the role's meta/argument_specs.yml (dev-sec style).

    python tests/helpers/role_readme.py           # (re)write every role's README
    python tests/helpers/role_readme.py --check   # exit 1 naming each README that is stale or missing

The README is a title, what the role does (short_description and description of the main entry
point) and one table of its variables: name, type, default, choices, description. The spec is the
one source: edit it, then run `make role-docs`. tests/unit/test_roles.py runs --check, so CI fails
when a README no longer says what the spec does.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
COMMAND = "make role-docs (python tests/helpers/role_readme.py)"
NOTE = (
    "Generated from `meta/argument_specs.yml` by `make role-docs` (`python tests/helpers/role_readme.py`); do not edit."
)


def roles(root: Path = ROOT) -> list[Path]:
    return sorted(p for p in (root / "roles").iterdir() if (p / "meta/argument_specs.yml").is_file())


def load_specs(role: Path) -> dict:
    return yaml.safe_load((role / "meta/argument_specs.yml").read_text(encoding="utf-8"))["argument_specs"]


# ---- Markdown -------------------------------------------------------------------------------------------


def as_text(value: str | list[str] | None) -> str:
    """A spec description (a string or a list of paragraphs) as one line of text."""
    parts = value if isinstance(value, list) else [value or ""]
    return " ".join(" ".join(str(p).split()) for p in parts)


def cell(markdown: str) -> str:
    """Markdown made safe for one table cell: `|` would end the cell, a line break the row."""
    return markdown.replace("|", "\\|").replace("\r\n", "\n").replace("\r", "\n").replace("\n", "<br>")


def code(value: object) -> str:
    """A value as an inline code span: strings as they are ("" for the empty one), the rest as JSON."""
    if isinstance(value, str) and value and "\n" not in value and "\r" not in value:
        text = value
    else:
        text = json.dumps(value, ensure_ascii=False)
    fence = "`" * (max((len(r) for r in re.findall(r"`+", text)), default=0) + 1)
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return f"{fence}{pad}{text}{pad}{fence}"


_PROSE = str.maketrans(
    {"\\": "\\\\", "`": "\\`", "*": "\\*", "[": "\\[", "]": "\\]", "&": "&amp;", "<": "&lt;", ">": "&gt;"}
)


# Literal things in running text: --flags, absolute paths and paths with <placeholders> (a trailing
# full stop or hyphen is the sentence's, not the path's).
_LITERAL = r"(?<![\w/`])(?:--[A-Za-z0-9][\w-]*|[\w./-]*<\w+>[\w.<>/-]*|/[\w.<>/-]*[\w<>/])"


def prose(text: str, names: frozenset[str] = frozenset()) -> str:
    """Spec text as Markdown: Ansible's C(code) and I(option) markup, --flags, paths and the variable
    names in `names` become code spans; everything else is escaped, so that *_TOKEN or [a, b] show as
    written."""
    out, pos = [], 0
    alternatives = [r"C\(([^)]*)\)", r"I\(([^)]*)\)", f"({_LITERAL})"]
    if names:
        alternatives.append(r"\b(" + "|".join(sorted(map(re.escape, names), key=len, reverse=True)) + r")\b")
    for m in re.finditer("|".join(alternatives), text):
        literal = next(g for g in m.groups() if g is not None)
        trimmed = len(literal) - len(literal.rstrip(".-")) if m.group(3) else 0
        out.append(text[pos : m.start()].translate(_PROSE))
        out.append(code(literal[: len(literal) - trimmed]))
        pos = m.end() - trimmed
    out.append(text[pos:].translate(_PROSE))
    return "".join(out)


def type_of(opt: dict) -> str:
    kind = opt.get("type", "str")
    if opt.get("elements"):
        kind += f" of {opt['elements']}"
    return kind + (" (secret)" if opt.get("no_log") else "")


def render(role: Path, names: frozenset[str] = frozenset()) -> str:
    """The README of one role. `names`: variable names to show as code (every role's options)."""
    specs = load_specs(role)
    main = specs.get("main", {})
    lines = [f"# {role.name}", ""]
    if main.get("short_description"):
        lines += [prose(as_text(main["short_description"]), names).rstrip(".") + ".", ""]
    desc = main.get("description") or []
    for para in desc if isinstance(desc, list) else [desc]:
        lines += [prose(as_text(para), names), ""]
    lines += [f"> {NOTE}", ""]
    for entry, spec in specs.items():
        title = "Variables" if entry == "main" else f"Variables of entry point `{entry}`"
        lines += [f"## {title}", ""]
        if entry != "main" and spec.get("short_description"):
            lines += [prose(as_text(spec["short_description"]), names), ""]
        options = spec.get("options") or {}
        if not options:
            lines += ["None.", ""]
            continue
        lines += ["| Name | Type | Default | Choices | Description |", "|---|---|---|---|---|"]
        for name, opt in options.items():
            default = "**required**" if opt.get("required") else code(opt.get("default"))
            if opt.get("no_log") and opt.get("default") not in (None, "", [], {}):
                default = "(hidden)"  # a secret's default stays out of the docs too
            choices = ", ".join(code(c) for c in opt.get("choices") or [])
            row = [code(name), type_of(opt), default, choices, prose(as_text(opt.get("description")), names)]
            lines.append("| " + " | ".join(cell(c) for c in row) + " |")
        lines.append("")
    return "\n".join(lines)


def all_names(role_dirs: list[Path]) -> frozenset[str]:
    return frozenset(n for r in role_dirs for s in load_specs(r).values() for n in (s.get("options") or {}))


def main(argv: list[str] | None = None, root: Path = ROOT) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 naming each stale README")
    args = ap.parse_args(argv)
    role_dirs = roles(root)
    names = all_names(role_dirs)
    stale = []
    for role in role_dirs:
        path = role / "README.md"
        want = render(role, names)
        have = path.read_text(encoding="utf-8") if path.is_file() else None
        if have == want:
            continue
        rel = path.relative_to(root)
        if args.check:
            stale.append(str(rel))
        else:
            path.write_text(want, encoding="utf-8")
            print(f"wrote {rel}")
    if stale:
        print(
            f"stale README (differs from meta/argument_specs.yml, or missing): {', '.join(stale)}; run {COMMAND}",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
