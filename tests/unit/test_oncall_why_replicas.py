"""`llmfleet why` on a deployment of replicas (llmfleet_replicas) against fake nodes: one bundle and one verdict per
replica, each under a line that names the replica, so that a failure says which replica failed; --replica takes
one (and --json needs it)."""

from __future__ import annotations

import argparse
import json
import time

from test_oncall_fakes import Fakes

from llmfleet.oncall import why as oncall_why

REPLICAS = [{"name": "r0", "nodes": ["node1", "node2"]}, {"name": "r1", "nodes": ["node3", "node4"]}]


def fleet(tmp_path) -> Fakes:
    """Two replicas, every unit active; replica r1's rank on node4 left a failed termination record."""
    f = Fakes(tmp_path, ["node1", "node2", "node3", "node4"], llmfleet_replicas=REPLICAS)
    for n, rep in (("node1", "r0"), ("node2", "r0"), ("node3", "r1"), ("node4", "r1")):
        d = tmp_path / n / "state" / "engine" / f"demo-{rep}"
        d.mkdir(parents=True, exist_ok=True)
        f.set_unit(n, unit=f"llmfleet-demo-{rep}.service",
                   argv=["/usr/local/bin/llmfleet", "exec", "--record", str(d / "termination.json"), "--status",
                         str(d / "status.json"), "--", "/opt/sglang", "serve", "--port", "1"])  # fmt: skip
        f.journal(
            n, f"2026-12-04T10:00:00+0000 {n} llmfleet-demo-{rep}[1]: hello\n", unit=f"llmfleet-demo-{rep}.service"
        )
    rec = {"schema": "llmfleet.termination/1", "host": "node4", "unit": "llmfleet-demo-r1.service",
           "stop_requested": False, "verdict": "exit-code", "exit_code": 1, "reason": "the engine exited with code 1",
           "started_at": time.time() - 600, "ended_at": time.time() - 60, "phase": "serving", "failed_rank": None,
           "first_error": None, "tail": ["x"] * 3}  # fmt: skip
    (tmp_path / "node4" / "state" / "engine" / "demo-r1" / "termination.json").write_text(json.dumps(rec))
    return f


def why(f: Fakes, capsys, *argv: str) -> tuple[int, str, str]:
    p = argparse.ArgumentParser()
    oncall_why.add_arguments(p)
    rc = oncall_why.run(p.parse_args(["-i", str(f.inventory), *argv]), transport=f.transport())
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def test_a_failure_names_its_replica(tmp_path, capsys):
    rc, out, err = why(fleet(tmp_path), capsys)
    assert rc == 1, out + err
    assert "replica r0 (demo-r0 on node1, node2):" in out and "replica r1 (demo-r1 on node3, node4):" in out, out
    r1 = out.split("replica r1 (demo-r1 on node3, node4):", 1)[1]
    assert "node4" in r1, out


def test_one_replica_as_json(tmp_path, capsys):
    f = fleet(tmp_path)
    rc, out, _ = why(f, capsys, "--replica", "r1", "--json")
    report = json.loads(out)
    assert rc == 1 and report["first_failure"]["node"] == "node4", out[-2000:]
    rc, out, _ = why(f, capsys, "--replica", "r0", "--json")
    assert rc == 0 and not json.loads(out)["failed"], out[-2000:]


def test_json_for_every_replica_at_once_is_refused_naming_them(tmp_path, capsys):
    rc, _, err = why(fleet(tmp_path), capsys, "--json")
    assert rc == 2 and "runs as replicas (r0, r1)" in err and "--replica NAME" in err, err
