"""Run Ansible modules in-process (the community.general tests/unit/plugins/modules/utils.py pattern)."""

from __future__ import annotations

import contextlib

import pytest
from ansible.module_utils import basic
from ansible.module_utils.testing import patch_module_args


class AnsibleExitJson(Exception):
    """exit_json was called: args[0] holds the result."""


class AnsibleFailJson(Exception):
    """fail_json was called: args[0] holds the result."""


def _exit_json(self, **kwargs):
    kwargs.setdefault("changed", False)
    raise AnsibleExitJson(kwargs)


def _fail_json(self, msg, **kwargs):
    kwargs.update(failed=True, msg=msg)
    raise AnsibleFailJson(kwargs)


@pytest.fixture
def module_exits(monkeypatch):
    monkeypatch.setattr(basic.AnsibleModule, "exit_json", _exit_json)
    monkeypatch.setattr(basic.AnsibleModule, "fail_json", _fail_json)


@contextlib.contextmanager
def set_module_args(args: dict):
    with patch_module_args(args):
        yield
