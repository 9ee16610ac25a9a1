"""library/ modules refuse out-of-range and malformed options with fail_json naming the option and the
role variable behind it, never a traceback (run in-process, as community.general tests do)."""

import json

import pytest

import llmfleet_model_manifest
import llmfleet_model_stage
import llmfleet_topology_facts
from tests.unit.module_utils import AnsibleExitJson, AnsibleFailJson, set_module_args

REV = "c" * 40


def stage_args(tmp_path, **over):
    return {"source": str(tmp_path), "model": "m", "revision": REV, "root": str(tmp_path / "nvme"),
            "lease_dir": str(tmp_path / "leases"), "me": "node1", **over}  # fmt: skip


def manifest_args(tmp_path, **over):
    return {"source": str(tmp_path), "model": "m", "revision": REV, "cache_dir": str(tmp_path / "cache"),
            "lease_dir": str(tmp_path / "leases"), **over}  # fmt: skip


OUT_OF_RANGE = [
    # (module, option, value, text in msg)
    (llmfleet_model_stage, "max_source_readers", 0, "max_source_readers=0 is out of range (set by the role variable model_stage_max_source_readers): it must be >= 1"),
    (llmfleet_model_stage, "max_source_readers", -2, "model_stage_max_source_readers"),
    (llmfleet_model_stage, "threads", 0, "threads=0 is out of range (set by the role variable model_stage_threads): it must be >= 1"),
    (llmfleet_model_stage, "keep", 0, "keep=0 is out of range (set by the role variable model_stage_keep)"),
    (llmfleet_model_stage, "keep", -1, "keep=-1"),
    (llmfleet_model_stage, "free_space_margin_bytes", -1, "model_stage_free_space_margin_gb"),
    (llmfleet_model_stage, "serve_port", 70000, "serve_port=70000 is out of range (set by the role variable model_stage_peer_port): it must be between 0 and 65535"),
    (llmfleet_model_stage, "rate_limit_bytes_per_s", -5, "model_stage_rate_limit_mib_s"),
    (llmfleet_model_stage, "lease_ttl", 0, "lease_ttl=0.0 is out of range: it must be >= 1"),
    (llmfleet_model_stage, "finish_wait", -1, "model_stage_timeout"),
    (llmfleet_model_manifest, "max_source_readers", 0, "max_source_readers=0 is out of range (set by the role variable model_stage_max_source_readers): it must be >= 1"),
    (llmfleet_model_manifest, "threads", -1, "model_stage_threads"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("module", "option", "value", "text"), OUT_OF_RANGE, ids=lambda v: getattr(v, "__name__", str(v))
)
@pytest.mark.parametrize("check_mode", [True, False], ids=["check", "run"])
def test_out_of_range_options_fail_early_naming_the_variable(
    module_exits, tmp_path, module, option, value, text, check_mode
):
    args = (stage_args if module is llmfleet_model_stage else manifest_args)(tmp_path, **{option: value})
    with set_module_args({**args, "_ansible_check_mode": check_mode}), pytest.raises(AnsibleFailJson) as e:
        module.main()
    assert text in e.value.args[0]["msg"]
    assert not (tmp_path / "nvme").exists() and not (tmp_path / "leases").exists()  # failed before touching anything


def test_model_stage_malformed_manifest_is_a_failure_not_a_traceback(module_exits, tmp_path):
    bad = tmp_path / "m.json"
    bad.write_text(
        json.dumps({"format": "llmfleet-manifest/1", "files": [{"path": "../x", "size": 1, "sha256": "0" * 64}]})
    )
    with set_module_args(stage_args(tmp_path, manifest_path=str(bad))), pytest.raises(AnsibleFailJson) as e:
        llmfleet_model_stage.main()
    assert "leaves the revision directory" in e.value.args[0]["msg"] and "node1" in e.value.args[0]["msg"]


FABRIC_BAD = [
    ({"overrides": {"NCCL_IB_GID_INDEX": "three"}}, "override NCCL_IB_GID_INDEX=three: not a GID table index (a whole number >= 0, e.g. 3) (fix topology_overrides)"),
    ({"overrides": {"NCCL_IB_HCA": "mlx5_0:x"}}, "is not HCA[:PORT]"),
    ({"overrides": {"NCCL_IB_HCA": "mlx5_0:1"}}, "mlx5_0:1 does not exist here (have: none) (fix topology_overrides)"),
    ({"overrides": {"NCCL DEBUG": "INFO"}}, "override 'NCCL DEBUG': not an environment variable name"),
    ({"extra_env": {"NCCL_NVLS_ENABLE": "0\nX=1"}}, "extra variable NCCL_NVLS_ENABLE: the value holds a line break or NUL; give a one-line value (fix topology_extra_env)"),
]  # fmt: skip


@pytest.mark.parametrize(("args", "text"), FABRIC_BAD)
def test_llmfleet_topology_facts_refuses_malformed_overrides(module_exits, tmp_path, args, text):
    with set_module_args({"sysfs_root": str(tmp_path), "use_nvml": False, **args}), pytest.raises(AnsibleFailJson) as e:
        llmfleet_topology_facts.main()
    assert text in e.value.args[0]["msg"]


def test_llmfleet_topology_facts_in_range_still_works(module_exits, tmp_path):
    with set_module_args({"sysfs_root": str(tmp_path), "use_nvml": False, "extra_env": {"NCCL_NVLS_ENABLE": 0}}), \
            pytest.raises(AnsibleExitJson) as e:  # fmt: skip
        llmfleet_topology_facts.main()
    assert e.value.args[0]["env"]["NCCL_NVLS_ENABLE"] == "0"
