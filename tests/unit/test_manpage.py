"""The llmfleet(1) man page (python -m llmfleet.manpage), generated from the CLI's parser: every subcommand has its
section with usage, options, exit codes and an example; man (or groff, or a structural check where neither is
installed) renders it without a warning; roff's special characters in help texts are escaped."""

import argparse
import re
import shutil
import subprocess
import sys

import pytest

from llmfleet import manpage
from llmfleet.cli import build_parser


def commands(p: argparse.ArgumentParser, prefix: str = "") -> list[str]:
    out = []
    for name, sp, _ in manpage._subparsers(p):
        out.append(prefix + name)
        out += commands(sp, f"{prefix}{name} ")
    return out


@pytest.fixture(scope="module")
def page() -> str:
    return manpage.render(build_parser())


def test_every_subcommand_has_its_section_with_usage_options_exit_codes_and_an_example(page):
    names = commands(build_parser())
    assert len(names) >= 20 and "accept" in names and "checkpoint verify" in names and "bundle" in names
    for name in names:
        head = f".SS {manpage.esc(name)}\n"
        assert head in page, name
        body = page[page.index(head) : page.find("\n.SS ", page.index(head) + 1)]
        assert "\n.nf\nllmfleet " in body, name  # its usage
        if name not in ("checkpoint", "exec"):  # groups and the raw-argv exec list no options of their own
            assert "\n.TP\n.B " in body, name
        if " " not in name:  # a top command's help ends with exit codes and an example
            assert "exit codes: " in body and "example: llmfleet" in body, name
    for sec in manpage.SECTION_ORDER:
        assert f"\n.SH {sec}\n" in page
    assert page.startswith(".TH LLMFLEET 1 ")


def test_roff_specials_in_help_texts_are_escaped():
    p = argparse.ArgumentParser(prog="llmfleet", description="x.")
    sub = p.add_subparsers(dest="cmd")
    sp = sub.add_parser("odd", help="odd texts", epilog=".PP a request\n'quoted")
    sp.add_argument("--path", help=r"a \path with -dashes")
    text = manpage.render(p)
    assert r"a \epath with \-dashes" in text
    assert "\n\\&.PP a request\n\\&'quoted\n" in text
    assert not re.search(r"^\.(?!TH|SH|SS|PP|TP|B |nf|fi)", text, re.M)  # no request but the page's own


def render_with(tool: list[str], path, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([*tool, str(path)], capture_output=True, text=True, timeout=120, env=env, check=False)


def test_man_renders_it_without_a_warning(tmp_path, page):
    path = tmp_path / "llmfleet.1"
    assert manpage.main(["-o", str(path)]) == 0
    assert path.read_text().split("\n")[1:] == page.split("\n")[1:]  # the same page (the first line has the date)
    if shutil.which("groff"):
        # -ww: every warning; -z: no output, the warnings alone on stderr
        r = render_with(["groff", "-man", "-Tutf8", "-ww", "-z"], path)
        assert r.returncode == 0 and r.stderr == "", r.stderr[:2000]
    if shutil.which("man"):
        r = render_with(
            ["man", "-l"], path, env={"MANWIDTH": "100", "PATH": "/usr/bin:/bin", "MAN_KEEP_FORMATTING": ""}
        )
        assert r.returncode == 0, r.stderr
        assert "llmfleet - Bare-metal GPU nodes" in r.stdout and "EXIT STATUS" in r.stdout
        assert "llmfleet accept [-h]" in r.stdout and "--request-timeout" in r.stdout
    if not shutil.which("groff") and not shutil.which("man"):
        # structural: every request is one the man macros know, every .nf closed by .fi
        assert page.count("\n.nf\n") == page.count("\n.fi\n")


def test_the_generator_runs_as_a_module(tmp_path):
    r = subprocess.run([sys.executable, "-m", "llmfleet.manpage"], capture_output=True, text=True, timeout=120,
                       check=False)  # fmt: skip
    assert r.returncode == 0 and r.stdout.startswith(".TH LLMFLEET 1 ") and ".SS bundle" in r.stdout
    bad = subprocess.run([sys.executable, "-m", "llmfleet.manpage", "-o", str(tmp_path / "no/such/dir/x.1")],
                         capture_output=True, text=True, timeout=120, check=False)  # fmt: skip
    assert bad.returncode == 2 and "cannot write" in bad.stderr and "Traceback" not in bad.stderr
