"""custom: engine_custom_argv run as given, an engine llmfleet does not know (no flags to check, no API to probe)."""

from __future__ import annotations

from .base import Profile
from .sglang import PROFILE as _SGLANG
from .vllm import PROFILE as _VLLM

PROFILE = Profile(
    name="custom",
    engine="",
    label="custom",
    default_port=8000,
    # Either engine's serving line counts: a custom command is often one of them with other flags.
    serving_re=_VLLM.serving_re + "|" + _SGLANG.serving_re,
    # The key the way vLLM reads it (VLLM_API_KEY): the engine's own config may read it from there.
    secret_args=_VLLM.secret_args,
    api_known=False,
)
