"""`llmfleet warmup` and llmfleet_engine_warmup: the matrix is sent as asked (sizes, concurrency, distinct
prompts), failures stay in their cell and fail the run, every wait ends, the key never shows.

Served by tests/helpers/fake_openai.py, a TEST DOUBLE of an OpenAI-compatible engine (its shapes are held to
real vLLM 0.32 captures by test_accept.py); its `jit_delay`, `gather` and `oom_prompt_tokens` stand in for what a
GPU engine does at a new shape. The CLI tests at the end run the CLI and the double as separate processes. No
real engine runs here: what the warm-up proves on one is in docs/warmup.md."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import llmfleet_engine_warmup as mod
from llmfleet.accept import warmup
from tests.helpers.fake_openai import FakeOpenAI
from tests.unit.modules.util import fail, run, undocumented

ROOT = Path(__file__).resolve().parents[2]
KEY = "sk-warm-0123456789abcdef"
CHAT = "/v1/chat/completions"


def settings(url, lengths=(128,), concurrency=(1,), **kw):
    return warmup.check_settings(url, list(lengths), list(concurrency), **{"timeout": 5.0, "deadline": 60.0, **kw})


def chats(fake):
    return [b for method, path, b in fake.requests if method == "POST" and path == CHAT]


def cli(*argv):
    ap = argparse.ArgumentParser(prog="llmfleet warmup")
    warmup.add_arguments(ap)
    return warmup.run(ap.parse_args(list(argv)))


# ---- the matrix as asked ---------------------------------------------------------------------------------


def test_the_matrix_is_sent_in_order_sized_by_tokenize_with_a_distinct_prompt_per_request():
    with FakeOpenAI() as fake:
        rep = warmup.warmup(fake.url, "det", settings(fake.url, [128, 1024], [1, 3], rounds=2))
        sent = chats(fake)
    assert rep["ok"] is True and rep["failed_cells"] == [] and rep["summary"].startswith("WARMED UP: 4/4 cells ok, 16")
    assert [(c["input_len"], c["concurrency"], c["status"]) for c in rep["cells"]] == [
        (128, 1, "ok"), (128, 3, "ok"), (1024, 1, "ok"), (1024, 3, "ok")]  # fmt: skip
    assert [c["requests"] for c in rep["cells"]] == [2, 6, 2, 6] and len(sent) == 16
    assert [len(c["rounds"]) for c in rep["cells"]] == [2, 2, 2, 2]
    assert [len(r["ttft_ms"]) for r in rep["cells"][1]["rounds"]] == [3, 3]
    # Sized with the double's /tokenize (the chat template applied), within the checker's 2 %.
    assert rep["sizing"]["method"] == "tokenize"
    for c in rep["cells"]:
        assert abs(c["prompt_tokens"] - c["input_len"]) <= max(8, c["input_len"] * 0.02)
        lo, hi = c["usage_prompt_tokens"]
        assert abs(lo - c["input_len"]) <= max(8, c["input_len"] * 0.02) and hi - lo <= 1
    # No two prompts alike, and they differ from their first sentence's number on: a prefix cache has
    # nothing to reuse beyond the template's header and "The secret number for the vault is ".
    contents = [b["messages"][0]["content"] for b in sent]
    assert len(set(contents)) == 16 and len({c[:45] for c in contents}) == 16
    assert all(c.startswith("The secret number for the vault is ") for c in contents)
    # Streaming, small, EOS ignored; the measured times are there.
    assert all(b["stream"] and b["max_tokens"] == 8 and b["ignore_eos"] is True for b in sent)
    assert all(c["ttft_ms_p50"] is not None and c["ttft_ms_max"] >= c["ttft_ms_p50"] for c in rep["cells"])
    assert all("first_round_ttft_ms_p50" in c and "last_round_ttft_ms_p50" in c for c in rep["cells"])
    assert rep["started_at"] <= rep["ended_at"] and rep["wall_s"] >= sum(c["wall_s"] for c in rep["cells"])


def test_concurrency_means_at_once():
    """The double holds each stream until `gather` are in flight: a warm-up that sent them one after another
    would fail here (the control: 2 at once against a double waiting for 4 does)."""
    with FakeOpenAI(gather=4, gather_timeout=1.0) as fake:
        rep = warmup.warmup(fake.url, "det", settings(fake.url, [128], [4], rounds=2))
    assert rep["ok"] and rep["cells"][0]["requests"] == 8
    with FakeOpenAI(gather=4, gather_timeout=1.0) as fake:
        rep = warmup.warmup(fake.url, "det", settings(fake.url, [128], [2]))
    assert not rep["ok"] and "fewer than 4 streams came at once" in rep["cells"][0]["why"]


def test_the_first_round_shows_what_the_shape_cost():
    with FakeOpenAI(jit_delay=1.0) as fake:
        rep = warmup.warmup(fake.url, "det", settings(fake.url, [128], [2], rounds=2))
        paid = list(fake.jit_paid)
    cell = rep["cells"][0]
    assert rep["ok"] and paid == [128]  # one prompt size, compiled once, by the first round
    assert cell["first_round_ttft_ms_p50"] >= 1000.0  # both first-round requests waited for the "compilation"
    assert cell["rounds"][0]["ttft_ms_max"] >= 1000.0
    assert "1st/last TTFT p50" in warmup.render_table(rep)[1]


def test_without_tokenize_prompts_are_sized_by_the_documented_approximation():
    with FakeOpenAI(faults={"no_tokenize"}) as fake:
        rep = warmup.warmup(fake.url, "det", settings(fake.url, [256]))
    assert rep["ok"] and rep["sizing"]["method"] == "approximate"
    assert "sized by approximation (4 characters a token" in warmup.render_table(rep)[0]


# ---- failures stay in their cell, every wait ends ---------------------------------------------------------


def test_a_cell_the_engine_fails_is_named_and_the_others_pass():
    with FakeOpenAI(oom_prompt_tokens=1000) as fake:
        rep = warmup.warmup(fake.url, "det", settings(fake.url, [128, 2048], [2]))
    ok, bad = rep["cells"]
    assert ok["status"] == "ok" and bad["status"] == "failed" and bad["errors"] == 2
    assert bad["why"] == "2 of 2 request(s) failed: HTTP 500: CUDA out of memory. Tried to allocate 2.00 GiB"
    assert bad["error_samples"] == ["HTTP 500: CUDA out of memory. Tried to allocate 2.00 GiB"]
    assert "read the engine's log" in bad["fix"]
    assert rep["ok"] is False and rep["failed_cells"] == ["2048x2"]
    assert rep["summary"].startswith("WARM-UP FAILED (2048x2)")


def test_a_length_over_the_served_context_fails_its_cell_without_being_sent():
    with FakeOpenAI(max_model_len=1024) as fake:
        rep = warmup.warmup(fake.url, "det", settings(fake.url, [128, 1020, 2048]))
        sizes = [fake.tokenize({"messages": b["messages"]})["count"] for b in chats(fake)]
    assert [c["status"] for c in rep["cells"]] == ["ok", "failed", "failed"]
    assert rep["cells"][2]["why"] == ("input_len 2048 + max_tokens 8 does not fit max_model_len 1024: the engine "
                                      "would refuse it (HTTP 400); nothing sent")  # fmt: skip
    assert rep["cells"][1]["requests"] == 0 and "1020 + max_tokens 8" in rep["cells"][1]["why"]
    assert len(sizes) == 1 and sizes[0] < 200 and rep["preflight"]["max_model_len"] == 1024


def test_a_first_token_later_than_the_timeout_fails_the_cell_saying_how_long_it_waited():
    with FakeOpenAI(faults={"slow_first_token"}, first_token_delay=2.0) as fake:
        rep = warmup.warmup(fake.url, "det", settings(fake.url, [128], [2], timeout=0.5))
    cell = rep["cells"][0]
    assert cell["status"] == "failed" and cell["errors"] == 2
    assert cell["error_samples"] == ["no token 0.5 s after sending (the per-request timeout, 0.5 s)"]
    assert "raise the per-request timeout" in cell["fix"]


def test_a_hang_the_socket_timeout_notices_first_reads_as_the_wait_for_the_first_token(monkeypatch):
    """Seen under load (make test): the socket's own timeout (the same limit) can end the request before the
    waiting loop wakes; it said 'timed out (timed out)'. Here the socket times out first, always."""
    from llmfleet.accept import client

    send = client.Client._send

    def early(self, box, method, path, data, timeout, **kw):
        return send(self, box, method, path, data, 0.2, **kw)  # the socket gives up before the loop's 1 s

    monkeypatch.setattr(client.Client, "_send", early)
    with FakeOpenAI(faults={"slow_first_token"}, first_token_delay=3.0) as fake:
        rep = warmup.warmup(fake.url, "det", settings(fake.url, [128], [1], timeout=1.0))
    (sample,) = rep["cells"][0]["error_samples"]
    assert sample.startswith("no token 0.") and sample.endswith("(the per-request timeout, 1 s)"), sample


def test_the_overall_deadline_cuts_the_request_in_flight_and_the_rest_is_not_run():
    with FakeOpenAI(faults={"slow_first_token"}, first_token_delay=2.0) as fake:
        rep = warmup.warmup(fake.url, "det", settings(fake.url, [128, 256], [1], timeout=30.0, deadline=1.0))
    first, second = rep["cells"]
    assert first["status"] == "failed" and "deadline" in first["why"]
    assert second["status"] == "not-run" and second["requests"] == 0
    assert second["why"] == "the overall deadline (1 s) passed before this cell"
    assert rep["failed_cells"] == ["128x1", "256x1"] and not rep["ok"]


def test_a_server_that_never_answers_fails_at_models_and_sends_nothing():
    with FakeOpenAI(faults={"hang"}) as fake:
        rep = warmup.warmup(fake.url, "det", settings(fake.url, [128], [1, 2], timeout=0.5, deadline=5.0))
        asked = [p for _, p, _ in fake.requests]
    assert asked == ["/v1/models"]
    # The wait or the socket's own timeout ends it, whichever comes first: both at 0.5 s.
    why = rep["preflight"]["why"]
    assert rep["preflight"]["ok"] is False
    assert why == "/v1/models: timed out (timed out)" or why.startswith("/v1/models: no answer within 0.5 s")
    assert rep["failed_cells"] == ["preflight", "128x1", "128x2"]
    assert [c["status"] for c in rep["cells"]] == ["not-run"] * 2
    assert rep["summary"].startswith(f"WARM-UP FAILED ({why}): 0/2 cells ok, 0 request(s)")


def test_a_model_the_engine_does_not_serve_is_said_with_the_fix(capsys):
    with FakeOpenAI(faults={"missing_model"}) as fake:
        rc = cli("--url", fake.url, "--model", "det", "--lengths", "128")
    out = capsys.readouterr().out
    assert rc == 1 and "/v1/models does not list 'det'; it serves ['other-model']" in out
    assert "fix: pass --model one of ['other-model']" in out


# ---- the key ----------------------------------------------------------------------------------------------


def test_the_key_from_a_file_or_the_environment_is_sent_and_never_printed(tmp_path, capsys, monkeypatch):
    keyfile = tmp_path / "key"
    keyfile.write_text(KEY + "\n")
    keyfile.chmod(0o600)
    with FakeOpenAI(api_key=KEY) as fake:
        rc_file = cli("--url", fake.url, "--model", "det", "--lengths", "128", "--api-key-file", str(keyfile), "--json")
        by_file = capsys.readouterr()
        monkeypatch.setenv(warmup.ENV_KEY, KEY)
        rc_env = cli("--url", fake.url, "--model", "det", "--lengths", "128")
        by_env = capsys.readouterr()
        monkeypatch.delenv(warmup.ENV_KEY)
        rc_none = cli("--url", fake.url, "--model", "det", "--lengths", "128")
        none = capsys.readouterr()
    assert rc_file == 0 and json.loads(by_file.out)["ok"] is True
    assert rc_env == 0 and "WARMED UP" in by_env.out
    assert rc_none == 1 and "HTTP 401" in none.out
    assert KEY not in by_file.out + by_file.err + by_env.out + by_env.err + none.out + none.err


@pytest.mark.parametrize("flag", ["--api-key", "--api-key=", "--key"])
def test_the_key_cannot_be_given_on_the_command_line(flag, capsys):
    argv = [f"{flag}{KEY}"] if flag.endswith("=") else [flag, KEY]
    with pytest.raises(SystemExit) as e:
        cli("--url", "http://127.0.0.1:1", "--model", "det", "--lengths", "128", *argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert KEY not in err and "--api-key-file FILE" in err


def test_an_echoed_key_is_masked_in_the_result():
    """The double answers errors with the Authorization header in them: the result shows *** instead."""
    with FakeOpenAI(api_key=KEY, oom_prompt_tokens=0) as fake:
        w = warmup.Warmup(fake.url, "det", settings(fake.url), api_key=KEY)
        w.fix = lambda rows: f"sent {rows[0]['error']} with Bearer {KEY}"  # as if the server echoed it
        rep = w.run()
    assert KEY not in json.dumps(rep) and "Bearer ***" in rep["cells"][0]["fix"]


# ---- usage ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--lengths", "abc"], "--lengths 'abc' is not a whole number (give e.g. 128,2048)"),
        (["--lengths", "32"], "--lengths 32 is out of range: give 64..1048576"),
        (["--lengths", ","], "--lengths empty: give comma-separated whole numbers"),
        (["--lengths", "128,128"], "--lengths 128 is given twice"),
        (["--concurrency", "0"], "--concurrency 0 is out of range: give 1..512"),
        (["--max-tokens", "x"], "--max-tokens 'x' is not a whole number"),
        (["--rounds", "0"], "--rounds 0 is out of range"),
        (["--request-timeout", "-1"], "--request-timeout -1.0 is not a number of seconds > 0"),
        (["--deadline", "soon"], "--deadline 'soon' is not a number of seconds"),
        (["--url", "ftp://x"], "--url 'ftp://x' is not an http(s) URL"),
        (["--api-key-file", "/nonexistent/key"], "--api-key-file /nonexistent/key: cannot read it"),
    ],
)  # fmt: skip
def test_bad_input_exits_2_with_one_line_naming_the_flag(argv, words, capsys):
    base = {"--url": "http://127.0.0.1:1", "--model": "det", "--lengths": "128"}
    for flag, value in zip(argv[::2], argv[1::2], strict=True):
        base[flag] = value
    assert cli(*[x for kv in base.items() for x in kv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("llmfleet warmup: ") and words in err, err


def test_nothing_listening_is_connection_refused_exit_1_not_a_traceback(capsys):
    assert cli("--url", "http://127.0.0.1:1", "--model", "det", "--lengths", "128", "--request-timeout", "2") == 1
    out = capsys.readouterr()
    assert "connection refused" in out.out and "Traceback" not in out.out + out.err


# ---- the table ----------------------------------------------------------------------------------------------


def _cell(n, c, status, **kw):
    base = {"input_len": n, "concurrency": c, "status": status, "why": None, "fix": None, "prompt_tokens": n - 1,
            "requests": 0, "errors": 0, "wall_s": 0.0, "ttft_ms_p50": None, "ttft_ms_max": None, "e2e_ms_max": None}  # fmt: skip
    return {**base, **kw}


def test_the_table_one_line_a_cell_failures_with_why_and_fix():
    rep = {
        "url": "http://127.0.0.1:8000", "model": "qwen", "summary": "WARM-UP FAILED (8192x8, 32768x1): 1/3 cells ok, 4 request(s) in 31.0 s",
        "started_at": "2026-12-01T12:00:00Z", "ended_at": "2026-12-01T12:00:31Z",
        "settings": {"max_tokens": 8, "rounds": 2}, "sizing": {"method": "tokenize"}, "preflight": {"ok": True},
        "cells": [
            _cell(2048, 1, "ok", requests=2, wall_s=13.2, ttft_ms_p50=6512.5, ttft_ms_max=12960.0, e2e_ms_max=13010.0,
                  first_round_ttft_ms_p50=12960.0, last_round_ttft_ms_p50=75.0),
            _cell(8192, 8, "failed", requests=2, errors=1, wall_s=17.8, ttft_ms_p50=850.0, ttft_ms_max=850.0,
                  e2e_ms_max=17800.0, first_round_ttft_ms_p50=850.0, last_round_ttft_ms_p50=None,
                  why="1 of 2 request(s) failed: HTTP 500: CUDA out of memory", fix="read the engine's log"),
            _cell(32768, 1, "not-run", prompt_tokens=None, why="the overall deadline (30 s) passed before this cell",
                  fix="raise the deadline, or warm fewer shapes"),
        ],
    }  # fmt: skip
    assert warmup.render_table(rep) == [
        "llmfleet warmup http://127.0.0.1:8000 --model qwen: max_tokens 8, 2 round(s) a cell; sized with the engine's /tokenize",
        "INPUT  TOKENS  CONC  STATUS   REQ  ERR  TTFT p50  TTFT max  E2E max    WALL  1st/last TTFT p50",
        " 2048    2047     1  ok         2    0     6.5 s    13.0 s   13.0 s  13.2 s   13.0 s / 75.0 ms",
        " 8192    8191     8  failed     2    1    850 ms    850 ms   17.8 s  17.8 s         850 ms / -",
        "    1 of 2 request(s) failed: HTTP 500: CUDA out of memory",
        "    fix: read the engine's log",
        "32768       -     1  not-run    0    0         -         -        -       -                  -",
        "    the overall deadline (30 s) passed before this cell",
        "    fix: raise the deadline, or warm fewer shapes",
        "WARM-UP FAILED (8192x8, 32768x1): 1/3 cells ok, 4 request(s) in 31.0 s (2026-12-01T12:00:00Z - 2026-12-01T12:00:31Z)",
    ]  # fmt: skip


@pytest.mark.parametrize(("ms", "text"), [(None, "-"), (0.4, "0.4 ms"), (99.94, "99.9 ms"), (850.0, "850 ms"),
                                          (1000.0, "1.0 s"), (23456.0, "23.5 s")])  # fmt: skip
def test_durations_read_as_people_write_them(ms, text):
    assert warmup.duration(ms) == text


# ---- the module -------------------------------------------------------------------------------------------


def margs(url, **over):
    return {"api_base": url, "model": "det", "lengths": [128, 512], "concurrency": [1, 2], "timeout": 5, **over}


@pytest.mark.usefixtures("module_exits")
def test_module_check_mode_sends_nothing_and_says_what_it_would_warm():
    with FakeOpenAI() as fake:
        res = run(mod, margs(fake.url), check=True)
        assert fake.requests == []
    assert res["changed"] is False and res["skipped_in_check_mode"] is True
    assert res["planned"] == [{"input_len": 128, "concurrency": 1}, {"input_len": 128, "concurrency": 2},
                              {"input_len": 512, "concurrency": 1}, {"input_len": 512, "concurrency": 2}]  # fmt: skip
    assert "check mode: nothing sent; would warm 4 cell(s)" in res["msg"] and not undocumented(mod, res)


@pytest.mark.usefixtures("module_exits")
def test_module_empty_lengths_is_off():
    res = run(mod, margs("http://127.0.0.1:1", lengths=[]))
    assert res["skipped"] is True and res["changed"] is False and "the warm-up is off" in res["msg"]
    assert not undocumented(mod, res)


@pytest.mark.usefixtures("module_exits")
def test_module_warms_and_returns_the_result_and_table_without_the_key():
    with FakeOpenAI(api_key=KEY) as fake:
        res = run(mod, margs(fake.url, api_key=KEY, rounds=2))
    assert res["ok"] is True and res["changed"] is False and len(res["cells"]) == 4
    assert res["table"][-1].startswith("WARMED UP: 4/4 cells ok, 12 request(s)")
    assert KEY not in json.dumps(res) and not undocumented(mod, res)


@pytest.mark.usefixtures("module_exits")
def test_module_fails_on_a_failed_cell_unless_told_not_to():
    with FakeOpenAI(oom_prompt_tokens=300) as fake:
        bad = fail(mod, margs(fake.url))
        kept = run(mod, margs(fake.url, fail_on_error=False))
    # `failed_cells`, not `failed`: Ansible reads a truthy `failed` in a result as the task failing.
    assert bad["msg"].startswith("WARM-UP FAILED (512x1, 512x2): 2/4 cells ok")
    assert bad["failed_cells"] == ["512x1", "512x2"] and "failed" not in kept
    assert kept["ok"] is False and kept["failed_cells"] == ["512x1", "512x2"] and kept["changed"] is False


@pytest.mark.parametrize(
    ("over", "text"),
    [
        ({"lengths": [32]}, "lengths (set by the role variable engine_warmup_lengths): 32 is out of range: give 64..1048576"),
        ({"lengths": ["many"]}, "Elements value for option 'lengths' is of type str and we were unable to convert to int"),
        ({"concurrency": [8, 0]}, "concurrency (set by the role variable engine_warmup_concurrency): 0 is out of range"),
        ({"concurrency": []}, "concurrency (set by the role variable engine_warmup_concurrency): give a non-empty list"),
        ({"rounds": 0}, "rounds (set by the role variable engine_warmup_rounds): 0 is out of range"),
        ({"max_tokens": -1}, "max_tokens (set by the role variable engine_warmup_max_tokens): -1 is out of range"),
        ({"timeout": 0}, "timeout (set by the role variable engine_warmup_timeout): 0.0 is not a number of seconds > 0"),
        ({"deadline": -5}, "deadline (set by the role variable engine_warmup_deadline)"),
        ({"api_base": "head:8000"}, "api_base: 'head:8000' is not an http(s) URL"),
        ({"fail_on_error": "perhaps"}, "argument 'fail_on_error' is of type str and we were unable to convert to bool"),
    ],
)  # fmt: skip
@pytest.mark.parametrize("check", [True, False], ids=["check", "run"])
@pytest.mark.usefixtures("module_exits")
def test_module_refuses_bad_options_naming_them_before_sending(over, text, check):
    with FakeOpenAI() as fake:
        msg = fail(mod, margs(fake.url, **over), check=check)["msg"]
        assert fake.requests == []
    assert text in msg, msg


# ---- real processes: the CLI and the double, each its own process -----------------------------------------


@pytest.fixture
def served(tmp_path):
    """The double as its own process (python -m tests.helpers.fake_openai), with a key from a file."""
    keyfile = tmp_path / "key"
    keyfile.write_text(KEY + "\n")
    keyfile.chmod(0o600)
    port_file = tmp_path / "port"
    proc = subprocess.Popen([sys.executable, "-m", "tests.helpers.fake_openai", "--port-file", str(port_file),
                             "--api-key-file", str(keyfile), "--jit-delay", "0.5", "--lifetime", "120"], cwd=ROOT)  # fmt: skip
    try:
        for _ in range(300):
            if port_file.exists() or proc.poll() is not None:
                break
            time.sleep(0.1)
        assert port_file.exists(), f"the double did not start (exit {proc.poll()})"
        yield f"http://127.0.0.1:{port_file.read_text()}", keyfile
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_cli_process_against_a_server_process(served):
    url, keyfile = served
    env = {k: v for k, v in os.environ.items() if k != warmup.ENV_KEY}
    argv = [sys.executable, "-m", "llmfleet", "warmup", "--url", url + "/v1", "--model", "det", "--lengths",
            "128,1024", "--concurrency", "1,4", "--rounds", "2", "--api-key-file", str(keyfile)]  # fmt: skip
    as_json = subprocess.run([*argv, "--json"], capture_output=True, text=True, timeout=120, check=False, cwd=ROOT,
                             env=env)  # fmt: skip
    table = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False, cwd=ROOT, env=env)
    assert table.returncode == 0, table.stderr
    assert KEY not in " ".join(argv) + table.stdout + table.stderr + as_json.stdout + as_json.stderr
    lines = table.stdout.splitlines()
    assert lines[1].split() == ["INPUT", "TOKENS", "CONC", "STATUS", "REQ", "ERR", "TTFT", "p50", "TTFT", "max", "E2E",
                                "max", "WALL", "1st/last", "TTFT", "p50"]  # fmt: skip
    assert lines[-1].startswith("WARMED UP: 4/4 cells ok, 20 request(s) in ")
    assert "  128 x 1: ok" in table.stderr  # progress, one line a cell
    rep = json.loads(as_json.stdout)
    assert as_json.returncode == 0 and rep["schema"] == "llmfleet.warmup/1" and rep["url"] == url
    assert [c["status"] for c in rep["cells"]] == ["ok"] * 4
    # The double "compiles" each prompt size once (--jit-delay 0.5): the first cell of each length paid it.
    assert rep["cells"][0]["first_round_ttft_ms_p50"] >= 500 and rep["cells"][2]["first_round_ttft_ms_p50"] >= 500


def test_cli_process_without_the_key_exits_1_naming_the_fix(served):
    url, _ = served
    env = {k: v for k, v in os.environ.items() if k != warmup.ENV_KEY}
    cp = subprocess.run([sys.executable, "-m", "llmfleet", "warmup", "--url", url, "--model", "det", "--lengths", "128"],
                        capture_output=True, text=True, timeout=120, check=False, cwd=ROOT, env=env)  # fmt: skip
    assert cp.returncode == 1 and "/v1/models: HTTP 401" in cp.stdout and "Traceback" not in cp.stdout + cp.stderr
