#!/usr/bin/python
"""Documentation stub of the llmfleet_record action plugin (action_plugins/): ansible-doc and ansible-lint
find the documentation of an action here, in a module of the same name. The action runs on the controller;
this file is never sent to a node."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: llmfleet_record
short_description: Write one JSON record of this run into the report directory on the ops host
description:
  - Writes I(content) as JSON (sorted keys, indented like C(to_nice_json)) to I(dir)/I(name) on the ops host,
    creating I(dir) (mode 0755) when it is missing. The file is written to a private temporary name in I(dir) and
    renamed over the old one, so a reader never sees half a record; unchanged text and mode is not rewritten.
  - A mapping written during a run carries the run's id as C(run_id) (C(llmfleet_run_id), made once by
    C(playbooks/run_start.yml)); the deployment report reads the newest run's records only.
  - Runs in the controller's own process (no module start-up), whatever host the task runs for; use it with
    C(run_once) for a record of the whole play.
  - An action plugin (C(action_plugins/llmfleet_record.py)); this module file only documents it.
extends_documentation_fragment:
  - llmfleet.fleet.llmfleet_check_mode
  - llmfleet.fleet.llmfleet_action
  - llmfleet.fleet.llmfleet_no_diff
options:
  dir:
    description: The report directory on the ops host (usually C(llmfleet_report_dir)).
    type: path
    required: true
  name:
    description: The record's file name inside I(dir), without a directory (e.g. C(topology.json)).
    type: str
    required: true
  content:
    description: The record, any JSON-serializable data (a mapping when I(stamp) is true).
    type: raw
    required: true
  stamp:
    description: Add C(generated_at), the current UTC time as C(YYYY-MM-DDTHH:MM:SSZ), to the record.
    type: bool
    default: false
  mode:
    description: The file's mode, octal.
    type: raw
    default: "0644"
attributes:
  check_mode:
    support: full
    details: Says whether the record would change and writes nothing (tasks that keep their record in check mode set C(check_mode=false)).
author: llmfleet developers (@llmfleet)
"""

EXAMPLES = r"""
- name: Write topology.json on the ops host
  llmfleet.fleet.llmfleet_record:
    dir: "{{ llmfleet_report_dir }}"
    name: topology.json
    content:
      nodes: "{{ dict(ansible_play_hosts | zip(ansible_play_hosts | map('extract', hostvars, ['ansible_facts', 'llmfleet_topology']))) }}"
    stamp: true
  run_once: true
  changed_when: false
"""

RETURN = r"""
path:
  description: The record's path on the ops host.
  returned: always
  type: str
"""
