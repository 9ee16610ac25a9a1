"""llmfleet_engine_ready: options -> the gate.Gate it builds, its verdict -> exit or fail."""

from typing import ClassVar

import pytest

import llmfleet_engine_ready as mod
from ansible_collections.llmfleet.fleet.plugins.module_utils.llmfleet.engine.gate import DEFAULT_PROMPT, PrivilegeError
from tests.unit.modules.util import fail, job_result, run, undocumented

pytestmark = pytest.mark.usefixtures("module_exits")

SSH = ["ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=30", "ops@10.0.0.11"]
READY = {"ready": True, "failed": False, "timeline": {"t0": 1.0, "nodes": {}, "head": {}}, "elapsed_s": 12.5,
         "last_problem": "", "answer": "703", "reported_at": 2.0}  # fmt: skip
NOT_READY = {
    "ready": False, "failed": True, "kind": "a unit failed", "timeline": {"t0": 1.0, "nodes": {}, "head": {}},
    "elapsed_s": 40.0, "last_problem": "", "reported_at": 3.0, "failed_nodes": ["node2"],
    "first_failed": {"node": "node2", "node_rank": 1, "why": "unit failed (exit 70)", "rank": None, "record": None,
                     "journal_tail": ["worker died"]},
    "stop": [{"node": "node1", "state": "inactive", "stopped": True}, {"node": "node2", "state": "failed", "stopped": True}],
}  # fmt: skip


class FakeGate:
    made: ClassVar[list] = []
    verdict: ClassVar[dict] = READY
    raises: ClassVar[BaseException | None] = None

    def __init__(self, nodes, unit, **kwargs):
        FakeGate.made.append((nodes, unit, kwargs))

    def wait(self):
        if FakeGate.raises:
            raise FakeGate.raises
        return dict(FakeGate.verdict)


@pytest.fixture
def gate(monkeypatch):
    FakeGate.made, FakeGate.verdict, FakeGate.raises = [], READY, None
    monkeypatch.setattr(mod, "Gate", FakeGate)
    return FakeGate


def base(**over):
    return {"nodes": [{"name": "node1", "rank": 0, "ssh": SSH}, {"name": "node2", "rank": "1", "ssh": ["ssh", "node2"]}],
            "unit": "llmfleet-qwen.service", "status_file": "/var/lib/llmfleet/engine/qwen/status.json",
            "record_file": "/var/lib/llmfleet/engine/qwen/termination.json", "api_base": "http://10.0.0.11:30000",
            "model": "qwen", **over}  # fmt: skip


def test_options_become_the_gate(gate):
    res = run(mod, base(api_key="sk-secret", deadline="120", poll=1, stop_timeout=60, journal_lines=10,
                        unreachable_after=6, connect_timeout=2.9, read_as="llmfleet", expect="42", prompt="6*7?"))  # fmt: skip
    ((nodes, unit, kw),) = gate.made
    assert unit == "llmfleet-qwen.service"
    assert nodes == [
        {"name": "node1", "rank": 0, "ssh": [*SSH[:4], "ConnectTimeout=2", SSH[5]], "api_base": None, "pd_role": None},
        {"name": "node2", "rank": 1, "ssh": ["ssh", "node2"], "api_base": None, "pd_role": None},
    ]
    assert kw == {"status_file": "/var/lib/llmfleet/engine/qwen/status.json",
                  "record_file": "/var/lib/llmfleet/engine/qwen/termination.json",
                  "api_base": "http://10.0.0.11:30000", "model": "qwen", "api_key": "sk-secret", "prompt": "6*7?",
                  "expect": "42", "deadline": 120.0, "poll": 1.0, "journal_lines": 10, "stop_timeout": 60.0,
                  "unreachable_after": 6.0, "read_as": "llmfleet", "progress_path": None}  # fmt: skip
    assert res["ready"] is True and res["changed"] is False and res["answer"] == "703"
    assert not undocumented(mod, res)


def test_defaults(gate):
    run(mod, base(api_key=""))
    ((_nodes, _unit, kw),) = gate.made
    assert kw["api_key"] is None and kw["prompt"] == DEFAULT_PROMPT and kw["expect"] == "703"
    assert (kw["deadline"], kw["poll"], kw["stop_timeout"], kw["journal_lines"], kw["unreachable_after"]) == (
        3600,
        0.5,
        300,
        40,
        30,
    )
    assert kw["read_as"] is None


ROUTER = {"unit": "llmfleet-qwen-router.service", "status_file": "/var/lib/llmfleet/engine/qwen/router-status.json",
          "record_file": "/var/lib/llmfleet/engine/qwen/router-termination.json"}  # fmt: skip
KV = {"required": True, "proven": True, "decode": ["node2"], "metric": "vllm:prompt_tokens_by_source_total",
      "summary": "KV transferred to node2; ...",
      "nodes": {"node2": {"role": "decode", "tokens_by_source": {"external_kv_transfer": 16}, "nixl": {}}}}  # fmt: skip


