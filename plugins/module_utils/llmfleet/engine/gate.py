"""Readiness gate and ordered stop of a multi-node engine deployment, run from the ops host.

Ready means, in order: every node's unit active (each wrapper sent READY=1 for its part), the head's
port listening, /v1/models listing the served name, and a deterministic chat completion answered
correctly. SGLang workers' /health is a dummy that always says 200, so it is never asked.

Prefill/decode disaggregation (vLLM P/D, a `router` given): every node is an instance of its own and
the router a unit on the head. Ready then means every unit active (the router's too), each instance
answering alone (port, /v1/models, the answer), and the question answered THROUGH THE ROUTER with the
KV cache moved: the decode instances' /metrics, read just before and after, must show
vllm:prompt_tokens_by_source_total{source="external_kv_transfer"} rising (prompt tokens whose KV came
from the prefill over the KV connector). An answer with only local_compute rising is the recompute
path (the decode computed the prompt itself, no P/D) and fails naming the decode node.

If a unit fails (failed, waiting to auto-restart, restarted) or the deadline passes, every node is
stopped head first (the P/D router before it; SGLang workers wait for rank 0's ShutdownReq), and the
first node that failed is named with its rank, termination record and journal tail. Nodes are reached with plain OpenSSH
(the same host, user, port, key and options Ansible uses) and every call has a timeout.

Privilege: the journal, systemctl and the engine's state directory need root. A site connects as an
operator account with become, so every remote script runs through `sudo -n` unless the login is
already root; sudo asking for a password is a configuration error, said at once. Files the engine
writes are read as the engine's user (read_cmd), never followed by root.
A node whose SSH keeps failing for `unreachable_after` seconds fails the gate (named, with the SSH
error) instead of holding it until the deadline.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from ..net import connect_state
from .logobserver import PHASES

# The wrapper's phases, in order, after its "started" (one list: the gate ranks what the wrapper reports).
PHASE_ORDER = ("started", *PHASES)
SHOW_PROPS = "ActiveState,SubState,Result,NRestarts,ExecMainCode,ExecMainStatus,MainPID,InvocationID"
DEFAULT_PROMPT = "What is 37\u00d719? Reply with only the number."
DEFAULT_EXPECT = "703"  # DEFAULT_PROMPT's answer
# Root-only parts of every remote script run as root: directly when the login is root, else through
# passwordless sudo (the gate cannot answer a password prompt; -n makes sudo fail instead of asking).
AS_ROOT = 'if [ "$(id -u)" -eq 0 ]; then exec sh -c "$0"; else exec sudo -n -- sh -c "$0"; fi'
SUDO_REFUSED = re.compile(r"^sudo: (a password is required|.*not in the sudoers|.*not allowed to execute)", re.M)
# Wrong answers (or, P/D, answers without a KV transfer) in a row after which asking again cannot help.
STRIKES = 3

# P/D: the KV transfer's evidence on the instances' /metrics (vLLM 0.32, v1/metrics/loggers.py and the
# NIXL connector's stats; every counter is created with its labels at start, 0 until something happens).
KV_METRIC = "vllm:prompt_tokens_by_source_total"
KV_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")
NIXL_METRICS = {
    "bytes": "vllm:nixl_bytes_transferred_sum",
    "transfers": "vllm:nixl_xfer_time_seconds_count",
    "failed_transfers": "vllm:nixl_num_failed_transfers_total",
    "expired_requests": "vllm:nixl_num_kv_expired_reqs_total",
}
_METRIC_LINE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{(.*)\})?\s+(\S+)")
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')


def ssh_argv(host: dict[str, Any], connect_timeout: float = 10) -> list[str]:
    """OpenSSH argv prefix for one inventory host (keys as in hostvars: ansible_host, ansible_user,
    ansible_port, ansible_ssh_private_key_file, ansible_ssh_common_args, ansible_ssh_extra_args).
    The control socket is added per gate run (Remote), in a private directory."""
    argv = ["ssh", "-o", "BatchMode=yes", "-o", f"ConnectTimeout={int(connect_timeout)}"]
    for key in ("ansible_ssh_common_args", "ansible_ssh_extra_args"):
        if host.get(key):
            argv += shlex.split(str(host[key]))
    if host.get("ansible_port"):
        argv += ["-p", str(host["ansible_port"])]
    if host.get("ansible_ssh_private_key_file"):
        argv += ["-i", str(host["ansible_ssh_private_key_file"])]
    if host.get("ansible_user"):
        argv += ["-l", str(host["ansible_user"])]
    argv.append(str(host.get("ansible_host") or host["inventory_hostname"]))
    return argv


class PrivilegeError(RuntimeError):
    """sudo on a node refused to run the gate's root-only scripts without a password."""


class Remote:
    """Runs shell snippets as root on one node over SSH with a deadline.

    With `control_dir`, a master connection per node (a socket in that private directory) keeps each
    poll at a few ms instead of a full handshake; close() ends the master."""

    def __init__(self, name: str, argv: list[str], control_dir: str | None = None) -> None:
        self.name, self.argv = name, list(argv)
        self.control = []
        if control_dir:
            path = os.path.join(control_dir, "%C")
            self.control = ["-o", "ControlMaster=auto", "-o", f"ControlPath={path}", "-o", "ControlPersist=60"]

    def run(self, script: str, timeout: float = 30) -> tuple[int, str, str]:
        # ssh joins the remote words into one shell line: quote the wrapper and pass the script as $0.
        remote = f"sh -c {shlex.quote(AS_ROOT)} {shlex.quote(script)}"
        try:
            p = subprocess.run(
                [*self.argv[:1], *self.control, *self.argv[1:], "--", remote],
                check=False,
                capture_output=True,
                text=True,
                timeout=timeout,
                stdin=subprocess.DEVNULL,
            )
        except subprocess.TimeoutExpired:
            return 124, "", f"ssh to {self.name} timed out after {timeout:.0f} s"
        if p.returncode != 0 and SUDO_REFUSED.search(p.stderr or ""):
            raise PrivilegeError(
                f"{self.name}: {SUDO_REFUSED.search(p.stderr).group(0)}: the readiness gate runs systemctl, "
                "journalctl and reads llmfleet's state as root through `sudo -n`; give the ansible_user "
                "passwordless sudo on the nodes (NOPASSWD) or connect as root"
            )
        return p.returncode, p.stdout, p.stderr

    def close(self) -> None:
        if self.control:
            subprocess.run(
                [*self.argv[:1], *self.control, "-O", "exit", *self.argv[1:]],
                check=False,
                capture_output=True,
                timeout=10,
                stdin=subprocess.DEVNULL,
            )


