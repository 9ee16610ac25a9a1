"""`llmfleet status` of a deployment of replicas (llmfleet_replicas) against fake nodes: one table per replica,
each its own deployment (<deployment>-<name>) on its own nodes, and the replicas' router's line; a failed replica
is named, the other reads healthy."""

from __future__ import annotations

import argparse
import http.server
import json
import threading
import typing

import pytest
from test_oncall_fakes import Fakes

from llmfleet.oncall import restart as oncall_restart
from llmfleet.oncall import status as oncall_status
from llmfleet.oncall import stop as oncall_stop

REPLICAS = [{"name": "r0", "nodes": ["node1", "node2"]}, {"name": "r1", "nodes": ["node4", "node3"]}]


class Router(http.server.ThreadingHTTPServer):
    """A stand-in for the router's keyless worker API (shapes as vllm-router 0.1.17 and sglang-router 0.3.2 answer,
    tests/fixtures/engines/sglang-router-0.3.2.worker-api.txt): `answers` maps a path to the JSON it returns."""

    answers: typing.ClassVar[dict] = {"/list_workers": {"urls": []}}


class _Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = json.dumps(self.server.answers.get(self.path, {})).encode()
        self.send_response(200 if self.path in self.server.answers else 404)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def router():
    srv = Router(("127.0.0.1", 0), _Handler)
    srv.answers = dict(Router.answers)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield srv
    srv.shutdown()
    srv.server_close()


@pytest.fixture
def port(router):
    """The replicas' heads and the router serve here (the router's worker API answers)."""
    return router.server_address[1]


def fleet(tmp_path, port) -> Fakes:
    """Two replicas and the router, every unit active; the replicas' heads (node1, node4) and the router serve
    on a port that listens."""
    f = Fakes(tmp_path, ["node1", "node2", "node3", "node4"], llmfleet_replicas=REPLICAS)
    for n, rep in (("node1", "r0"), ("node2", "r0"), ("node3", "r1"), ("node4", "r1")):
        f.set_unit(n, unit=f"llmfleet-demo-{rep}.service")
        if n in ("node1", "node4"):
            unit = f.unit_state(n, f"llmfleet-demo-{rep}.service")
            f.set_unit(n, unit=f"llmfleet-demo-{rep}.service", argv=[*unit["argv"][:-1], str(port)])
    f.set_unit("node1", unit="llmfleet-demo-router.service",
               argv=["/usr/local/bin/llmfleet", "exec", "--", "vllm-router", "--port", str(port)])  # fmt: skip
    return f


def status(f: Fakes, capsys, *argv: str) -> tuple[int, str]:
    p = argparse.ArgumentParser()
    oncall_status.add_arguments(p)
    rc = oncall_status.run(p.parse_args(["-i", str(f.inventory), *argv]), transport=f.transport())
    return rc, capsys.readouterr().out


def test_each_replica_is_its_own_deployment_and_the_router_has_a_line(tmp_path, capsys, port):
    f = fleet(tmp_path, port)
    f.set_unit("node3", unit="llmfleet-demo-r1.service", ActiveState="failed", SubState="failed", Result="exit-code")
    rc, out = status(f, capsys)
    assert rc == 1, out
    assert "llmfleet-demo-r0.service on 2 node(s), head node1" in out
    # The replica's own order: node4 leads r1 (the fleet's head is not in it).
    assert "llmfleet-demo-r1.service on 2 node(s), head node4" in out
    assert "llmfleet-demo-router.service on node1: active/running" in out
    problems = [ln for ln in out.splitlines() if ln.startswith("  - ")]
    assert problems == ["  - node3: llmfleet-demo-r1.service is failed/failed"], out


def test_json_lists_the_replicas_and_the_router(tmp_path, capsys, port):
    rc, out = status(fleet(tmp_path, port), capsys, "--json")
    doc = json.loads(out)
    assert rc == 0, doc["problems"]
    assert [r["deployment"] for r in doc["replicas"]] == ["demo-r0", "demo-r1"]
    assert [n["node"] for n in doc["replicas"][1]["nodes"]] == ["node4", "node3"]
    assert doc["router"]["unit"] == "llmfleet-demo-router.service" and doc["router"]["active_state"] == "active"


# ---- stop and restart take one replica --------------------------------------------------------------------------


def _control(mod, f: Fakes, capsys, *argv: str) -> tuple[int, str, str]:
    p = argparse.ArgumentParser()
    mod.add_arguments(p)
    rc = mod.run(p.parse_args(["-i", str(f.inventory), *argv]), transport=f.transport())
    out = capsys.readouterr()
    return rc, out.out, out.err


def _changed(f: Fakes, verb: str) -> list[tuple[str, str]]:
    return sorted((c[1], c[-1]) for c in f.calls() if c[2] == "systemctl" and c[3] == verb)


