#!/usr/bin/python
"""Ansible module (run on the head node): after the readiness gate, send the engine the shapes its traffic
will bring (input lengths x concurrencies) so the first users do not pay its JIT compilation, and time it."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: llmfleet_engine_warmup
short_description: Warm a ready engine over an input-length x concurrency matrix and time it
description:
  - Sends, for every input length in I(lengths) crossed with every value in I(concurrency), that many streaming
    chat completions at once, I(rounds) times, each with I(max_tokens) output tokens (EOS ignored), and records
    per cell the time to first token (p50 and max), the total time, errors and the wall time; for the run its
    start, end and duration.
  - Prompts are sized with the engine's C(POST /tokenize) (vLLM, SGLang), else by 4 characters a token, and every
    request has its own number in its first sentence, so the prefix cache cannot answer a warm-up request from an
    earlier one.
  - Asks C(GET /v1/models) first (the model must be listed); a length that does not fit the served
    C(max_model_len) with I(max_tokens) fails its cell without being sent.
  - Every request ends by I(timeout), the whole run by I(deadline); a request error or deadline fails its cell,
    and the module fails naming the cells unless I(fail_on_error=false).
  - Meant to run on the head node against the engine's local endpoint (the role's C(node_url)), after
    M(llmfleet.fleet.llmfleet_engine_ready); stdlib only. See docs/warmup.md.
  - C(changed) is always false - nothing the role manages changes (only the engine's in-memory caches).
extends_documentation_fragment:
  - llmfleet.fleet.llmfleet_check_mode
  - llmfleet.fleet.llmfleet_no_diff
options:
  api_base:
    description: The API root as this host reaches it, e.g. C(http://127.0.0.1:8000) (a trailing C(/v1) is fine).
    type: str
    required: true
  model:
    description: Served model name, as C(/v1/models) lists it.
    type: str
    required: true
  api_key:
    description: API key sent as a bearer token (no_log - never logged).
    type: str
  lengths:
    description:
      - Input lengths in tokens (each 64 .. 1048576), crossed with I(concurrency) in the order given.
      - An empty list turns the warm-up off - nothing is sent and C(skipped=true) is returned.
    type: list
    elements: int
    required: true
  concurrency:
    description: Requests sent at once per cell (each 1 .. 512).
    type: list
    elements: int
    default: [1]
  max_tokens:
    description: Output tokens per request (kept small - the prompt's prefill is what is warmed; EOS is ignored).
    type: int
    default: 8
  rounds:
    description: Rounds per cell (1 .. 100). With 2 or more the result compares the first round's TTFT with the last's.
    type: int
    default: 1
  timeout:
    description: Seconds one request may take, whole (the first request at a new shape can take long).
    type: float
    default: 120
  deadline:
    description: Seconds the whole warm-up may take; cells not reached by then are C(not-run) and fail the run.
    type: float
    default: 900
  fail_on_error:
    description: Fail the task when a cell (or C(/v1/models)) failed; false returns the same result as a success.
    type: bool
    default: true
attributes:
  check_mode:
    support: partial
    details: In check mode nothing is sent; the module returns C(skipped_in_check_mode=true) and the C(planned) cells.
author: llmfleet developers (@llmfleet)
"""

EXAMPLES = r"""
- name: Warm the engine over the shapes its traffic brings (on the head, against its own port)
  llmfleet.fleet.llmfleet_engine_warmup:
    api_base: http://127.0.0.1:8000
    model: qwen
    api_key: "{{ llmfleet_api_key }}"
    lengths: [128, 2048, 8192]
    concurrency: [1, 8]
    max_tokens: 8
    rounds: 1
  register: warmup

- name: Show the warm-up table
  ansible.builtin.debug:
    msg: "{{ warmup.table }}"
"""