def _parse_show(text: str) -> dict[str, str]:
    out = {}
    for line in text.splitlines():
        if "=" in line:
            k, v = line.split("=", 1)
            out[k.strip()] = v.strip()
    return out


def _json_or_none(text: str) -> dict | None:
    text = text.strip()
    if not text:
        return None
    try:
        val = json.loads(text)
    except ValueError:
        return None
    return val if isinstance(val, dict) else None


def read_cmd(path: str, read_as: str | None) -> str:
    """Shell words that print a file the engine writes. The scripts run as root, and the engine's user
    owns that directory: read as that user, so a planted symlink (say to /etc/shadow) gets nothing."""
    p = shlex.quote(path)
    return f"runuser -u {shlex.quote(read_as)} -- cat {p} 2>/dev/null" if read_as else f"cat {p} 2>/dev/null"


def probe_script(unit: str, status_file: str, read_as: str | None = None) -> str:
    u = shlex.quote(unit)
    show = f"systemctl show {u} --property={SHOW_PROPS} --no-pager"
    return f"{show}; echo @@status; {read_cmd(status_file, read_as)}; echo; echo @@end"


def parse_probe(out: str) -> dict[str, Any]:
    show, _, rest = out.partition("@@status")
    status, _, _ = rest.partition("@@end")
    return {"unit": _parse_show(show), "status": _json_or_none(status)}


def phase_rank(phase: str | None) -> int:
    return PHASE_ORDER.index(phase) if phase in PHASE_ORDER else 0


class Node:
    def __init__(  # noqa: PLR0917 (one node's fixed facts)
        self,
        spec: dict[str, Any],
        unit: str,
        status_file: str,
        record_file: str,
        control_dir: str | None = None,
        read_as: str | None = None,
    ) -> None:
        self.name = spec["name"]
        self.rank = int(spec["rank"])
        # P/D: the node's own instance API (as the ops host reaches it) and its role.
        self.api_base: str | None = spec.get("api_base") or None
        self.pd_role: str | None = spec.get("pd_role") or None
        self.remote = Remote(self.name, spec["ssh"], control_dir)
        self.unit, self.status_file, self.record_file = unit, status_file, record_file
        self.baseline_restarts: int | None = None
        self.baseline_invocation: str | None = None
        self.state: dict[str, Any] = {}
        self.failed_at: float | None = None
        self.failure: str | None = None
        self.ready_seen_at: float | None = None
        self.unreachable_since: float | None = None  # first of the current run of failed SSH polls
        self.unreachable = False
        self.read_as = read_as

    def probe(self, timeout: float = 20) -> dict[str, Any]:
        rc, out, err = self.remote.run(probe_script(self.unit, self.status_file, self.read_as), timeout=timeout)
        if rc != 0 and "@@status" not in out:
            self.unreachable_since = self.unreachable_since or time.time()
            return {"error": (err or out).strip()[-300:] or f"ssh exit {rc}", "since": self.unreachable_since}
        self.unreachable_since = None
        return parse_probe(out)


def _status_for(node: Node, probe: dict[str, Any]) -> dict | None:
    st = probe.get("status")
    inv = probe.get("unit", {}).get("InvocationID")
    if st and inv and st.get("invocation_id") not in (None, inv):
        return None  # left over from an earlier run of the unit
    return st


def _judge_unreachable(node: Node, probe: dict[str, Any], unreachable_after: float) -> str | None:
    # One lost poll is not a failure; SSH failing for `unreachable_after` seconds is.
    down_for = time.time() - probe.get("since", time.time())
    if down_for < unreachable_after:
        return None
    node.unreachable = True
    return f"unreachable over SSH for {down_for:.0f} s: {probe['error']}"


def judge_node(node: Node, probe: dict[str, Any], unreachable_after: float = 30) -> str | None:
    """None while fine (activating or active); else why this node counts as failed."""
    if "error" in probe:
        return _judge_unreachable(node, probe, unreachable_after)
    unit = probe["unit"]
    active, sub = unit.get("ActiveState", ""), unit.get("SubState", "")
    restarts = int(unit.get("NRestarts") or 0)
    if node.baseline_restarts is None:
        node.baseline_restarts = restarts
    result = unit.get("Result", "")
    code = f"{unit.get('ExecMainCode', '')}/{unit.get('ExecMainStatus', '')}"
    if active == "failed":
        return f"unit failed (Result={result}, main process {code})"
    if sub == "auto-restart":
        return f"engine ended (Result={result}, main process {code}); systemd will restart it"
    if restarts > node.baseline_restarts:
        return f"unit restarted {restarts - node.baseline_restarts} time(s) since the gate began (Result={result})"
    if active in ("inactive", "deactivating"):
        return f"unit is {active} (Result={result}, main process {code}); nothing is running"
    return None


