"""The deployment report's speculative-decoding section (report_sections.speculative) from the engine record's
`speculative` key, as tasks/0030-ready.yml writes it ({config, enabled}) plus `measured` when the engine's
/metrics was read (specdecode.parse_metrics; the metric text is the constructed vLLM one of test_specdecode)."""

from llmfleet.engine import specdecode
from llmfleet.report import sections as rs
from tests.unit.test_specdecode import VLLM_METRICS

EAGLE = {
    "method": "eagle3",
    "num_steps": 3,
    "topk": None,
    "num_draft_tokens": None,
    "draft_model_path": "/m/e/" + "e" * 40,
}


def test_no_setting_is_off_and_passes():
    """Off answers the section's question (nothing is missing): a full run without it has no not-run section."""
    for rec in ({}, {"speculative": None}, {"speculative": {"config": {"method": None}, "enabled": True}}):
        sec = rs.speculative(rec)
        assert sec["status"] == "pass" and sec["summary"].startswith("off (engine_speculative is not set")


def test_configured_and_measured_says_whether_it_pays():
    sec = rs.speculative({"speculative": {"config": EAGLE, "enabled": True,
                                          "measured": specdecode.parse_metrics(VLLM_METRICS)}})  # fmt: skip
    assert sec["status"] == "pass" and sec["verdict"]["verdict"] == "pays"
    assert sec["summary"].startswith(f"on: eagle3, 3 draft token(s) per step, draft {EAGLE['draft_model_path']}; pays:")
    assert sec["config"] == {k: v for k, v in EAGLE.items() if v is not None}


def test_a_draft_that_does_not_pay_is_a_warning():
    measured = {"engine": "sglang", "mean_accepted_length": 1.05, "acceptance_rate": 0.02}
    sec = rs.speculative({"speculative": {"config": EAGLE, "enabled": True, "measured": measured}})
    assert sec["status"] == "warn" and "does not pay" in sec["summary"]


def test_configured_but_switched_off_and_not_measured():
    off = rs.speculative({"speculative": {"config": EAGLE, "enabled": False}})
    assert off["status"] == "warn" and "engine_speculative_enabled is false" in off["summary"]
    on = rs.speculative({"speculative": {"config": EAGLE, "enabled": True}})
    assert on["status"] == "pass" and on["summary"].endswith("acceptance not measured in this record")
