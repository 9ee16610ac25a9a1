"""One grammar for every `llmfleet` subcommand: a walk over the real parser, then each fixed bug and each
deprecated spelling on its own."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from llmfleet import cli, cli_grammar
from tests.helpers.fake_openai import FakeOpenAI

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT / "module_utils")}
OLD_SPELLINGS = {"--base-url", "--keep", "--dry-run", "--output-dir", "--timeout"}


def subcommands(parser: argparse.ArgumentParser, prefix: str = "") -> list[tuple[str, argparse.ArgumentParser]]:
    """(name, parser) of every subcommand, nested ones (`checkpoint verify`) included."""
    out = []
    for a in parser._actions:
        if isinstance(a, argparse._SubParsersAction):
            for name, sp in a.choices.items():
                full = f"{prefix} {name}".strip()
                out.append((full, sp))
                out += subcommands(sp, full)
    return out


PARSER = cli.build_parser()
ALL = subcommands(PARSER)


def visible(sp: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in sp._actions if a.help is not argparse.SUPPRESS and not isinstance(a, argparse._HelpAction)]


def test_the_walk_sees_every_subcommand():
    names = {n for n, _ in ALL}
    assert len(names) >= 22 and {"accept", "bench", "warmup", "why", "stage", "completion", "exec"} <= names


@pytest.mark.parametrize(("name", "sp"), ALL, ids=[n for n, _ in ALL])
def test_every_subcommand_holds_to_the_grammar(name, sp):
    text = sp.format_help()
    assert "exit codes: 0 " in text and f"example: llmfleet {name.split()[0]}" in text, text
    for a in visible(sp):
        opts = set(a.option_strings)
        assert not opts & OLD_SPELLINGS, f"{name}: {opts & OLD_SPELLINGS} is an old spelling, shown as primary"
        if not a.option_strings:  # a positional: never the endpoint or the deployment
            assert a.dest not in ("url", "base_url", "deployment"), f"{name}: positional {a.dest}"
            assert "URL" not in str(a.metavar or ""), f"{name}: positional {a.metavar}"
        if "url" in a.dest:
            assert "--url" in opts, f"{name}: the endpoint is {opts}, not --url"
        if a.dest == "deployment":
            assert "--deployment" in opts, f"{name}: the deployment is {opts}"
        if "-o" in opts:
            assert "--output" in opts and a.metavar in ("FILE", "DIR", None), f"{name}: -o is {opts} {a.metavar}"
        if a.nargs == "+" and a.option_strings:  # a list: comma-separated (spaces only as the deprecated form)
            assert isinstance(a, cli_grammar.CommaList), f"{name}: {opts} is a space-separated list"
        if "timeout" in a.dest and a.option_strings:
            assert all(o.endswith("-timeout") and o != "--timeout" for o in a.option_strings), f"{name}: {opts}"
    assert not ({"--check", "--dry-run"} <= {o for a in sp._actions for o in a.option_strings if a.help is not
                                             argparse.SUPPRESS})  # fmt: skip
    if any("--json" in a.option_strings for a in sp._actions):
        # the document gets "schema" (cli._run_json), or names its own format (checkpoint manifest)
        stamped = sp._defaults.get("schema_name", name)  # what main() passes to _run_json
        assert stamped or name == "checkpoint manifest", name


def test_every_json_document_gets_a_schema(monkeypatch, capsys):
    def fake(args):
        print(json.dumps({"x": 1}))
        return 0

    ns = argparse.Namespace(func=fake, json=True, cmd="status")
    assert cli._run_json(ns, "status") == 0
    assert json.loads(capsys.readouterr().out) == {"schema": "llmfleet.status/1", "x": 1}
    ns.func = lambda args: print(json.dumps({"schema": "llmfleet.why/1"})) or 1
    assert cli._run_json(ns, "why") == 1
    assert json.loads(capsys.readouterr().out) == {"schema": "llmfleet.why/1"}  # its own is kept


def test_json_through_main_carries_the_schema(tmp_path, capsys):
    metrics = tmp_path / "metrics.txt"
    metrics.write_text("vllm:num_requests_running 0\n")
    cli.main(["specdecode", str(metrics), "--steps", "2", "--json"])
    assert json.loads(capsys.readouterr().out)["schema"] == "llmfleet.specdecode/1"
    assert cli.main(["completion", "bash"]) == 0  # no --json: the output is not touched
    assert capsys.readouterr().out.startswith("# llmfleet bash completion")


def test_top_level_help_states_exit_codes_and_the_grammar():
    text = PARSER.format_help()
    assert "exit codes: 0 ok, 1 a check failed" in text and "2 bad usage or input" in text
    assert "--url URL" in text and "N,N,..." in text and "-o/--output" in text and '"schema"' in text


# ---- the bugs ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv", [["--help"], ["completion", "bash"], ["accept", "--help"], ["specdecode", "{metrics}", "--steps", "2"]]
)
def test_a_reader_that_has_gone_is_no_traceback(tmp_path, argv):
    """`llmfleet ... | head`: the reader closes the pipe; no BrokenPipeError traceback, not even at exit."""
    metrics = tmp_path / "metrics.txt"
    metrics.write_text("vllm:num_requests_running 0\n")
    argv = [a.format(metrics=metrics) for a in argv]
    r, w = os.pipe()
    os.close(r)  # the reader has gone before the first write
    try:
        cp = subprocess.run([sys.executable, "-m", "llmfleet", *argv], stdout=w, stderr=subprocess.PIPE,
                            text=True, env=ENV, check=False)  # fmt: skip
    finally:
        os.close(w)
    assert "Traceback" not in cp.stderr and "BrokenPipe" not in cp.stderr, cp.stderr
    assert cp.returncode == (0 if "--help" in argv else 141)  # argparse drops a help it cannot write


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "NaN", "0", "-3"])
@pytest.mark.parametrize("flag", ["--gpu-memory-gib", "--mem-fraction"])
def test_fit_nan_or_inf_is_a_usage_error(tmp_path, capsys, flag, value):
    with pytest.raises(SystemExit) as e:
        cli.main(["fit", str(tmp_path), "--engine", "vllm", "--tp", "1", f"{flag}={value}"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}" in err and "give a finite number" in err and "Traceback" not in err


def _accept(fake: FakeOpenAI, tmp_path: Path, capsys, profile: dict | None = None) -> tuple[int, dict, str]:
    argv = ["accept", "--url", fake.url, "--model", "det", "--json"]
    if profile is not None:
        p = tmp_path / "p.yml"
        p.write_text(json.dumps(profile))
        argv += ["--profile", str(p)]
    rc = cli.main(argv)
    out = capsys.readouterr()
    return rc, json.loads(out.out), out.err


def test_accept_lowers_its_default_max_tokens_to_fit_max_model_len_and_says_so(tmp_path, capsys):
    with FakeOpenAI(max_model_len=512) as fake:
        rc, rep, _ = _accept(fake, tmp_path, capsys)
    assert rep["schema"] == "llmfleet.accept/1"
    hard = [c for c in rep["checks"] if c["mode"] == "gate" and c["verdict"] == "fail"]
    assert not hard, hard
    assert not any("cannot be greater than max_model_len" in json.dumps(c) for c in rep["checks"])
    assert rep["settings"]["max_tokens"] == 256
    assert any("max_tokens lowered from the default 1024 to 256 to fit max_model_len 512" in w for w in rep["warnings"])
    assert rc == (0 if rep["accepted"] else 1)


def test_accept_never_changes_a_profiles_own_max_tokens(tmp_path, capsys):
    with FakeOpenAI(max_model_len=512) as fake:
        rc, rep, _ = _accept(fake, tmp_path, capsys, profile={"max_tokens": 1024})
    assert rep["settings"]["max_tokens"] == 1024  # as the profile says
    assert any("max_tokens 1024 from the profile" in w and "lower max_tokens in the profile" in w
               for w in rep["warnings"])  # fmt: skip
    assert rc == 1  # the engine refuses it: the gate fails, as it should


def test_stage_progress_off_a_terminal_is_plain_lines_with_no_carriage_return(tmp_path):
    from tests.helpers.ckpt import make_checkpoint

    src = make_checkpoint(tmp_path / "src")
    cp = subprocess.run(
        [
            sys.executable,
            "-m",
            "llmfleet",
            "stage",
            str(src),
            "--model",
            "m",
            "--revision",
            "c" * 40,
            "--root",
            str(tmp_path / "nvme"),
        ],
        capture_output=True,
        env=ENV,
        check=False,
    )  # fmt: skip (bytes: text mode reads \r as \n)
    err = cp.stderr.decode()
    assert cp.returncode == 0, err
    assert "\r" not in err and "100.0%" in err


def test_eta_from_a_snapshot():
    snap = {"total_bytes": 10 * 2**30, "done_bytes": 4 * 2**30, "rate_bytes_per_s": 2**30 // 10}
    assert cli.eta_text(snap) == " ETA 1m00s"
    assert cli.eta_text({**snap, "rate_bytes_per_s": 2**20}) == " ETA 1h42m"
    assert cli.eta_text({**snap, "done_bytes": snap["total_bytes"]}) == ""
    assert cli.eta_text({**snap, "rate_bytes_per_s": 0}) == ""


def test_bench_without_o_says_where_it_writes(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    rc = cli.main(["bench", "--engine", "vllm", "--url", "http://127.0.0.1:1", "--tokenizer", str(tmp_path),
                   "--input-len", "8", "--output-len", "8", "--concurrency", "1", "--rounds", "1"])  # fmt: skip
    err = capsys.readouterr().err
    made = [p.name for p in tmp_path.iterdir() if p.name.startswith("servebench-")]
    assert rc == 1 and len(made) == 1 and f"writing the results to ./{made[0]}/ (give -o DIR to choose)" in err


# ---- the old spellings: still work, each says so once on stderr ----------------------------------------------


def _parsed(argv: list[str], capsys) -> tuple[argparse.Namespace, str]:
    a = PARSER.parse_args(argv)
    return a, capsys.readouterr().err


BENCH = ["bench", "--engine", "vllm", "--tokenizer", "t", "--output-len", "8"]


@pytest.mark.parametrize(
    ("argv", "attr", "value", "old"),
    [
        ([*BENCH, "--base-url", "http://h:1", "--input-len", "8", "--concurrency", "1"], "url", "http://h:1",
         "--base-url"),
        ([*BENCH, "--url", "http://h:1", "--input-len", "8", "--concurrency", "1", "16", "64"], "concurrency",
         [1, 16, 64], "--concurrency with space-separated values"),
        ([*BENCH, "--url", "u", "--input-len", "8", "--concurrency", "1", "--output-dir", "d"], "output_dir", "d",
         "--output-dir"),
        ([*BENCH, "--url", "u", "--input-len", "8", "--concurrency", "1", "--dry-run"], "dry_run", True, "--dry-run"),
        (["accept", "--url", "u", "--model", "m", "--timeout", "5"], "timeout", 5.0, "--timeout"),
        (["warmup", "--url", "u", "--model", "m", "--lengths", "8", "--timeout", "5"], "timeout", "5", "--timeout"),
        (["status", "--timeout", "5"], "timeout", 5.0, "--timeout"),
        (["stop", "--timeout", "5"], "timeout", 5.0, "--timeout"),
        (["why", "--keep", "d"], "keep", "d", "--keep"),
        (["stage", "s", "--model", "m", "--revision", "c" * 40, "--keep", "3"], "keep_revisions", 3, "--keep"),
    ],
)  # fmt: skip
def test_an_old_option_spelling_works_and_says_so(capsys, argv, attr, value, old):
    a, err = _parsed(argv, capsys)
    assert getattr(a, attr) == value
    assert err.count("\n") == 1 and f"llmfleet: {old} is deprecated" in err, err


def test_the_new_spellings_say_nothing(capsys):
    _, err = _parsed([*BENCH, "--url", "u", "--input-len", "8", "--concurrency", "1,16,64", "-o", "d", "--check"],
                     capsys)  # fmt: skip
    assert err == ""


def test_accept_with_a_positional_url_works_and_says_so(capsys):
    with FakeOpenAI() as fake:
        rc = cli.main(["accept", fake.url, "--model", "det", "--json"])
        out = capsys.readouterr()
    assert rc in (0, 1) and json.loads(out.out)["url"].startswith(fake.url)
    assert "`llmfleet accept URL` (the URL as a positional argument) is deprecated" in out.err
    assert cli.main(["accept", "--url", "http://a:1", "http://b:1", "--model", "det"]) == 2
    assert "give the URL once" in capsys.readouterr().err


def test_a_positional_deployment_works_and_says_so(capsys):
    a, _ = _parsed(["status", "demo"], capsys)
    assert cli_grammar.settle_deployment("status", a) is None and a.deployment == "demo"
    assert "`llmfleet status DEPLOYMENT` (the name as a positional argument) is deprecated" in capsys.readouterr().err
    a, _ = _parsed(["status", "demo", "--deployment", "other"], capsys)
    assert "two deployments named" in cli_grammar.settle_deployment("status", a)


def test_specdecode_with_a_positional_url_says_so(capsys):
    rc = cli.main(["specdecode", "http://127.0.0.1:1/metrics", "--steps", "2"])
    err = capsys.readouterr().err
    assert rc == 2 and "`llmfleet specdecode URL`" in err and "deprecated" in err
    assert cli.main(["specdecode", "--steps", "2"]) == 2  # neither --url nor FILE
    assert "give --url URL" in capsys.readouterr().err


# ---- shell completion -------------------------------------------------------------------------------------------


def test_bash_completion_is_valid_bash_and_knows_every_command(tmp_path, capsys):
    assert cli.main(["completion", "bash"]) == 0
    script = capsys.readouterr().out
    f = tmp_path / "llmfleet.bash"
    f.write_text(script)
    assert subprocess.run(["bash", "-n", str(f)], check=False).returncode == 0
    for name, _ in ALL:
        assert f"{name.split()[-1]}" in script
    assert "--url" in script and "--base-url" not in script  # hidden spellings are not offered
    # It completes: COMP_WORDS as bash sets them for `llmfleet bench --u<TAB>`.
    cp = subprocess.run(["bash", "-c", f'source {f}; COMP_WORDS=(llmfleet bench --u); COMP_CWORD=2; _llmfleet; '
                         'echo "${COMPREPLY[@]}"'], capture_output=True, text=True, check=False)  # fmt: skip
    assert cp.stdout.split() == ["--url"], cp


@pytest.mark.skipif(not shutil.which("zsh"), reason="zsh is not installed here")
def test_zsh_completion_parses(tmp_path, capsys):
    cli.main(["completion", "zsh"])
    f = tmp_path / "_llmfleet"
    f.write_text(capsys.readouterr().out)
    assert subprocess.run(["zsh", "-n", str(f)], check=False).returncode == 0