def first_failed(failed: list[Node], records: dict[str, dict | None], t0: float) -> Node:
    """The node that failed first: by its termination record's end (this run's), else when the gate saw it; a
    node the deployment link stopped because another one failed is a consequence, whatever the clocks say."""

    def order(n: Node) -> tuple[bool, float, int]:
        rec = records.get(n.name) or {}
        ended = rec.get("ended_at") if isinstance(rec.get("ended_at"), (int, float)) else None
        consequence = rec.get("verdict") in ("peer-failed", "deployment-stopped")
        return (consequence, ended if ended and ended >= t0 - 5 else n.failed_at or 0, n.rank)

    return min(failed, key=order)


def http(
    method: str, url: str, body: dict | None = None, api_key: str | None = None, timeout: float = 30
) -> tuple[int, Any]:
    data = json.dumps(body).encode() if body is not None else None
    if not url.startswith(("http://", "https://")):
        return 0, f"not an http(s) URL: {url}"
    req = urllib.request.Request(url, data=data, method=method)  # noqa: S310 (scheme checked above)
    req.add_header("Content-Type", "application/json")
    if api_key:
        req.add_header("Authorization", f"Bearer {api_key}")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:  # noqa: S310 (scheme checked above)
            raw = r.read()
            code = r.status
    except urllib.error.HTTPError as e:
        raw, code = e.read(), e.code
    except (urllib.error.URLError, OSError, TimeoutError) as e:
        return 0, str(getattr(e, "reason", e))
    try:
        return code, json.loads(raw)
    except ValueError:
        return code, raw.decode(errors="replace")[:500]


def port_open(host: str, port: int, timeout: float = 2) -> bool:
    return connect_state(host, port, timeout) == "open"


THINK_TAG = re.compile(r"</?think>")


def chat_body(model: str, prompt: str) -> dict:
    """The question as a chat completion request (the gate's, and the wrapper's serving health probe's)."""
    return {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "temperature": 0,
        "max_tokens": 1024,
        # Thinking off so the answer field holds the answer. Reasoning text in `content` is a failure,
        # never stripped: clients would show it to users (the leak the field reports rejected).
        "chat_template_kwargs": {"enable_thinking": False},
    }


def judge_chat(code: int, resp: Any, prompt: str, expect: str) -> dict:
    """The answer to chat_body's request, judged: {"ok", "why", "final", "answer"}."""
    if code != 200 or not isinstance(resp, dict):
        # A 4xx says the request is refused (bad max_tokens, wrong key, unknown model): asking again
        # cannot help, so it is final; 5xx and connection errors may pass while the engine warms up.
        return {"ok": False, "why": f"chat completion: HTTP {code}: {str(resp)[:300]}", "final": 400 <= code < 500}
    try:
        content = resp["choices"][0]["message"].get("content") or ""
    except (KeyError, IndexError, TypeError, AttributeError):
        return {"ok": False, "why": f"chat completion without choices[0].message: {str(resp)[:300]}"}
    if THINK_TAG.search(content):
        return {
            "ok": False,
            "why": f"reasoning leaked into the answer's content (a <think> tag): {content[:200]!r}; "
            "start the engine with its reasoning parser (SGLang/vLLM --reasoning-parser) so reasoning goes "
            "to reasoning_content",
            "answer": content,
        }
    answer = content.strip()
    if answer.rstrip(".。 ") != expect:
        return {"ok": False, "why": f"asked {prompt!r}, expected {expect!r}, got {answer[:200]!r}", "answer": answer}
    return {"ok": True, "answer": answer}


def chat_check(base: str, model: str, prompt: str, expect: str, *, api_key: str | None, timeout: float) -> dict:
    code, resp = http("POST", f"{base}/v1/chat/completions", chat_body(model, prompt), api_key, timeout)
    return judge_chat(code, resp, prompt, expect)


def http_text(url: str, api_key: str | None = None, timeout: float = 10) -> tuple[int, str]:
    """GET a text resource (Prometheus /metrics) whole: (status, body) or (0, why)."""
    if not url.startswith(("http://", "https://")):
        return 0, f"not an http(s) URL: {url}"
    req = urllib.request.Request(url, method="GET")  # noqa: S310 (scheme checked above)
    if api_key:
        req.add_header("Authorization", f"Bearer {api_key}")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:  # noqa: S310 (scheme checked above)
            return r.status, r.read().decode(errors="replace")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")[:300]
    except (urllib.error.URLError, OSError, TimeoutError) as e:
        return 0, str(getattr(e, "reason", e))


def parse_metrics(text: str) -> list[tuple[str, dict[str, str], float]]:
    """Prometheus text exposition -> [(name, labels, value)] (comments and unparsable lines skipped)."""
    out = []
    for line in text.splitlines():
        m = _METRIC_LINE.match(line)
        if not m or line.startswith("#"):
            continue
        try:
            value = float(m.group(3))
        except ValueError:
            continue
        out.append((m.group(1), dict(_LABEL.findall(m.group(2) or "")), value))
    return out


def kv_counters(text: str) -> dict[str, Any]:
    """What one instance's /metrics says about where prompt tokens came from: {"tokens_by_source":
    {source: count} (empty when KV_METRIC is absent), "nixl": {bytes, transfers, failed_transfers,
    expired_requests} (only those present)}, summed over engines and models."""
    by_source: dict[str, float] = {}
    nixl: dict[str, float] = {}
    names = {v: k for k, v in NIXL_METRICS.items()}
    for name, labels, value in parse_metrics(text):
        if name == KV_METRIC and "source" in labels:
            by_source[labels["source"]] = by_source.get(labels["source"], 0.0) + value
        elif name in names:
            nixl[names[name]] = nixl.get(names[name], 0.0) + value
    return {"tokens_by_source": by_source, "nixl": nixl}


def _num(v: float) -> int | float:
    return int(v) if float(v).is_integer() else round(v, 3)


