"""`llmfleet exec --health-url`: the serving health probe. Real wrapper processes around a small python child; the
engine's API is a TEST DOUBLE (an http.server in this process that answers, answers wrong, errs, hangs, trickles
or resets as each test tells it). Every wait has a deadline."""

import http.server
import json
import os
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest

from llmfleet.engine.gate import DEFAULT_EXPECT, DEFAULT_PROMPT
from llmfleet.wrapper import health as wrapper_health
from llmfleet.wrapper.run import EXIT_UNHEALTHY, main
from tests.unit.test_wrapper import RUN_TIMEOUT, WRAP, clean_env, load, pyc

SECRET = "hEaLtH-key-do-not-leak-0123"  # noqa: S105 (a fake credential the tests look for)
# The child: says READY (the serving phase), then waits; SIGTERM ends it at once (a clean stop).
ENGINE = r"""
import signal, sys, time
signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))
print("INFO:     Application startup complete.", flush=True)
while True:
    time.sleep(0.05)
"""


def answer(text):
    return {"choices": [{"message": {"role": "assistant", "content": text}}]}


class FakeEngine:
    """The engine's OpenAI API as a test double. `modes` is consumed one per request (the last one repeats):
    ok, wrong, error500, hang (no headers ever), trickle (headers, then a byte a second forever), reset."""

    def __init__(self, modes):
        self.modes = list(modes)
        self.requests = []  # (Authorization header, body)
        self.release = threading.Event()
        fake = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                fake.requests.append((self.headers.get("Authorization"), body))
                mode = fake.modes.pop(0) if len(fake.modes) > 1 else fake.modes[0]
                if mode == "hang":
                    fake.release.wait(60)
                    return
                if mode == "reset":
                    self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
                    self.rfile.close()
                    self.wfile.close()
                    self.connection.close()  # the last reference: with linger 0, a reset
                    return
                if mode == "trickle":
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", "100000")
                    self.end_headers()
                    while not fake.release.wait(0.2):
                        try:
                            self.wfile.write(b" ")
                            self.wfile.flush()
                        except OSError:
                            return
                    return
                code, data = {"ok": (200, answer(DEFAULT_EXPECT)), "wrong": (200, answer("704")),
                              "error500": (500, {"error": "engine world is broken"})}[mode]  # fmt: skip
                raw = json.dumps(data).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def fake():
    made = []

    def make(*modes):
        f = FakeEngine(modes)
        made.append(f)
        return f

    yield make
    for f in made:
        f.close()


def ask(url, timeout=5.0):
    return wrapper_health.ask(url, "m", DEFAULT_PROMPT, DEFAULT_EXPECT, api_key=None, timeout=timeout)


def closed_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


# ---- one probe, every kind of failure


def test_a_correct_answer_passes_and_the_question_is_the_gates(fake):
    f = fake("ok")
    res = ask(f.url)
    assert res["ok"] and res["error"] is None and res["latency_s"] >= 0
    _, body = f.requests[0]
    assert body["messages"] == [{"role": "user", "content": DEFAULT_PROMPT}] and body["model"] == "m"
    # without --health-model no model is sent: the engine answers with its own
    assert wrapper_health.ask(f.url, "", DEFAULT_PROMPT, DEFAULT_EXPECT, api_key=None, timeout=5)["ok"]
    assert "model" not in f.requests[1][1]
    assert ask(f.url + "/v1/")["ok"]  # the API base given with its /v1


@pytest.mark.parametrize(
    ("mode", "error"),
    [
        ("wrong", "expected '703', got '704'"),
        ("error500", "HTTP 500"),
        ("reset", "Error"),  # ConnectionResetError / RemoteDisconnected
        ("hang", "no complete answer within 1 s"),  # no headers ever
        ("trickle", "no complete answer within 1 s"),  # a body that never ends: each read is quick, the whole is not
    ],
)
def test_each_failure_kind_fails_the_probe(fake, mode, error):
    res = ask(fake(mode).url, timeout=1.0)
    assert not res["ok"]
    assert error in res["error"], res


def test_a_refused_connection_fails_the_probe():
    res = ask(f"http://127.0.0.1:{closed_port()}")
    assert not res["ok"] and "Refused" in res["error"], res


@pytest.mark.parametrize(
    "url", ["127.0.0.1:30000", "ftp://h/", "http://h:99999", "http://u:p@h:1", "http://h:1/?q=1", "http://"]
)
def test_bad_health_urls_are_named(url):
    assert url in wrapper_health.check_url(url)


# ---- the wrapper