RETURN = r"""
ok:
  description: Every cell was warmed without an error.
  returned: when it ran
  type: bool
summary:
  description: One line - C(WARMED UP ...) or C(WARM-UP FAILED (cells) ...), cells ok, requests and seconds.
  returned: when it ran
  type: str
table:
  description: The result as a table for people, one line per cell (failures with why and fix indented below).
  returned: when it ran
  type: list
  elements: str
schema:
  description: C(llmfleet.warmup/1).
  returned: when it ran
  type: str
url:
  description: The API root asked (no credentials).
  returned: when it ran
  type: str
model:
  description: The served model name.
  returned: when it ran
  type: str
settings:
  description: The matrix and limits used (lengths, concurrency, max_tokens, rounds, timeout, deadline).
  returned: when it ran
  type: dict
started_at:
  description: UTC start, ISO 8601.
  returned: when it ran
  type: str
ended_at:
  description: UTC end, ISO 8601.
  returned: when it ran
  type: str
wall_s:
  description: Seconds the warm-up took, sizing and preflight included.
  returned: when it ran
  type: float
preflight:
  description: C({ok, why, fix, max_model_len, seconds}) of C(GET /v1/models).
  returned: when it ran
  type: dict
sizing:
  description: C({method, lengths}) - how prompts were sized (C(tokenize), C(tokenize-text), C(approximate)) and per length the measured tokens and seconds.
  returned: when it ran
  type: dict
failed_cells:
  description: The failed cells as C(INPUTxCONCURRENCY) (and C(preflight) when /v1/models failed).
  returned: when it ran
  type: list
  elements: str
cells:
  description:
    - One per cell, in the order sent - C(input_len), C(concurrency), C(status) (C(ok), C(failed), C(not-run)), C(why), C(fix),
      C(prompt_tokens) (as sized), C(usage_prompt_tokens) (C([min, max]) the engine reported), C(requests), C(errors),
      C(error_samples), C(wall_s), C(ttft_ms_p50), C(ttft_ms_max), C(e2e_ms_p50), C(e2e_ms_max) and C(rounds)
      (per round C(wall_s), C(ttft_ms_p50), C(ttft_ms_max), C(ttft_ms) per request, C(errors)).
    - With 2 or more rounds also C(first_round_ttft_ms_p50) and C(last_round_ttft_ms_p50) - the first round's cost.
  returned: when it ran
  type: list
  elements: dict
skipped:
  description: Nothing was sent because I(lengths) is empty (the warm-up is off).
  returned: when lengths is empty
  type: bool
skipped_in_check_mode:
  description: Nothing was sent because of check mode.
  returned: check mode
  type: bool
planned:
  description: The cells that would be sent, C({input_len, concurrency}) each, in order.
  returned: check mode
  type: list
  elements: dict
"""

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.llmfleet.fleet.plugins.module_utils.llmfleet.accept.warmup import (
    DEFAULTS,
    WarmupError,
    cells_of,
    check_settings,
    render_table,
    warmup,
)

# The engine role's variable behind each option, named in the failure message.
ROLE_VARS = {
    "lengths": "engine_warmup_lengths",
    "concurrency": "engine_warmup_concurrency",
    "max_tokens": "engine_warmup_max_tokens",
    "rounds": "engine_warmup_rounds",
    "timeout": "engine_warmup_timeout",
    "deadline": "engine_warmup_deadline",
}


def argument_spec() -> dict:
    """The options (a fresh dict each call: AnsibleModule stores defaults by reference)."""
    return {
        "api_base": {"type": "str", "required": True},
        "model": {"type": "str", "required": True},
        "api_key": {"type": "str", "no_log": True},
        "lengths": {"type": "list", "elements": "int", "required": True},
        "concurrency": {"type": "list", "elements": "int", "default": [1]},
        "max_tokens": {"type": "int", "default": DEFAULTS["max_tokens"], "no_log": False},  # a count, not a secret
        "rounds": {"type": "int", "default": DEFAULTS["rounds"]},
        "timeout": {"type": "float", "default": DEFAULTS["timeout"]},
        "deadline": {"type": "float", "default": DEFAULTS["deadline"]},
        "fail_on_error": {"type": "bool", "default": True},
    }


def build_module() -> AnsibleModule:
    return AnsibleModule(argument_spec=argument_spec(), supports_check_mode=True)


def run(module: AnsibleModule) -> None:
    p = module.params
    if not p["lengths"]:
        module.exit_json(changed=False, skipped=True, msg="lengths is empty: the warm-up is off, nothing sent")
    try:
        settings = check_settings(p["api_base"], p["lengths"], p["concurrency"], p["max_tokens"], p["rounds"],
                                  p["timeout"], p["deadline"])  # fmt: skip
    except WarmupError as e:
        option = "api_base" if e.option == "url" else e.option
        role = f" (set by the role variable {ROLE_VARS[option]})" if option in ROLE_VARS else ""
        module.fail_json(msg=f"{option}{role}: {e}")
    if module.check_mode:
        planned = cells_of(settings["lengths"], settings["concurrency"])
        module.exit_json(changed=False, skipped_in_check_mode=True, planned=planned,
                         msg=f"check mode: nothing sent; would warm {len(planned)} cell(s) at {p['api_base']}")  # fmt: skip
    res = warmup(p["api_base"], p["model"], settings, api_key=p["api_key"] or None)
    res["table"] = render_table(res)
    if res["ok"] or not p["fail_on_error"]:
        module.exit_json(changed=False, **res)
    module.fail_json(msg=res["summary"], **res)


def main() -> None:
    run(build_module())


if __name__ == "__main__":
    main()