def kv_delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """after - before of kv_counters (a counter missing before counts from 0)."""
    out: dict[str, Any] = {}
    for part in ("tokens_by_source", "nixl"):
        b, a = before.get(part) or {}, after.get(part) or {}
        out[part] = {k: _num(a[k] - b.get(k, 0.0)) for k in sorted(a)}
    return out


def kv_verdict(deltas: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Did the KV move? deltas: {node: {"role", "tokens_by_source", "nixl"}} over one question through
    the router. ok when some decode instance counted external_kv_transfer tokens; else `node` is the
    decode instance that computed the prompt itself (local_compute rose), or the first decode instance
    when none counted anything, and `why` says which."""
    decode = {n: d for n, d in deltas.items() if d.get("role") == "decode"}
    moved = [n for n, d in decode.items() if d["tokens_by_source"].get("external_kv_transfer", 0) > 0]
    if moved:
        return {"ok": True, "decode": moved, "node": moved[0]}
    recomputed = [n for n, d in decode.items() if d["tokens_by_source"].get("local_compute", 0) > 0]
    if recomputed:
        n = recomputed[0]
        t = decode[n]["tokens_by_source"]
        why = (
            f"the router's answer came without a KV transfer: decode instance {n} computed the prompt itself "
            f"({KV_METRIC}: local_compute +{t.get('local_compute', 0)}, external_kv_transfer "
            f"+{t.get('external_kv_transfer', 0)}) - the recompute path, not P/D"
        )
        return {"ok": False, "decode": [], "node": n, "why": why}
    names = sorted(decode)
    why = (
        f"the router's answer came without a KV transfer: no decode instance ({', '.join(names)}) counted the "
        f"prompt in {KV_METRIC} (neither local_compute nor external_kv_transfer rose): the router did not "
        "send the decode step to them"
    )
    return {"ok": False, "decode": [], "node": names[0] if names else None, "why": why}


KV_HINT = (
    "check that the prefill instances run kv_role kv_producer and the decode instances kv_consumer with the "
    "same kv_connector (engine_kv_transfer_config), that every decode node reaches each prefill node's NIXL "
    "side channel (VLLM_NIXL_SIDE_CHANNEL_HOST:PORT, engine_pd_side_channel_port) and UCX transport "
    "(engine_ucx_tls), and the decode node's journal (NIXL transfer failure, expired KV blocks)"
)


def kv_summary(kv: dict[str, Any]) -> str:
    """One line of the P/D evidence for the play output: tokens by source (and NIXL bytes) per node."""
    parts = []
    for n, d in (kv.get("nodes") or {}).items():
        t = d.get("tokens_by_source") or {}
        words = [f"{k} +{t[k]}" for k in KV_SOURCES if k in t]
        x = d.get("nixl") or {}
        if "bytes" in x:
            words.append(f"nixl {x['bytes']} bytes in {x.get('transfers', '?')} transfer(s)")
        parts.append(f"{n} ({d.get('role')}): " + ", ".join(words or ["no counters"]))
    verdict = (
        f"KV transferred to {', '.join(kv['decode'])}" if kv.get("proven") else "NO KV transfer proven"
    )  # fmt: skip
    return f"{verdict}; {KV_METRIC} over the router's answer: " + "; ".join(parts)


class Endpoint:
    """One API the gate asks: the port, then /v1/models, then the answer (each step once passed)."""

    def __init__(self, name: str, base: str, node: Node, events: dict[str, float] | None = None) -> None:
        self.name, self.base, self.node = name, base.rstrip("/"), node
        hostport = self.base.split("://", 1)[-1].split("/", 1)[0]
        host, _, port = hostport.rpartition(":")
        self.host, self.port = host.strip("[]"), int(port or 80)
        self.events: dict[str, float] = {} if events is None else events
        self.answer: str | None = None
        self.wrong_answers = 0


class Gate:
    def __init__(
        self,
        nodes: list[dict[str, Any]],
        unit: str,
        *,
        status_file: str,
        record_file: str,
        api_base: str,
        model: str,
        api_key: str | None = None,
        prompt: str = DEFAULT_PROMPT,
        expect: str = DEFAULT_EXPECT,
        deadline: float = 3600,
        poll: float = 0.5,
        journal_lines: int = 40,
        stop_timeout: float = 300,
        unreachable_after: float = 30,
        read_as: str | None = None,
        router: dict[str, str] | None = None,
        require_kv_transfer: bool = True,
        log: Callable[[str], None] | None = None,
        progress_path: str | None = None,
    ) -> None:
        if not nodes or min(int(n["rank"]) for n in nodes) != 0:
            raise ValueError("the gate needs the head (node rank 0) among its nodes")
        # SSH control sockets live in a private directory of this run (0700, unpredictable name).
        self.control_dir = tempfile.mkdtemp(prefix="llmfleet-gate-")
        self.nodes = sorted((Node(n, unit, status_file, record_file, self.control_dir, read_as) for n in nodes),
                            key=lambda n: n.rank)  # fmt: skip
        head = self.nodes[0]
        # P/D: the router is a unit of its own on the head; it is polled and stopped (first) like a node.
        self.router: Node | None = None
        if router:
            spec = {"name": f"{head.name}/router", "rank": 0, "ssh": head.remote.argv}
            self.router = Node(spec, router["unit"], router["status_file"], router["record_file"],
                               self.control_dir, read_as)  # fmt: skip
            missing = [n.name for n in self.nodes if not n.api_base or n.pd_role not in ("prefill", "decode")]
            if missing:
                raise ValueError(f"P/D (a router given): nodes {missing} need api_base and pd_role prefill|decode")
        self.units = self.nodes + ([self.router] if self.router else [])
        self.unreachable_after = unreachable_after
        self.read_as = read_as
        self.unit, self.record_file = unit, record_file
        self.api_base, self.model, self.api_key = api_base.rstrip("/"), model, api_key
        self.prompt, self.expect = prompt, expect
        self.deadline, self.poll, self.journal_lines = deadline, poll, journal_lines
        self.stop_timeout = stop_timeout
        self.require_kv_transfer = require_kv_transfer
        self.log = log or (lambda _m: None)
        self.progress_path = progress_path
        # The deployment's API (the head's; P/D: the router's) and, P/D, every instance's own.
        self.events: dict[str, float] = {}
        self.api = Endpoint("router" if self.router else head.name, self.api_base, self.router or head, self.events)
        self.instances = [Endpoint(n.name, n.api_base, n) for n in self.nodes] if self.router else []
        self.last_problem = ""
        self.final_problem = ""  # an API answer that asking again cannot change: fail now, not at the deadline
        self.final_node: Node | None = None
        self.final_kind = "bad answer"
        self.no_transfer = 0
        self.kv: dict[str, Any] | None = None
        # Where the time between a node's READY and the first correct answer goes: every API attempt (port,
        # models, answer; kept from the first port probe on) and how long each round of SSH polls took.
        self.attempts: list[dict[str, Any]] = []
        self.poll_s: list[float] = []

    @property
    def wrong_answers(self) -> int:
        return self.api.wrong_answers

    # -- readiness ------------------------------------------------------------------------------

    def _poll_all(self, pool: ThreadPoolExecutor) -> list[tuple[Node, dict]]:
        return list(zip(self.units, pool.map(lambda n: n.probe(), self.units)))

    def close(self) -> None:
        """End the SSH masters and remove their private directory."""
        for n in self.units:
            n.remote.close()
        shutil.rmtree(self.control_dir, ignore_errors=True)

    def wait(self) -> dict[str, Any]:
        try:
            return self._wait()
        finally:
            self.close()

    def _wait(self) -> dict[str, Any]:
        t0 = time.time()
        end = t0 + self.deadline
        with ThreadPoolExecutor(max_workers=max(4, len(self.units))) as pool:
            while True:
                now = time.time()
                all_active = True
                polled = self._poll_all(pool)
                self.poll_s.append(time.time() - now)
                for node, probe in polled:
                    node.state = probe
                    why = judge_node(node, probe, self.unreachable_after)
                    if why and node.failed_at is None:
                        node.failed_at, node.failure = time.time(), why
                    unit = probe.get("unit", {})
                    if unit.get("ActiveState") != "active":
                        all_active = False
                    elif node.ready_seen_at is None:
                        node.ready_seen_at = time.time()
                self._write_progress(t0)
                if any(n.failed_at for n in self.units):
                    return self._fail(t0, "a unit failed")
                if all_active:
                    answer = self._api_checks()
                    if self.final_problem:
                        node = self.final_node or self.nodes[0]
                        node.failed_at = time.time()
                        node.failure = f"asking again cannot help: {self.final_problem}"
                        return self._fail(t0, self.final_kind)
                    if answer is not None:
                        report = self._report(t0)
                        return {"ready": True, "failed": False, **report, "answer": answer, "reported_at": time.time()}
                if now > end:
                    return self._fail(t0, "deadline")
                time.sleep(max(0.0, self.poll - (time.time() - now)))

    def progress(self, t0: float) -> dict[str, Any]:
        """Where the start is now: each unit's state and start-up phase, and the API's last problem."""
        rows = []
        for n in self.units:
            st = _status_for(n, n.state) or {}
            rows.append({"name": n.name, "unit": n.state.get("unit", {}).get("ActiveState") or "unknown",
                         "phase": st.get("phase"), "failed": n.failure})  # fmt: skip
        return {"elapsed_s": round(time.time() - t0, 1), "deadline_s": self.deadline, "units": rows,
                "api": self.last_problem}  # fmt: skip

    def _write_progress(self, t0: float) -> None:
        # For the play's progress lines (llmfleet_job_wait): best effort, never a reason to fail the gate.
        if not self.progress_path:
            return
        tmp = f"{self.progress_path}.tmp"
        try:
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump(self.progress(t0), f)
            os.replace(tmp, self.progress_path)
        except OSError:
            pass

    def _api_checks(self) -> str | None:
        """P/D: every instance alone first, then the router (with the KV proof). The answer when all passed."""
        self.events.setdefault("all_units_active", time.time())
        pending = False
        for ep in self.instances:
            if self._endpoint_check(ep) is None:
                pending = True
            if self.final_problem:
                return None
        if pending:
            return None
        return self._endpoint_check(self.api, kv=self.router is not None)

    def _attempt(self, ep: Endpoint, step: str, at: float, ok: bool, why: str | None) -> None:
        # Port probes before the port opens are one entry each poll for minutes: keep the last few only.
        if step == "port" and not ok and self.attempts and self.attempts[-1]["step"] == "port":
            self.attempts[-1].update(at=at, tries=self.attempts[-1].get("tries", 1) + 1)
            return
        entry = {"api": ep.name, "step": step, "at": at, "s": round(time.time() - at, 3), "ok": ok}
        if why:
            entry["why"] = why
        self.attempts.append(entry)

    def _final(self, why: str, node: Node, kind: str = "bad answer") -> None:
        self.final_problem, self.final_node, self.final_kind = why, node, kind

    def _endpoint_check(self, ep: Endpoint, kv: bool = False) -> str | None:
        """Port, then /v1/models, then the answer; each step once it passed (an instance's answer once)."""
        label = f"{ep.name}: " if self.router else ""
        if "port_open" not in ep.events:
            t = time.time()
            is_open = port_open(ep.host, ep.port)
            self._attempt(ep, "port", t, is_open, None if is_open else "not open")
            if is_open:
                ep.events["port_open"] = time.time()
        if "port_open" in ep.events and "models_listed" not in ep.events:
            t = time.time()
            code, resp = http("GET", f"{ep.base}/v1/models", None, self.api_key, 10)
            ids = [m.get("id") for m in resp.get("data", [])] if isinstance(resp, dict) else []
            listed = code == 200 and self.model in ids
            self._attempt(ep, "models", t, listed, None if listed else f"HTTP {code}")
            if listed:
                ep.events["models_listed"] = time.time()
            else:
                self.last_problem = f"{label}/v1/models: HTTP {code}, ids {ids or str(resp)[:200]}"
        if "models_listed" not in ep.events:
            return None
        if ep.answer is not None and not kv:
            return ep.answer
        before = self._kv_read() if kv else None
        if kv and before is None:
            return None  # a decode instance's /metrics could not be read, or lacks the metric (final)
        t = time.time()
        chk = chat_check(ep.base, self.model, self.prompt, self.expect, api_key=self.api_key, timeout=120)
        self._attempt(ep, "answer", t, chk["ok"], None if chk["ok"] else chk["why"][:200])
        if not chk["ok"]:
            self.last_problem = label + chk["why"]
            # A refused request, or the same wrong answer three times in a row, will not fix itself.
            ep.wrong_answers = ep.wrong_answers + 1 if "answer" in chk else 0
            if chk.get("final") or ep.wrong_answers >= STRIKES:
                self._final(label + chk["why"], ep.node)
            return None
        ep.events.setdefault("first_correct_answer", time.time())
        if kv and not self._kv_proven(before or {}):
            return None
        ep.answer = chk["answer"]
        return ep.answer

    # -- P/D: the KV transfer ----------------------------------------------------------------------

    def _kv_read(self) -> dict[str, dict[str, Any]] | None:
        """kv_counters of every instance, or None (last_problem says why; a missing metric is final)."""
        snaps: dict[str, dict[str, Any]] = {}
        for ep in self.instances:
            code, text = http_text(f"{ep.base}/metrics", self.api_key, 10)
            if code != 200:
                self.last_problem = f"{ep.name}: /metrics: HTTP {code}: {text.strip()[:200]}"
                return None
            snap = kv_counters(text)
            if ep.node.pd_role == "decode" and "external_kv_transfer" not in snap["tokens_by_source"]:
                self._final(
                    f'decode instance {ep.name}\'s /metrics has no {KV_METRIC}{{source="external_kv_transfer"}}, '
                    "the gate's proof that the KV cache came from the prefill (vLLM 0.32 exports it from start, "
                    "at 0; an older vLLM or --disable-log-stats does not): use vLLM 0.32 or later with its stats "
                    "on, or set engine_pd_require_kv_transfer=false to accept an answer without that proof",
                    ep.node,
                    "no kv transfer",
                )
                return None
            snaps[ep.name] = snap
        return snaps

    def _kv_proven(self, before: dict[str, dict[str, Any]]) -> bool:
        """After a correct answer through the router: did a decode instance receive the prompt's KV?"""
        deltas: dict[str, dict[str, Any]] = {}
        verdict: dict[str, Any] = {"ok": False}
        # The counters are updated as the engine's outputs are processed: read again briefly when nothing moved.
        for attempt in range(3):
            after = self._kv_read()
            if after is None:
                return False
            roles = {ep.name: ep.node.pd_role for ep in self.instances}
            deltas = {n: {"role": roles[n], **kv_delta(before.get(n, {}), after[n])} for n in after}
            verdict = kv_verdict(deltas)
            if verdict["ok"] or any(any(v > 0 for v in d["tokens_by_source"].values()) for d in deltas.values()):
                break
            if attempt < 2:
                time.sleep(1)
        self.kv = {"required": self.require_kv_transfer, "proven": verdict["ok"], "decode": verdict["decode"],
                   "metric": KV_METRIC, "nodes": deltas}  # fmt: skip
        self.kv["summary"] = kv_summary(self.kv)
        if verdict["ok"]:
            self.events.setdefault("kv_transfer_proven", time.time())
            return True
        if not self.require_kv_transfer:
            return True
        self.no_transfer += 1
        self.last_problem = verdict["why"]
        if self.no_transfer >= STRIKES:
            node = next((n for n in self.nodes if n.name == verdict.get("node")), self.nodes[0])
            self._final(f"{verdict['why']} ({self.no_transfer} answers in a row); {KV_HINT}", node, "no kv transfer")
        return False

    # -- reporting ---------------------------------------------------------------------------------

    def _timeline(self, t0: float) -> dict[str, Any]:
        starts = []
        nodes = {}
        for n in self.units:
            st = _status_for(n, n.state) or {}
            phases = {p.get("phase"): p.get("at") for p in st.get("phases") or []}
            row = {
                "rank": n.rank,
                "unit": n.state.get("unit", {}).get("ActiveState"),
                "phase": st.get("phase"),
                "unit_start": st.get("started_at"),
                "weights_loaded": phases.get("loaded"),
                "node_ready": st.get("ready_at"),
                "gate_saw_active": n.ready_seen_at,  # the SSH poll that first found the unit active
            }
            if st.get("started_at"):
                starts.append(st["started_at"])
            nodes[n.name] = row
        base = min(starts) if starts else t0
        rel = {k: round(v - base, 2) for k, v in self.events.items()}
        for row in nodes.values():
            for k in ("unit_start", "weights_loaded", "node_ready", "gate_saw_active"):
                if isinstance(row[k], (int, float)):
                    row[k] = round(row[k] - base, 2)
        out = {"t0": base, "nodes": nodes, "head": rel}
        out["attempts"] = [dict(a, at=round(a["at"] - base, 2)) for a in self.attempts]
        if self.poll_s:
            polls = sorted(self.poll_s)
            out["polls"] = {"count": len(polls), "median_s": round(polls[len(polls) // 2], 3),
                            "max_s": round(polls[-1], 3)}  # fmt: skip
        if self.instances:
            out["instances"] = {ep.name: {k: round(v - base, 2) for k, v in ep.events.items()} for ep in self.instances}
        return out

    def _report(self, t0: float) -> dict[str, Any]:
        tl = self._timeline(t0)
        out = {"timeline": tl, "elapsed_s": round(time.time() - t0, 2), "last_problem": self.last_problem}
        if self.router:
            out["kv_transfer"] = self.kv or {"required": self.require_kv_transfer, "proven": False, "decode": [],
                                             "metric": KV_METRIC, "nodes": {}, "summary": "not reached"}  # fmt: skip
        return out

    # -- failure ---------------------------------------------------------------------------------

    def _record(self, node: Node) -> dict | None:
        if node.unreachable:
            return None
        rd = self.read_as
        rf = node.record_file
        script = f"{read_cmd(rf, rd)}; echo @@1; {read_cmd(rf + '.1', rd)}"
        _, out, _ = node.remote.run(script, timeout=20)
        cur, _, prev = out.partition("@@1")
        recs = [r for r in (_json_or_none(cur), _json_or_none(prev)) if r]
        # The failing run: not a clean stop, the newest that ended after the gate began.
        bad = [r for r in recs if r.get("verdict") not in ("clean-stop", None)]
        return (bad or recs or [None])[0]

    def _journal(self, node: Node) -> list[str]:
        if node.unreachable:
            return [f"(no journal: {node.name} is unreachable over SSH)"]
        u = shlex.quote(node.unit)
        n = int(self.journal_lines)
        _, out, _ = node.remote.run(f"journalctl -u {u} -n {n} -o short-iso --no-pager 2>&1", timeout=30)
        return out.splitlines()[-n:]

    def _least_advanced(self) -> Node:
        """Deadline with nobody failed: the least advanced engine node holds the others; with every engine
        unit up, a router unit still starting; else the head (the API never answered right)."""
        waiting = [n for n in self.nodes if n.state.get("unit", {}).get("ActiveState") != "active"]
        if not waiting and self.router and self.router.state.get("unit", {}).get("ActiveState") != "active":
            return self.router

        def progress(n: Node) -> tuple[int, int]:
            st = _status_for(n, n.state) or {}
            return (phase_rank(st.get("phase")), -n.rank)

        return min(waiting or self.nodes, key=progress)

    def _fail(self, t0: float, kind: str) -> dict[str, Any]:
        failed = [n for n in self.units if n.failed_at]
        records = {}
        if failed:
            with ThreadPoolExecutor(max_workers=len(failed)) as pool:
                for n, rec in zip(failed, pool.map(self._record, failed)):
                    records[n.name] = rec

            first = first_failed(failed, records, t0)
            why = first.failure
        else:
            first = self._least_advanced()
            st = _status_for(first, first.state) or {}
            why = (
                f"deadline of {self.deadline:.0f} s passed; least advanced node reached phase "
                f"{st.get('phase') or 'unknown'}"
                + (f"; last API problem: {self.last_problem}" if self.last_problem else "")
            )
            records[first.name] = self._record(first)
        report = self._report(t0)
        journal = self._journal(first)
        stop = self.stop_all()
        rec = records.get(first.name)
        rank = (rec or {}).get("failed_rank")
        return {
            "ready": False,
            "failed": True,
            "kind": kind,
            "first_failed": {
                "node": first.name,
                "node_rank": first.rank,
                "unit": first.unit,
                "why": why,
                "rank": rank,
                "record": rec,
                "journal_tail": journal,
            },
            "failed_nodes": [n.name for n in failed],
            "stop": stop,
            **report,
            "reported_at": time.time(),
        }

    # -- ordered stop ------------------------------------------------------------------------------

    def stop_all(self) -> list[dict[str, Any]]:
        first = [(self.router.remote, self.router.unit, self.router.record_file)] if self.router else []
        return ordered_stop(
            [n.remote for n in self.nodes], self.unit, self.record_file, self.stop_timeout, read_as=self.read_as,
            first=first,
        )  # fmt: skip


def _stop_one(remote: Remote, unit: str, record_file: str, timeout: float, read_as: str | None) -> dict[str, Any]:
    u = shlex.quote(unit)
    t = time.time()
    rc, out, err = remote.run(
        f"systemctl stop {u}; rc=$?; systemctl show {u} --property={SHOW_PROPS} --no-pager; "
        f"echo @@record; {read_cmd(record_file, read_as)}; echo; echo @@rc=$rc",
        timeout=timeout + 30,
    )
    show, _, rest = out.partition("@@record")
    rec_text, _, _ = rest.partition("@@rc=")
    unit_state = _parse_show(show)
    rec = _json_or_none(rec_text)
    row: dict[str, Any] = {
        "node": remote.name,
        "unit": unit,
        "seconds": round(time.time() - t, 2),
        "state": unit_state.get("ActiveState", "unknown"),
        "result": unit_state.get("Result"),
    }
    if rc != 0 and not show:
        row["error"] = (err or "").strip()[-300:] or f"ssh exit {rc}"
    killed = []
    if rec and rec.get("killed_after_timeout") and rec.get("ended_at", 0) >= t - 1:
        killed.append(rec.get("reason") or "the wrapper killed the engine after its stop timeout")
    if unit_state.get("Result") == "timeout":
        killed.append("systemd killed the unit after TimeoutStopSec")
    row["killed"] = killed
    row["stopped"] = row["state"] in ("inactive", "failed")
    return row


def ordered_stop(  # noqa: PLR0917 (the stop's fixed facts)
    remotes: list[Remote],
    unit: str,
    record_file: str,
    timeout: float,
    read_as: str | None = None,
    first: list[tuple[Remote, str, str]] | None = None,
) -> list[dict[str, Any]]:
    """`first` ((remote, unit, record) each, in order: the P/D router), then the head alone, then the
    others together; each with a bounded wait."""
    rows = [_stop_one(r, u, rec, timeout, read_as) for r, u, rec in first or []]
    if not remotes:
        return rows
    rows.append(_stop_one(remotes[0], unit, record_file, timeout, read_as))
    rest = remotes[1:]
    if rest:
        with ThreadPoolExecutor(max_workers=len(rest)) as pool:
            rows += list(pool.map(lambda r: _stop_one(r, unit, record_file, timeout, read_as), rest))
    return rows


_ASYNC_KEYS = ("invocation", "item", "ansible_loop_var", "ansible_index_var", "_engine_gate_i", "changed")


def deployment_record(gates: list[dict[str, Any]], **meta: Any) -> dict[str, Any]:
    """engine-<deployment>.json for the report: the gate results of this run and, when one failed, its verdict,
    first failed node and rank, first error and log tail up front."""
    clean = [{k: v for k, v in g.items() if k not in _ASYNC_KEYS} for g in gates]
    failure = None
    for g in clean:
        if g.get("ready") or not (g.get("failed") or g.get("first_failed")):
            continue
        ff = g.get("first_failed") or {}
        rec = ff.get("record") or {}
        failure = {
            "verdict": rec.get("verdict") or g.get("kind") or "failed",
            "kind": g.get("kind"),
            "message": g.get("msg"),
            "node": ff.get("node"),
            "rank": ff.get("rank"),
            "why": ff.get("why"),
            "first_error": rec.get("first_error"),
            "log_tail": ff.get("journal_tail") or [],
        }
        break
    ok = bool(clean) and failure is None and all(g.get("ready") for g in clean)
    return {**meta, "ok": ok, "gates": clean, "failure": failure}


TIMELINE_COLUMNS = (("unit_start", "unit start"), ("weights_loaded", "weights loaded"), ("node_ready", "ready"))
HEAD_EVENTS = (
    ("all_units_active", "all units active"),
    ("port_open", "port open"),
    ("models_listed", "models listed"),
    ("first_correct_answer", "first correct answer"),
    ("kv_transfer_proven", "KV transfer proven"),
)


def timeline_table(timeline: dict[str, Any]) -> list[str]:
    """The cold-start timeline as fixed-width lines, seconds from the first unit start (play output)."""

    def cell(v: Any) -> str:
        return f"{v:.1f}" if isinstance(v, (int, float)) else "-"

    head = f"{'node':<16} {'rank':>4}  " + "  ".join(f"{t:>14}" for _, t in TIMELINE_COLUMNS) + "  phase"
    lines = [head]
    for name, row in sorted((timeline.get("nodes") or {}).items(), key=lambda kv: (kv[1].get("rank", 0), kv[0])):
        cells = "  ".join(f"{cell(row.get(k)):>14}" for k, _ in TIMELINE_COLUMNS)
        lines.append(f"{name:<16} {row.get('rank', ''):>4}  {cells}  {row.get('phase') or '-'}")
    ev = timeline.get("head") or {}
    got = [f"{t} {ev[k]:.1f} s" for k, t in HEAD_EVENTS if isinstance(ev.get(k), (int, float))]
    lines.append("deployment: " + (", ".join(got) if got else "no API event reached"))
    return lines


def progress_line(progress: dict[str, Any]) -> str:
    """One line for the play while the gate waits: `engine gate 42/3600 s: node1 active (serving), ...`."""
    units = []
    for u in progress.get("units") or []:
        state = u.get("unit") or "unknown"
        if u.get("failed"):
            state = f"FAILED ({u['failed']})"
        units.append(f"{u.get('name')} {state}" + (f" ({u['phase']})" if u.get("phase") else ""))
    line = f"engine gate {progress.get('elapsed_s', 0):.0f}/{progress.get('deadline_s', 0):.0f} s: " + ", ".join(units)
    if progress.get("api"):
        line += f"; API: {progress['api']}"
    return line


def failure_message(res: dict[str, Any]) -> str:
    ff = res["first_failed"]
    rank = ff.get("rank") or {}
    rank_txt = ""
    if rank:
        bits = [f"{k.upper()}{rank[k]}" for k in ("tp", "pp") if rank.get(k) is not None]
        if rank.get("rank") is not None:
            bits.append(f"rank {rank['rank']}")
        rank_txt = f" ({' '.join(bits)})" if bits else ""
    rec = ff.get("record") or {}
    lines = [f"engine not ready: first failed node {ff['node']} (node rank {ff['node_rank']}){rank_txt}: {ff['why']}"]
    if (res.get("kv_transfer") or {}).get("nodes"):
        lines.append(f"P/D evidence: {res['kv_transfer']['summary']}")
    if rec:
        lines.append(
            f"termination record: verdict {rec.get('verdict')}, exit {rec.get('exit_code')}: {rec.get('reason')}"
        )
        if rank.get("line"):
            lines.append(f"first error line: {rank['line']}")
    stopped = [s for s in res.get("stop", [])]
    lines.append(
        "stopped in order (head first): "
        + ", ".join(
            f"{s['node']}{' ' + s['unit'] if str(s.get('unit', '')).endswith('-router.service') else ''} {s['state']}"
            + (" (killed)" if s.get("killed") else "")
            for s in stopped
        )
    )
    left = [s["node"] for s in stopped if not s.get("stopped")]
    if left:
        lines.append(f"NOT stopped: {', '.join(left)} — stop them by hand (systemctl stop UNIT)")
    lines.append("journal tail of the first failed node:")
    lines += ["  " + x for x in ff.get("journal_tail", [])[-15:]]
    return "\n".join(lines)
