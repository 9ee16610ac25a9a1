"""A node the deployment link stopped because another node failed (`peer-failed`) is a failure in `llmfleet status`:
the link asked for the stop, so its record says stop_requested, which alone reads as an operator's stop."""

from llmfleet.oncall.status import record_failed


def test_a_peer_failed_record_is_a_failure_though_the_link_requested_its_stop():
    """Before: status never showed a `peer-failed` previous run (record_failed said no failure)."""
    rec = {"verdict": "peer-failed", "exit_code": 75, "stop_requested": True, "stop_signal": "SIGTERM",
           "reason": "stopped with the deployment: node2 failed first (rank-died, exit 70)"}  # fmt: skip
    assert record_failed(rec)
    # the link's stop on another node's operator stop stays no failure
    assert not record_failed({"verdict": "deployment-stopped", "exit_code": 0, "stop_requested": True})
