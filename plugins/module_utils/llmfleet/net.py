"""TCP reachability (stdlib only): one connect and what became of it. Preflight probes peers' ports
with it on nodes; the readiness gate asks whether the head listens from the ops host.
"""

from __future__ import annotations

import socket


def connect_state(ip: str, port: int, timeout: float) -> str:
    """open, refused, timeout or the OSError name for one TCP connect."""
    try:
        with socket.create_connection((ip, port), timeout=timeout):
            return "open"
    except ConnectionRefusedError:
        return "refused"
    except TimeoutError:
        return "timeout"
    except OSError as e:
        return type(e).__name__
