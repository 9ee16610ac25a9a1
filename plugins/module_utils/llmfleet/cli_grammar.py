"""The one grammar every ``llmfleet`` subcommand speaks, and the pieces that hold it.

- the endpoint is ``--url URL`` (today's older spellings still work, hidden, with one deprecation line on stderr);
- a list is comma-separated: ``--concurrency 1,16,64``;
- ``-o/--output`` names a FILE when the command writes one file, a DIR when it writes several (the help says which);
- ``--check`` says what would be done and does nothing;
- the deployment is ``--deployment NAME``;
- a timeout is named for what it bounds (``--request-timeout``, ``--node-timeout``, ``--stop-timeout``, ...);
- every ``--json`` document carries ``"schema": "llmfleet.<command>/<N>"``.

Stdlib only: node-side programs import the package too.
"""

from __future__ import annotations

import argparse
import math
import sys
from typing import Any

EXIT_CODES = "exit codes: 0 ok, 1 a check failed (the output says which), 2 bad usage or input (one line on stderr)"


def deprecated_note(old: str, new: str) -> None:
    print(f"llmfleet: {old} is deprecated and will be removed: use {new}", file=sys.stderr)


class DeprecatedAlias(argparse.Action):
    """A hidden old spelling of an option: stores into the new option's dest, says once on stderr to move."""

    def __init__(self, option_strings: list[str], dest: str, new: str = "", **kw: Any) -> None:
        self.new = new
        kw["help"] = argparse.SUPPRESS
        super().__init__(option_strings, dest, **kw)

    def __call__(
        self, parser: Any, namespace: argparse.Namespace, values: Any, option_string: str | None = None
    ) -> None:
        deprecated_note(option_string or self.option_strings[0], self.new)
        if self.nargs == 0:
            values = True
        setattr(namespace, self.dest, values)


def alias(p: argparse.ArgumentParser, old: str, new: str, dest: str, **kw: Any) -> None:
    """Add OLD as a hidden, deprecated spelling of NEW (same dest)."""
    p.add_argument(old, dest=dest, action=DeprecatedAlias, new=new, default=argparse.SUPPRESS, **kw)


def add_url(p: argparse.ArgumentParser, help_text: str, old: tuple[str, ...] = (), positional: bool = False) -> None:
    """``--url URL`` (required: `require_url` checks it after parsing, so an old spelling can stand in)."""
    p.add_argument("--url", metavar="URL", help=f"{help_text} (required)")
    for o in old:
        alias(p, o, "--url", "url", metavar="URL")
    if positional:
        p.add_argument("url_positional", nargs="?", metavar="URL", help=argparse.SUPPRESS)


def require_url(p_name: str, args: argparse.Namespace) -> str | None:
    """The URL the arguments give (moving a deprecated positional one over), or None after a usage line."""
    pos = getattr(args, "url_positional", None)
    if pos is not None:
        if args.url is not None:
            print(f"llmfleet {p_name}: give the URL once, as --url URL", file=sys.stderr)
            return None
        deprecated_note(f"`llmfleet {p_name} URL` (the URL as a positional argument)", "--url URL")
        args.url = pos
    if not args.url:
        print(f"llmfleet {p_name}: --url URL is required (e.g. --url http://head:8000)", file=sys.stderr)
        return None
    return args.url


def add_deployment(p: argparse.ArgumentParser, help_text: str, positional: bool = False) -> None:
    """``--deployment NAME``; where the name was positional, the positional stays as a hidden alias."""
    p.add_argument("--deployment", metavar="NAME", help=help_text)
    if positional:
        p.add_argument("deployment_positional", nargs="?", metavar="DEPLOYMENT", help=argparse.SUPPRESS)


def settle_deployment(cmd: str, args: argparse.Namespace) -> str | None:
    """Move a deprecated positional deployment name to args.deployment; the problem when both disagree."""
    pos = getattr(args, "deployment_positional", None)
    if pos is None:
        return None
    args.deployment_positional = None  # said once, even when asked again
    if getattr(args, "deployment", None) not in (None, pos):
        return f"two deployments named ({pos!r} and --deployment {args.deployment!r}): give it once, as --deployment"
    deprecated_note(f"`llmfleet {cmd} DEPLOYMENT` (the name as a positional argument)".replace("  ", " "),
                    "--deployment NAME")  # fmt: skip
    args.deployment = pos
    return None


