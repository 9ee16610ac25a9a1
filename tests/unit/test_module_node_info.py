"""library/llmfleet_node_info.py run in-process, importing ansible.module_utils.llmfleet."""

import pytest

import llmfleet
import llmfleet_node_info
from tests.unit.module_utils import AnsibleExitJson, set_module_args


def test_reports_node_and_changes_nothing(module_exits, tmp_path):
    with (
        set_module_args({"nvme_path": str(tmp_path), "shared_path": "/nonexistent-shared"}),
        pytest.raises(AnsibleExitJson) as e,
    ):
        llmfleet_node_info.main()
    result = e.value.args[0]
    assert result["changed"] is False
    node = result["node"]
    assert node["llmfleet_version"] == llmfleet.__version__
    assert node["nvme"]["path"] == str(tmp_path) and node["nvme"]["present"]
    assert node["shared"] == {"path": "/nonexistent-shared", "mounted": False, "read_only": False}


def test_module_uses_the_module_utils_name():
    assert llmfleet_node_info.gather.__module__ == "ansible.module_utils.llmfleet.nodeinfo"


def test_check_mode_supported(module_exits):
    with set_module_args({"_ansible_check_mode": True}), pytest.raises(AnsibleExitJson) as e:
        llmfleet_node_info.main()
    assert e.value.args[0]["changed"] is False