def wrapper_proc(tmp_path, url, *extra, env=None):
    rec, st = tmp_path / "r.json", tmp_path / "s.json"
    (tmp_path / "metrics").mkdir(exist_ok=True)  # node_exporter's textfile directory is there
    opts = ["--record", str(rec), "--status", str(st), "--health-url", url, "--health-model", "m",
            "--metrics-dir", str(tmp_path / "metrics"), "--deployment", "demo", *extra]  # fmt: skip
    p = subprocess.Popen([*WRAP, *opts, "--", *pyc(ENGINE)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         stdin=subprocess.DEVNULL, text=True, env=env or clean_env())  # fmt: skip
    return p, rec, st


def wait_status(st, pred, timeout=30):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            data = load(st)
        except (OSError, ValueError):
            data = None
        if data is not None and pred(data):
            return data
        time.sleep(0.05)
    raise AssertionError(f"status never matched: {st.read_text() if st.exists() else 'no file'}")


def test_n_failures_in_a_row_stop_the_engine_with_its_own_verdict(tmp_path, fake):
    f = fake("ok", "hang")  # answers once, then every generation hangs
    p, rec, st = wrapper_proc(tmp_path, f.url, "--health-interval", "0.2", "--health-timeout", "0.5",
                              "--health-failures", "2")  # fmt: skip
    _, err = p.communicate(timeout=RUN_TIMEOUT)
    assert p.returncode == EXIT_UNHEALTHY == 69, err
    r = load(rec)
    assert r["verdict"] == "unhealthy-while-serving" and r["exit_code"] == 69
    assert r["stop_requested"] and r["child"]["exit_code"] == 0  # stopped as on a stop request: SIGTERM, exit 0
    assert "hung while serving: 2 health probes in a row failed" in r["reason"]
    h = r["health"]
    assert h["unhealthy"] and h["failures_in_row"] == 2 and h["last_good_at"] is not None
    assert [x["ok"] for x in h["probes"]] == [True, False, False]
    assert all("no complete answer within 0.5 s" in x["error"] and x["at"] > 0 for x in h["probes"][1:])
    assert load(st)["running"] is False and load(st)["health"]["unhealthy"]
    assert "health: probe failed (1/2)" in err and "unhealthy-while-serving: exit 69" in err
    prom = (tmp_path / "metrics" / "llmfleet_health_demo.prom").read_text()
    assert 'llmfleet_engine_health_failures{deployment="demo"' in prom and "} 2" in prom
    assert "llmfleet_engine_health_last_good_timestamp_seconds" in prom
    assert "llmfleet_engine_health_last_good_latency_seconds" in prom
    term = (tmp_path / "metrics" / "llmfleet_engine_demo.prom").read_text()
    assert 'verdict="unhealthy-while-serving"} 1' in term


def test_a_good_answer_resets_the_count(tmp_path, fake):
    f = fake("wrong", "ok", "error500", "ok", "wrong", "ok")
    p, rec, st = wrapper_proc(tmp_path, f.url, "--health-interval", "0.1", "--health-timeout", "2",
                              "--health-failures", "2")  # fmt: skip
    try:
        wait_status(st, lambda d: len((d.get("health") or {}).get("probes") or []) >= 5)
        p.send_signal(signal.SIGTERM)
        p.communicate(timeout=RUN_TIMEOUT)
    finally:
        p.kill()
    assert p.returncode == 0
    r = load(rec)
    assert r["verdict"] == "clean-stop" and not r["health"]["unhealthy"]


def test_a_stop_while_a_probe_hangs_exits_0_at_once(tmp_path, fake):
    f = fake("hang")
    # A probe may take 120 s: the stop must not wait for it (the run's own deadline is far shorter).
    p, rec, st = wrapper_proc(tmp_path, f.url, "--health-interval", "0.1", "--health-timeout", "120")
    try:
        wait_status(st, lambda d: d.get("ready") is True)
        end = time.monotonic() + 30
        while not f.requests and time.monotonic() < end:  # the probe is in flight
            time.sleep(0.02)
        assert f.requests
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=20)
    finally:
        p.kill()
    assert p.returncode == 0, err
    r = load(rec)
    assert r["verdict"] == "clean-stop" and r["health"]["probes"] == [] and not r["health"]["unhealthy"]


def test_the_api_key_goes_in_a_header_only(tmp_path, fake):
    creds = tmp_path / "creds"
    creds.mkdir()
    (creds / "api-key").write_text(SECRET + "\n")
    f = fake("ok", "wrong")
    env = clean_env(CREDENTIALS_DIRECTORY=str(creds))
    p, rec, st = wrapper_proc(tmp_path, f.url, "--health-interval", "0.1", "--health-timeout", "2",
                              "--health-failures", "2", "--health-key", "api-key", env=env)  # fmt: skip
    try:
        wait_status(st, lambda d: d.get("ready") is True)
        cmdline = Path(f"/proc/{p.pid}/cmdline").read_bytes()
        out, err = p.communicate(timeout=RUN_TIMEOUT)
    finally:
        p.kill()
    assert p.returncode == EXIT_UNHEALTHY
    assert {auth for auth, _ in f.requests} == {f"Bearer {SECRET}"}
    assert SECRET.encode() not in cmdline
    for text in (out, err, rec.read_text(), st.read_text(), *(x.read_text() for x in (tmp_path / "metrics").iterdir())):
        assert SECRET not in text


@pytest.mark.parametrize(
    ("opts", "says"),
    [
        (["--health-url", "127.0.0.1:1", "--health-model", "m"], "--health-url '127.0.0.1:1'"),
        (["--health-url", "http://h:1", "--health-model", "m", "--health-failures", "0"], "--health-failures >= 1"),
        (["--health-url", "http://h:1", "--health-model", "m", "--health-timeout", "0"], "must be > 0"),
        (["--health-url", "http://h:1", "--health-model", "m", "--health-key", "../k"], "a credential name"),
    ],
)
def test_health_usage_errors_exit_2(capsys, opts, says):
    assert main([*opts, "--", "true"]) == 2
    assert says in capsys.readouterr().err


def test_a_missing_health_key_does_not_start_the_engine(tmp_path):
    marker = tmp_path / "started"
    env = clean_env(CREDENTIALS_DIRECTORY=str(tmp_path))
    p = subprocess.run([*WRAP, "--health-url", "http://127.0.0.1:1", "--health-model", "m", "--health-key", "api-key",
                        "--", "touch", str(marker)], capture_output=True, text=True, env=env, timeout=RUN_TIMEOUT,
                       check=False)  # fmt: skip
    assert p.returncode == 2 and "credential 'api-key'" in p.stderr and not marker.exists()
    assert not os.path.exists(marker)
