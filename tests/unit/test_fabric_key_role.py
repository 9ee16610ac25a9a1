"""The deployment's fabric key as the play makes it (roles/llmfleet/tasks/fabric_key.yml), on localhost through
ansible-playbook: root-only, kept across runs (a second run changes nothing), new on request, never in the output."""

from __future__ import annotations

import os
import re
import stat

import pytest

from tests.unit.test_engine_role import play

PLAY = """
- name: The fabric key
  hosts: all
  gather_facts: false
  tasks:
    - name: As the engine and staging roles include it
      ansible.builtin.include_role:
        name: llmfleet
        tasks_from: fabric_key.yml
"""

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="writes a root-owned credential")


def test_the_key_is_made_once_kept_rotated_on_request_and_never_shown(tmp_path):
    conf = tmp_path / "etc"
    key = conf / "credentials" / "demo.fabric-key"

    def converge(**extra):
        rc, out, _ = play(tmp_path, PLAY, llmfleet_config_dir=str(conf), **extra)
        assert rc == 0, out[-3000:]
        return out

    out = converge()
    first = key.read_text()
    st = key.stat()
    assert re.fullmatch(r"[A-Za-z0-9]{64}", first) and st.st_uid == 0 and stat.S_IMODE(st.st_mode) == 0o600
    assert stat.S_IMODE(key.parent.stat().st_mode) == 0o700
    assert first not in out
    out = converge()
    assert key.read_text() == first and re.search(r"changed=0\s", out), out[-2000:]
    out = converge(llmfleet_fabric_key_rotate=True)
    assert key.read_text() != first and key.read_text() not in out
    assert re.search(r"changed=1\s", out), out[-2000:]
