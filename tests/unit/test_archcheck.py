"""llmfleet.engine.archcheck against the registries captured from vLLM 0.32.0 (its own ModelRegistry) and SGLang 0.5.23
(the EntryClass names of its models/ directory), and the AST capture on a synthetic models directory."""

import json

import pytest

from llmfleet.engine import archcheck as ac
from llmfleet.engine.archcheck import ArchCheckError


@pytest.mark.parametrize(("engine", "version", "count"), [("vllm", "0.32.0", 391), ("sglang", "0.5.23", 290)])
def test_captured_registries_say_where_they_came_from(engine, version, count):
    reg, warning = ac.load_registry(engine, version)
    assert warning is None and reg["engine"] == engine and reg["version"] == version
    assert reg["source"] and reg["method"] and reg["captured"] == "2026-12-01"
    archs = reg["architectures"]
    assert len(archs) == count and archs == sorted(set(archs))
    assert ac.captured(engine) == [version]


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
@pytest.mark.parametrize(
    "arch",
    [
        "GlmMoeDsaForCausalLM",  # GLM-5: the field's GLM-5.2 FP8 (golden engine-glm52-8xh20-*)
        "Qwen3_5MoeForCausalLM",  # the Qwen3.5 MoE text model: the Qwen3.8 class (golden engine-qwen38-4x8h20-*)
        "DeepseekV3ForCausalLM",
        "Qwen3NextForCausalLM",
        "LlamaForCausalLM",  # the lab's deterministic model (tests/helpers/det_model.py)
    ],
)
def test_field_and_lab_architectures_are_known(engine, arch):
    ok, msg = ac.supported(arch, engine, {"vllm": "0.32.0", "sglang": "0.5.23"}[engine])
    assert ok, msg
    assert (
        msg == f"{arch} is in {ac.ENGINE_NAMES[engine]} {'0.32.0' if engine == 'vllm' else '0.5.23'}'s model registry"
    )


def test_the_lab_checkpoint_config_is_known_to_vllm():
    """check_config on the det model's own config.json fields (what the lab's vLLM CPU serves)."""
    ok, msg = ac.check_config({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}, "vllm", "0.32.0+cpu")
    assert ok and "vLLM 0.32.0" in msg


def test_unknown_architecture_names_close_matches_and_the_fix():
    ok, msg = ac.supported("Glm5MoeDsaForCausalLM", "sglang", "0.5.23")
    assert not ok
    assert msg.startswith("Glm5MoeDsaForCausalLM is not in SGLang 0.5.23's model registry (290 architectures); close: ")
    assert "GlmMoeDsaForCausalLM" in msg.split("close: ")[1]
    assert "generic Transformers backend" in msg and "Fix: an engine version that lists Glm5MoeDsaForCausalLM" in msg


def test_no_close_match_says_none():
    ok, msg = ac.supported("Zzzzzzzzzzz", "vllm", "0.32.0")
    assert not ok and "close:" not in msg


def test_vllm_transformers_backend_archs_are_flagged():
    ok, msg = ac.supported("ArceeForCausalLM", "vllm", "0.32.0")  # registry.py maps it to the transformers module
    assert ok and "generic Transformers backend, not a native implementation" in msg
    ok, msg = ac.supported("LlamaForCausalLM", "vllm", "0.32.0")
    assert ok and "Transformers" not in msg


@pytest.mark.parametrize(
    ("engine", "version", "used", "warned"),
    [
        ("vllm", "0.32.0+cpu", "0.32.0", False),  # local version suffix: the same release
        ("vllm", "0.32", "0.32.0", False),
        ("vllm", "v0.32.0rc1", "0.32.0", False),
        ("vllm", "0.33.0", "0.32.0", True),  # newer than any capture: the newest below it
        ("vllm", "0.31.2", "0.32.0", True),  # older than any capture: the oldest
        ("sglang", "0.5.23.post1", "0.5.23", False),
        ("sglang", "0.5.9", "0.5.23", True),  # 0.5.9 < 0.5.23 numerically, not as text
    ],
)
def test_engine_versions_map_to_the_nearest_capture(engine, version, used, warned):
    reg, warning = ac.load_registry(engine, version)
    assert reg["version"] == used
    assert (warning is not None) == warned
    if warned:
        assert warning == (
            f"no registry captured for {ac.ENGINE_NAMES[engine]} {version}; checked against {used}, the nearest "
            f"captured (an architecture added or removed in between is not seen)"
        )
        ok, msg = ac.supported("LlamaForCausalLM", engine, version)
        assert ok and msg.startswith(warning + ": LlamaForCausalLM is in")


