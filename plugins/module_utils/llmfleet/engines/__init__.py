"""The engine profiles and their one registry: everything engine-specific (default port, command, help, loader
threads, start-up and serving lines, flag tables, the bench tool, the secret arguments) lives in one module per
engine here; the rest of the package asks `get(name)` instead of naming an engine. Adding an engine: one module
with its Profile, one line in PROFILES, one `choices` line in roles/engine/meta/argument_specs.yml (docs/engines.md).

Stdlib only, Python >= 3.8: it is shipped to nodes with the engine plan.
"""

from __future__ import annotations

import posixpath

from .base import Profile, ProfileError, Router
from .custom import PROFILE as CUSTOM
from .sglang import PROFILE as SGLANG
from .vllm import PD_PROFILE as VLLM_PD
from .vllm import PROFILE as VLLM
from .vllm import REGISTRY_SNIPPET as VLLM_REGISTRY_SNIPPET

__all__ = [
    "CUSTOM",
    "PROFILES",
    "SGLANG",
    "VLLM",
    "VLLM_PD",
    "VLLM_REGISTRY_SNIPPET",
    "Profile",
    "ProfileError",
    "Router",
    "UnknownProfile",
    "get",
    "names",
    "router",
]

# engine_profile -> its profile, in the order the docs and messages list them.
PROFILES = {p.name: p for p in (SGLANG, VLLM, VLLM_PD, CUSTOM)}
DEFAULT = SGLANG.name  # the engine role's engine_profile default


class UnknownProfile(ValueError):
    """A name that no profile has; the message lists the known ones."""


def names() -> tuple[str, ...]:
    return tuple(PROFILES)


def get(name: str | None) -> Profile:
    """The profile of engine_profile `name` (an engine name, e.g. the fit check's, is its own profile's)."""
    p = PROFILES.get(str(name or ""))
    if p is None:
        raise UnknownProfile(f"engine_profile={name!r}: choose one of {', '.join(PROFILES)}")
    return p


def engines() -> tuple[str, ...]:
    """The engines behind the profiles (the packages whose flags, logs and tools llmfleet knows), each once."""
    out: list[str] = []
    for p in PROFILES.values():
        if p.engine and p.engine not in out:
            out.append(p.engine)
    return tuple(out)


def engine(name: str | None) -> Profile:
    """The profile an engine's tables come from: `name` is an engine (sglang, vllm) or any of its profiles."""
    p = get(name)
    return get(p.engine) if p.engine and p.engine in PROFILES else p


def kind(name: str | None) -> str:
    """The engine behind a profile or an engine version string (`vllm 0.32.0`): '' when none is known."""
    text = str(name or "").lower()
    p = PROFILES.get(text)
    if p is not None:
        return p.engine
    return next((e for e in engines() if text.startswith(e)), "")


def router(name: str | None = None) -> Router:
    """The router of profile `name`; no name: the one profile that has a router (the role's router spec names
    none)."""
    p = get(name) if name else next((p for p in PROFILES.values() if p.router is not None), None)
    if p is None or p.router is None:
        raise UnknownProfile(f"engine_profile={name!r} runs no router")
    return p.router


def help_args(name: str) -> tuple[str, ...]:
    """How a profile's engine (or a profile's router, name 'router') prints every option."""
    if name == "router":
        return router().help_args
    p = PROFILES.get(name)
    return p.help_args if p is not None else ("--help",)


def bench_tool(name: str, command: list[str] | tuple[str, ...] = (), python: str = "") -> list[str]:
    """The engine's own serving benchmark as the engine role publishes it, from the engine's environment: beside
    engine_command's executable, or run by the engine's Python ([] for an engine without one)."""
    p = get(name)
    tool = list(p.bench_tool)
    if not tool:
        return []
    if p.bench_tool_from == "command" and command:
        tool[0] = f"{posixpath.dirname(str(command[0]))}/{tool[0]}"
    elif p.bench_tool_from == "python":
        tool[0] = python
    return tool