def int_list(low: int = 1) -> Any:
    """A comma-separated list of whole numbers >= low, e.g. ``1,16,64``."""

    def parse(text: str) -> list[int]:
        out = []
        for raw in text.split(","):
            part = raw.strip()
            try:
                n = int(part)
            except ValueError:
                raise argparse.ArgumentTypeError(
                    f"{text!r}: {part!r} is not a whole number (give N or N,N,... e.g. 1,16,64)"
                ) from None
            if n < low:
                raise argparse.ArgumentTypeError(f"{text!r}: {n} is too small (each must be >= {low})")
            out.append(n)
        return out

    parse.__name__ = "list"  # argparse names the type in its message
    return parse


class CommaList(argparse.Action):
    """``--x 1,16,64`` (the grammar); ``--x 1 16 64`` still works, with a deprecation line (nargs='+')."""

    def __call__(
        self, parser: Any, namespace: argparse.Namespace, values: Any, option_string: str | None = None
    ) -> None:
        if len(values) > 1:
            deprecated_note(f"{option_string} with space-separated values", f"{option_string} N,N,...")
        setattr(namespace, self.dest, [n for v in values for n in v])


def _number(convert: Any, name: str, not_one: str, problem: Any) -> Any:
    """An argparse type: convert(text), a usage error naming the text when it is no number or problem(text, value)
    says what is wrong with it (nan and inf included: not a traceback three calls later)."""

    def parse(text: str) -> Any:
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {not_one}") from None
        why = problem(text, value)
        if why:
            raise argparse.ArgumentTypeError(why)
        return value

    parse.__name__ = name
    return parse


def finite_positive(what: str) -> Any:
    """A finite number of `what` > 0."""

    def problem(text: str, v: float) -> str | None:
        return None if math.isfinite(v) and v > 0 else f"{text!r}: give a finite number of {what} > 0"

    return _number(float, what, f"a number of {what}", problem)


# The on-call commands' and llmfleet accept's timeouts.
positive_seconds = finite_positive("seconds")


def at_least(low: int) -> Any:
    """A whole number >= low."""
    return _number(int, "whole number", f"a whole number (give one >= {low})",
                   lambda _, n: f"{n} is too small: give a number >= {low}" if n < low else None)  # fmt: skip


def stamp_schema(doc: Any, name: str) -> Any:
    """DOC with ``schema`` first, unless it names its own (a mapping; anything else unchanged)."""
    if isinstance(doc, dict) and "schema" not in doc:
        return {"schema": f"llmfleet.{name}/1", **doc}
    return doc


# ---- shell completion, generated from the parser ------------------------------------------------------------


def _words(p: argparse.ArgumentParser) -> tuple[list[str], dict[str, argparse.ArgumentParser]]:
    opts: list[str] = []
    subs: dict[str, argparse.ArgumentParser] = {}
    for a in p._actions:
        if isinstance(a, argparse._SubParsersAction):
            subs.update(a.choices)
        elif a.help is not argparse.SUPPRESS:
            opts += [o for o in a.option_strings if o.startswith("--")]
    return sorted(opts), subs


def completion_script(parser: argparse.ArgumentParser, shell: str) -> str:
    """A bash (or zsh, through bashcompinit) completion script: subcommands, then each one's options."""
    top_opts, subs = _words(parser)
    cases = []
    for name, sp in sorted(subs.items()):
        opts, inner = _words(sp)
        words = " ".join(sorted(inner) + opts)
        cases.append(f'        {name}) words="{words}" ;;')
    body = "\n".join(cases)
    script = f"""# llmfleet {shell} completion (generated from the parser: llmfleet completion {shell})
_llmfleet() {{
    local cur cmd words
    cur="${{COMP_WORDS[COMP_CWORD]}}"
    if [ "$COMP_CWORD" -eq 1 ]; then
        COMPREPLY=($(compgen -W "{" ".join(sorted(subs))} {" ".join(top_opts)}" -- "$cur"))
        return 0
    fi
    cmd="${{COMP_WORDS[1]}}"
    case "$cmd" in
{body}
        *) words="" ;;
    esac
    COMPREPLY=($(compgen -W "$words" -- "$cur"))
    if [ ${{#COMPREPLY[@]}} -eq 0 ]; then
        COMPREPLY=($(compgen -f -- "$cur"))
    fi
    return 0
}}
"""
    if shell == "zsh":
        script += "autoload -Uz bashcompinit && bashcompinit\n"
    script += "complete -o filenames -F _llmfleet llmfleet\n"
    return script