def test_nearest_prefers_the_newest_not_above():
    assert ac.nearest("0.33.1", ["0.31.0", "0.32.0", "0.34.0"]) == "0.32.0"
    assert ac.nearest("0.30.0", ["0.31.0", "0.32.0"]) == "0.31.0"


def test_bad_inputs_are_clear_errors(tmp_path):
    with pytest.raises(ArchCheckError, match="engine 'trtllm'"):
        ac.supported("X", "trtllm", "1.0")
    with pytest.raises(ArchCheckError, match=r"engine version 'latest': not a version number"):
        ac.supported("X", "vllm", "latest")
    with pytest.raises(ArchCheckError, match=f"no vLLM registry in {tmp_path}"):
        ac.supported("X", "vllm", "0.32.0", registry_dir=str(tmp_path))
    (tmp_path / "vllm-9.0.0.json").write_text("{not json")
    with pytest.raises(ArchCheckError, match=r"vllm-9\.0\.0\.json: cannot read the registry"):
        ac.supported("X", "vllm", "9.0.0", registry_dir=str(tmp_path))
    (tmp_path / "vllm-9.0.0.json").write_text("{}")
    with pytest.raises(ArchCheckError, match="no architectures list"):
        ac.supported("X", "vllm", "9.0.0", registry_dir=str(tmp_path))


def test_registry_dir_override(tmp_path):
    (tmp_path / "sglang-1.0.0.json").write_text(json.dumps({"version": "1.0.0", "architectures": ["FooForCausalLM"]}))
    assert ac.supported("FooForCausalLM", "sglang", "1.0.0", registry_dir=str(tmp_path))[0]
    assert not ac.supported("LlamaForCausalLM", "sglang", "1.0.0", registry_dir=str(tmp_path))[0]


@pytest.mark.parametrize("archs", [None, [], "LlamaForCausalLM", [1]])
def test_config_without_architectures(archs):
    ok, msg = ac.check_config({"architectures": archs} if archs is not None else {}, "vllm", "0.32.0")
    assert not ok and "config.json has no architectures list" in msg and "pinned revision" in msg


def test_sglang_capture_reads_entry_classes_like_the_registry(tmp_path):
    models = tmp_path / "models"
    models.mkdir()
    (models / "__init__.py").write_text("")
    (models / "one.py").write_text("class AForCausalLM:\n    pass\n\nEntryClass = AForCausalLM\n")
    (models / "many.py").write_text(
        "from .base import BaseForCausalLM as Base\n"
        "class BForCausalLM:\n    pass\n"
        "Alias = BForCausalLM\n"
        "EntryClass = [Alias, Base]\n"
    )
    (models / "none.py").write_text("class Helper:\n    pass\n")
    (models / "pkg").mkdir()  # packages are skipped, as registry.import_model_classes does
    (models / "pkg" / "__init__.py").write_text("class PkgModel: pass\nEntryClass = PkgModel\n")
    assert ac.sglang_entry_classes(str(models)) == ["AForCausalLM", "BForCausalLM", "BaseForCausalLM"]
    (models / "bad.py").write_text("EntryClass = make_class()\n")
    with pytest.raises(ValueError, match=r"bad\.py: EntryClass element .* is not a name"):
        ac.sglang_entry_classes(str(models))
    (models / "bad.py").write_text("EntryClass = Missing\n")
    with pytest.raises(ValueError, match=r"bad\.py: EntryClass names 'Missing', defined nowhere"):
        ac.sglang_entry_classes(str(models))


def test_capture_command_line(tmp_path, capsys):
    models = tmp_path / "m"
    models.mkdir()
    (models / "x.py").write_text("class XForCausalLM: pass\nEntryClass = XForCausalLM\n")
    assert ac.main(["sglang", str(models), "9.9.9", "test source"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["architectures"] == ["XForCausalLM"] and out["version"] == "9.9.9" and out["source"] == "test source"
    assert ac.main([]) == 2
    assert "ModelRegistry" in capsys.readouterr().err