def test_pd_options_become_the_gate_and_the_evidence_is_returned(gate):
    gate.verdict = dict(READY, kv_transfer=KV)
    nodes = [{"name": "node1", "rank": 0, "ssh": SSH, "api_base": "http://10.0.0.11:8000", "pd_role": "prefill"},
             {"name": "node2", "rank": 1, "ssh": ["ssh", "node2"], "api_base": "http://10.0.0.12:8000", "pd_role": "decode"}]  # fmt: skip
    res = run(mod, base(nodes=nodes, router=ROUTER, require_kv_transfer=False))
    ((got, _unit, kw),) = gate.made
    assert [(n["api_base"], n["pd_role"]) for n in got] == [
        ("http://10.0.0.11:8000", "prefill"),
        ("http://10.0.0.12:8000", "decode"),
    ]
    assert kw["router"] == ROUTER and kw["require_kv_transfer"] is False
    assert res["kv_transfer"] == KV and not undocumented(mod, res)
    # Without a router the P/D options are not passed (the plain gate)
    run(mod, base())
    assert "router" not in gate.made[-1][2] and "require_kv_transfer" not in gate.made[-1][2]


def test_pd_nodes_without_their_api_fail_naming_them():
    nodes = [{"name": "node1", "rank": 0, "ssh": SSH, "api_base": "http://10.0.0.11:8000", "pd_role": "prefill"},
             {"name": "node2", "rank": 1, "ssh": ["ssh", "node2"], "pd_role": "decode"}]  # fmt: skip
    msg = fail(mod, base(nodes=nodes, router=ROUTER))["msg"]
    assert (
        msg
        == "nodes ['node1', 'node2']: P/D (a router given): nodes ['node2'] need api_base and pd_role prefill|decode"
    )


@pytest.mark.parametrize("verdict", ["ready", "not ready", "refused"])
def test_detach_returns_a_job_and_its_progress_file_and_the_job_file_gets_the_modules_result(
    gate, monkeypatch, tmp_path, verdict
):
    monkeypatch.setenv("ANSIBLE_ASYNC_DIR", str(tmp_path / "async"))
    gate.verdict = READY if verdict == "ready" else NOT_READY
    gate.raises = PrivilegeError("node1: sudo -n refused") if verdict == "refused" else None
    res = run(mod, base(detach=True, job_timeout=60))
    assert res["started"] is True and res["finished"] is False and res["changed"] is False
    assert res["progress_path"] == res["results_file"] + ".progress"
    assert res["results_file"] == str(tmp_path / "async" / res["ansible_job_id"])
    assert gate.made[0][2]["progress_path"] == res["progress_path"] and not undocumented(mod, res)
    data = job_result(res["results_file"])  # what the module returns (or fails with) without detach
    if verdict == "ready":
        assert data == {**READY, "changed": False}
    elif verdict == "not ready":
        assert data["failed"] is True and data["msg"].startswith("engine not ready: first failed node node2")
    else:
        assert data == {"failed": True, "changed": False, "msg": "node1: sudo -n refused", "ready": False,
                        "timeline": {}}  # fmt: skip
    # A progress path the task gives is kept
    assert run(mod, base(detach=True, progress_path=str(tmp_path / "p.json")))["progress_path"] == str(
        tmp_path / "p.json"
    )


def test_check_mode_builds_no_gate(gate):
    res = run(mod, base(), check=True)
    assert gate.made == [] and res == {"changed": False, "ready": False, "skipped_in_check_mode": True, "timeline": {}}


def test_not_ready_fails_naming_the_first_failed_node(gate):
    gate.verdict = NOT_READY
    res = fail(mod, base())
    assert res["msg"].startswith("engine not ready: first failed node node2 (node rank 1): unit failed (exit 70)")
    assert "stopped in order (head first): node1 inactive, node2 failed" in res["msg"]
    assert res["ready"] is False and res["first_failed"]["node"] == "node2"
    assert not undocumented(mod, res)


def test_sudo_refusal_is_a_failure(gate):
    gate.raises = PrivilegeError("node1: sudo -n refused: a password is required")
    res = fail(mod, base())
    assert res["msg"] == "node1: sudo -n refused: a password is required" and res["ready"] is False


def test_no_head_among_the_nodes_is_a_failure_naming_them():
    # The real Gate: it refuses before it opens anything.
    nodes = [
        {"name": "node2", "rank": 1, "ssh": ["ssh", "node2"]},
        {"name": "node3", "rank": 2, "ssh": ["ssh", "node3"]},
    ]
    msg = fail(mod, base(nodes=nodes))["msg"]
    assert msg == "nodes ['node2', 'node3']: the gate needs the head (node rank 0) among its nodes"


BAD = [
    ({"nodes": [{"name": "node1", "rank": 0}]}, "missing required arguments: ssh found in nodes"),
    ({"nodes": [{"name": "node1", "rank": "head", "ssh": ["ssh"]}]}, "argument 'rank' is of type str found in 'nodes'. and we were unable to convert to int"),
    ({"nodes": [{"name": "node1", "rank": 0, "ssh": ["ssh"], "port": 22}]}, "Unsupported parameters for (basic.py) module: nodes.port"),
    ({"api_base": None}, "missing required arguments: api_base"),
    ({"deadline": "an hour"}, "argument 'deadline' is of type str and we were unable to convert to float"),
    ({"nodes": [{"name": "node1", "rank": 0, "ssh": ["ssh"], "pd_role": "both"}]}, "value of pd_role must be one of: prefill, decode"),
    ({"router": {"unit": "r.service"}}, "missing required arguments: record_file, status_file found in router"),
]  # fmt: skip


@pytest.mark.parametrize(("over", "text"), BAD)
@pytest.mark.parametrize("check", [False, True], ids=["run", "check"])
def test_bad_options_fail_naming_them(gate, over, text, check):
    args = {k: v for k, v in base(**over).items() if v is not None}
    assert text in fail(mod, args, check=check)["msg"]
    assert gate.made == []
