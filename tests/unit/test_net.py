"""One TCP connect and what became of it (preflight's port probes and the readiness gate use it)."""

import socket

import pytest

from llmfleet import net


def test_a_listening_port_is_open_and_a_closed_one_refused():
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(1)
        port = srv.getsockname()[1]
        assert net.connect_state("127.0.0.1", port, 2.0) == "open"
    assert net.connect_state("127.0.0.1", port, 2.0) == "refused"  # nothing listens there any more


@pytest.mark.parametrize(
    ("error", "state"),
    [(TimeoutError("timed out"), "timeout"), (OSError(113, "No route to host"), "OSError"),
     (socket.gaierror(-2, "Name or service not known"), "gaierror")],
)  # fmt: skip
def test_other_outcomes_are_named(monkeypatch, error, state):
    def connect(address, timeout):
        assert address == ("10.0.0.9", 50080) and timeout == 0.5
        raise error

    monkeypatch.setattr(net.socket, "create_connection", connect)
    assert net.connect_state("10.0.0.9", 50080, 0.5) == state


def test_preflight_and_gate_use_it():
    from llmfleet.checks import preflight
    from llmfleet.engine import gate

    assert preflight.connect_state is gate.connect_state is net.connect_state