def test_restart_takes_one_replica_on_its_nodes_the_other_and_the_router_untouched(tmp_path, capsys, port):
    f = fleet(tmp_path, port)
    rc, out, err = _control(oncall_restart, f, capsys, "--replica", "r1", "--ready-timeout", "20")
    assert rc == 0, out + err
    assert _changed(f, "stop") == [("node3", "llmfleet-demo-r1.service"), ("node4", "llmfleet-demo-r1.service")]
    # node4 leads r1: started first
    assert [n for _, n in sorted((c[0], c[1]) for c in f.calls() if c[3] == "start")] == ["node4", "node3"]
    assert "READY: every unit active" in out


def test_stop_takes_one_replica(tmp_path, capsys, port):
    f = fleet(tmp_path, port)
    rc, out, err = _control(oncall_stop, f, capsys, "--replica", "r0")
    assert rc == 0, out + err
    assert _changed(f, "stop") == [("node1", "llmfleet-demo-r0.service"), ("node2", "llmfleet-demo-r0.service")]
    assert f.unit_state("node4", "llmfleet-demo-r1.service")["ActiveState"] == "active"


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        ((), "demo runs as replicas (r0, r1) behind llmfleet-demo-router.service: name one with --replica NAME"),
        (("--replica", "r7"), "--replica r7: demo has no such replica: name one of r0, r1"),
    ],
)
def test_a_deployment_of_replicas_needs_a_replica_named(tmp_path, capsys, port, argv, says):
    f = fleet(tmp_path, port)
    for mod in (oncall_stop, oncall_restart):
        rc, _, err = _control(mod, f, capsys, *argv)
        assert rc == 2 and says in err and "Traceback" not in err, err
    assert _changed(f, "stop") == [] and _changed(f, "start") == []


def test_replica_on_a_deployment_of_one_instance_is_refused(tmp_path, capsys):
    f = Fakes(tmp_path, ["node1", "node2"])
    f.set_unit("node1")
    f.set_unit("node2")
    rc, _, err = _control(oncall_stop, f, capsys, "--replica", "r0")
    assert rc == 2 and "--replica r0: demo has no llmfleet_replicas (it is one instance)" in err, err


def with_router_urls(f: Fakes, port: int, command: list[str]) -> list[str]:
    urls = [f"http://10.0.0.1:{port}", f"http://10.0.0.4:{port}"]
    f.set_unit("node1", unit="llmfleet-demo-router.service",
               argv=["/usr/local/bin/llmfleet", "exec", "--", *command, "--port", str(port), "--worker-urls", *urls])  # fmt: skip
    return urls


def test_status_shows_who_the_vllm_router_routes_to_and_a_replica_it_dropped(tmp_path, capsys, port, router):
    f = fleet(tmp_path, port)
    urls = with_router_urls(f, port, ["vllm-router", "--host", "127.0.0.1"])
    router.answers = {"/list_workers": {"urls": urls}}
    rc, out = status(f, capsys)
    assert rc == 0, out
    assert f"  demo-r0 ({urls[0]}): in the router" in out and f"  demo-r1 ({urls[1]}): in the router" in out
    router.answers = {"/list_workers": {"urls": urls[1:]}}  # r0 out (a rollout's step, or the router dropped it)
    rc, out = status(f, capsys)
    assert rc == 1, out
    assert f"  - llmfleet-demo-router.service on node1: demo-r0 ({urls[0]}) is not in the router" in out, out
    assert f"  demo-r0 ({urls[0]}): NOT IN THE ROUTER" in out


def test_status_reads_sglang_routers_health_of_each_replica(tmp_path, capsys, port, router):
    f = fleet(tmp_path, port)
    urls = with_router_urls(f, port, ["/opt/venv/bin/sglang-router", "launch", "--host", "127.0.0.1"])
    router.answers = {"/workers": {"workers": [{"id": "a", "url": urls[0], "is_healthy": True},
                                              {"id": "b", "url": urls[1], "is_healthy": False}]}}  # fmt: skip
    rc, out = status(f, capsys, "--json")
    doc = json.loads(out)
    assert rc == 1
    assert doc["router"]["members"]["expected"] == urls
    assert doc["problems"] == [f"llmfleet-demo-router.service on node1: demo-r1 ({urls[1]}) is unhealthy in the router"]


def test_a_router_whose_worker_list_does_not_answer_is_a_problem(tmp_path, capsys, port, router):
    f = fleet(tmp_path, port)
    with_router_urls(f, port, ["vllm-router"])
    router.answers = {}  # 404 on /list_workers
    rc, out = status(f, capsys)
    assert rc == 1 and "llmfleet-demo-router.service on node1: its worker list did not answer" in out, out
