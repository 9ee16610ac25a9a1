"""Fault injection: LLMFLEET_SIM_FAULT="KIND:key=val[:once];..." (kinds crash, hang, slow_load, no_done).

A bad spec is a FaultSpecError naming the spec and what is wrong (the node main exits 2 with it); `:once`
faults leave a marker in the state directory so that a restarted unit comes up healthy."""

from __future__ import annotations

import hashlib
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PHASES = ("start", "rendezvous", "load", "serve")
FAULT_KEYS = {
    "crash": {"rank", "phase", "exit", "signal", "after"},
    "hang": {"rank", "phase", "after"},
    "slow_load": {"seconds", "rank"},
    "no_done": set(),
}
FAULT_REQUIRED = {"crash": {"rank", "phase"}, "hang": {"rank", "phase"}, "slow_load": {"seconds"}, "no_done": set()}
FAULT_PHASES = {"crash": PHASES, "hang": ("rendezvous", "load", "serve")}
FAULT_SIGNALS = {"SEGV": signal.SIGSEGV, "KILL": signal.SIGKILL, "ABRT": signal.SIGABRT}


class FaultSpecError(ValueError):
    pass


@dataclass(frozen=True)
class Fault:
    spec: str
    kind: str
    rank: int | None = None
    phase: str | None = None
    exit: int = 1
    signal: str | None = None
    after: float = 0.0
    seconds: float = 0.0
    once: bool = False

    def marker(self, state_dir: str) -> Path:
        digest = hashlib.sha1(self.spec.encode(), usedforsecurity=False).hexdigest()
        return Path(state_dir) / f"fault-{digest}.done"

    def applies_to(self, rank: int) -> bool:
        return self.rank is None or self.rank == rank


def _fault_value(spec: str, key: str, val: str, world: int | None) -> Any:
    def bad(why: str) -> FaultSpecError:
        return FaultSpecError(f"{spec!r}: {key}={val!r}: {why}")

    if key in ("rank", "exit"):
        try:
            n = int(val)
        except ValueError:
            raise bad("not an integer") from None
        if key == "rank" and (n < 0 or (world is not None and n >= world)):
            raise bad(f"no such global rank (world size {world})")
        if key == "exit" and not 0 <= n <= 255:
            raise bad("exit codes are 0..255")
        return n
    if key in ("after", "seconds"):
        try:
            x = float(val)
        except ValueError:
            raise bad("not a number of seconds") from None
        if x < 0:
            raise bad("negative")
        return x
    if key == "signal":
        name = val.upper().removeprefix("SIG")
        if name not in FAULT_SIGNALS:
            raise bad(f"one of {', '.join(FAULT_SIGNALS)}")
        return name
    return val  # phase: checked by the caller


def parse_fault(spec: str, world: int | None = None) -> Fault:
    """One spec "KIND:key=val:...[:once]"; FaultSpecError names the spec and what is wrong."""
    spec = spec.strip()
    kind, *parts = spec.split(":")
    if kind not in FAULT_KEYS:
        raise FaultSpecError(f"{spec!r}: unknown kind {kind!r} (one of {', '.join(FAULT_KEYS)})")
    vals: dict[str, Any] = {}
    once = False
    for part in parts:
        if part == "once":
            once = True
            continue
        key, eq, val = part.partition("=")
        if not eq or key not in FAULT_KEYS[kind]:
            allowed = ", ".join(f"{k}=" for k in sorted(FAULT_KEYS[kind])) or "no keys"
            raise FaultSpecError(f"{spec!r}: {part!r} is not valid for {kind} ({allowed}; once)")
        if key in vals:
            raise FaultSpecError(f"{spec!r}: {key} given twice")
        vals[key] = _fault_value(spec, key, val, world)
    missing = FAULT_REQUIRED[kind] - vals.keys()
    if missing:
        raise FaultSpecError(f"{spec!r}: {kind} needs {', '.join(sorted(missing))}")
    if "phase" in vals and vals["phase"] not in FAULT_PHASES[kind]:
        raise FaultSpecError(f"{spec!r}: phase={vals['phase']!r}: one of {', '.join(FAULT_PHASES[kind])}")
    if kind == "hang" and vals["phase"] == "serve" and vals["rank"] != 0:
        raise FaultSpecError(f"{spec!r}: phase=serve hangs the API's generation requests: rank=0 (the API's rank)")
    if kind == "hang" and "after" in vals and vals["phase"] != "serve":
        raise FaultSpecError(f"{spec!r}: after= is for phase=serve (a hang at {vals['phase']} is at once)")
    if "exit" in vals and "signal" in vals:
        raise FaultSpecError(f"{spec!r}: exit= and signal= exclude each other")
    return Fault(spec=spec, kind=kind, once=once, **vals)


def parse_faults(text: str | None, world: int | None = None) -> list[Fault]:
    return [parse_fault(s, world) for s in (text or "").split(";") if s.strip()]


def mark_fired(fault: Fault, state_dir: str) -> None:
    if fault.once:
        m = fault.marker(state_dir)
        m.parent.mkdir(parents=True, exist_ok=True)
        m.touch()
