"""The llmfleet(1) man page, generated from the CLI's own parser (every subcommand's usage, options, exit codes and
example), so it never drifts from `llmfleet --help`. Ops host, at build or install time:

    python -m llmfleet.manpage -o llmfleet.1        # then: man -l llmfleet.1
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import re
import sys

from . import __version__

SECTION_ORDER = ("NAME", "SYNOPSIS", "DESCRIPTION", "COMMANDS", "EXIT STATUS", "SEE ALSO")


def esc(text: str) -> str:
    """Text as roff reads it literally: backslashes and hyphens escaped, a line never starting a request."""
    out = []
    for raw in str(text).split("\n"):
        line = raw.replace("\\", "\\e").replace("-", "\\-")
        out.append("\\&" + line if line.startswith((".", "'")) else line)
    return "\n".join(out)


def _subparsers(p: argparse.ArgumentParser) -> list[tuple[str, argparse.ArgumentParser, str]]:
    """(name, parser, one-line help) of p's subcommands, in the order --help lists them."""
    out = []
    for a in p._actions:
        if isinstance(a, argparse._SubParsersAction):
            helps = {c.dest: c.help or "" for c in a._choices_actions}
            out += [(name, sp, helps.get(name, "")) for name, sp in a.choices.items()]
    return out


def _option_label(a: argparse.Action) -> str:
    if not a.option_strings:
        return a.metavar if isinstance(a.metavar, str) else a.dest
    if a.nargs == 0:
        return ", ".join(a.option_strings)
    meta = a.metavar if isinstance(a.metavar, str) else a.dest.upper()
    return ", ".join(f"{o} {meta}" for o in a.option_strings)


def _help_text(p: argparse.ArgumentParser, a: argparse.Action) -> str:
    text = a.help or ""
    if "%(" in text:
        try:
            text = text % {**vars(a), "prog": p.prog, "default": a.default}
        except (KeyError, TypeError, ValueError):
            pass
    if a.choices and not isinstance(a, argparse._SubParsersAction):
        text += f" (one of: {', '.join(map(str, a.choices))})"
    return " ".join(text.split())


def _command(name: str, p: argparse.ArgumentParser, summary: str, depth: int = 0) -> list[str]:
    lines = [f".SS {esc(name)}"]
    if summary:
        lines += [esc(summary[:1].upper() + summary[1:]) + ("" if summary.endswith(".") else ".")]
    if p.description:
        lines += [".PP", esc(" ".join(p.description.split()))]
    usage = " ".join(p.format_usage().removeprefix("usage: ").split())
    lines += [".PP", ".nf", esc(usage), ".fi"]
    skip = (argparse._SubParsersAction, argparse._HelpAction)
    actions = [a for a in p._actions if a.help is not argparse.SUPPRESS and not isinstance(a, skip)]
    for a in actions:
        lines += [".TP", f".B {esc(_option_label(a))}", esc(_help_text(p, a) or "-")]
    if p.epilog:
        lines += [".PP", ".nf", esc(p.epilog.strip()), ".fi"]
    for sub, sp, text in _subparsers(p):
        lines += _command(f"{name} {sub}", sp, text, depth + 1)
    return lines


def render(parser: argparse.ArgumentParser, today: dt.date | None = None) -> str:
    """The man page (roff, man macros) of `parser`: the top's description and grammar, then every subcommand."""
    day = (today or dt.date.today()).isoformat()
    top_epilog = parser.epilog or ""
    exit_lines = [x for x in top_epilog.split("\n\n")[0].split("\n") if x.strip()]
    rest = top_epilog.split("\n\n", 1)[1] if "\n\n" in top_epilog else ""
    out = [
        f'.TH LLMFLEET 1 "{day}" "llmfleet {esc(__version__)}" "User Commands"',
        ".SH NAME",
        "llmfleet \\- " + esc((parser.description or "").rstrip(".")),
        ".SH SYNOPSIS",
        ".B llmfleet",
        "[\\-\\-version] COMMAND [OPTIONS]",
        ".SH DESCRIPTION",
        esc(parser.description or ""),
    ]
    if rest:
        out += [".PP", ".nf", esc(rest.strip()), ".fi"]
    out += [".SH COMMANDS"]
    for name, sp, text in _subparsers(parser):
        out += _command(name, sp, text)
    out += [".SH EXIT STATUS", ".nf", esc("\n".join(exit_lines)), ".fi",
            "Each command's own exit codes end its section above.",
            ".SH SEE ALSO",
            "llmfleet \\fICOMMAND\\fR \\-\\-help; llmfleet completion bash|zsh; docs/ in the source tree."]  # fmt: skip
    text = "\n".join(out) + "\n"
    # no line may start with a space either (roff would break there): the usage lines are joined above
    return re.sub(r"\n +", "\n", text)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m llmfleet.manpage", description="Write the llmfleet(1) man page.")
    ap.add_argument("-o", "--output", metavar="FILE", help="write it to FILE (default: stdout)")
    args = ap.parse_args(argv)
    from .cli import build_parser

    page = render(build_parser())
    if not args.output:
        sys.stdout.write(page)
        return 0
    try:
        tmp = f"{args.output}.tmp{os.getpid()}"
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(page)
        os.replace(tmp, args.output)
    except OSError as e:
        print(f"llmfleet.manpage: cannot write {args.output}: {e.strerror or e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
