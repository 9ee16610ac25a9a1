#!/usr/bin/python
"""Documentation stub of the llmfleet_model_stage_wait action plugin (action_plugins/): ansible-doc and
ansible-lint find the documentation of an action here, in a module of the same name. The action runs
on the controller; this file is never sent to a node."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: llmfleet_model_stage_wait
short_description: Wait for an async llmfleet_model_stage job and show its progress
description:
  - Polls the async job I(jid) of M(llmfleet_model_stage) with C(async_status) and, between polls, reads the
    job's progress JSON (I(progress_path)) on the node and prints one line per node - bytes done / total,
    rate, bytes from shared storage and from peers - instead of one line at the end.
  - When the job has finished, cleans up its async status file and returns the job's result.
  - Fails after I(timeout) seconds naming the last progress. The job goes on on the node until its async limit
    and holds the model's staging lock, so a rerun while it runs waits for it (up to
    C(model_stage_lock_wait)) or fails naming it; once it has ended, a rerun resumes from its verified files.
  - An action plugin (C(action_plugins/llmfleet_model_stage_wait.py)); this module file only documents it.
options:
  jid:
    description: The async job id of M(llmfleet_model_stage) (C(ansible_job_id) of its registered result).
    type: str
    required: true
  progress_path:
    description: The job's progress JSON on the node (I(progress_path) of M(llmfleet_model_stage)).
    type: path
    required: true
  timeout:
    description: Seconds before giving up (partial work is kept for a rerun).
    type: int
    default: 21600
  interval:
    description: Seconds between progress lines.
    type: float
    default: 5
attributes:
  action:
    description: Indicates this has a corresponding action plugin so some parts of the options can be executed on the controller.
    support: full
  async:
    description: Supports being used with the C(async) keyword.
    support: none
  check_mode:
    description: Can run in check_mode and return changed status prediction without modifying target.
    support: full
    details: Only reads the job's status and progress file; the async status file is removed once the job has finished.
  diff_mode:
    description: Will return details on what has changed (or possibly needs changing in --diff mode).
    support: none
author: llmfleet developers
"""

EXAMPLES = r"""
- name: Start staging on every node
  llmfleet_model_stage:
    source: /mnt/shared/models--Qwen--Qwen3.8
    manifest_path: /mnt/shared/.llmfleet/manifests/qwen3.8/d2dc35658bcf77e66643428cb52e774cc3b5bd29.json
    model: qwen3.8
    revision: d2dc35658bcf77e66643428cb52e774cc3b5bd29
    lease_dir: /mnt/shared/.llmfleet/leases
    me: "{{ inventory_hostname }}"
    progress_path: /var/lib/llmfleet/stage-progress.json
  async: 21600
  poll: 0
  register: _stage_job

- name: Wait for staging, showing progress
  llmfleet_model_stage_wait:
    jid: "{{ _stage_job.ansible_job_id }}"
    progress_path: /var/lib/llmfleet/stage-progress.json
  register: _stage_result
"""

RETURN = r"""
changed:
  description: The staging job changed the node (copied, published, switched C(current) or removed old revisions).
  returned: always
  type: bool
revision:
  description: The staged revision.
  returned: success
  type: str
path:
  description: Published revision directory.
  returned: success
  type: str
state_before:
  description: What the node had of the revision before the job - C(absent), C(partial), C(published) or C(damaged).
  returned: success
  type: str
total_bytes:
  description: Bytes in the revision.
  returned: success
  type: int
bytes_to_copy:
  description: Bytes that had to be copied at start.
  returned: success
  type: int
files_to_copy:
  description: Files that had to be copied at start.
  returned: success
  type: int
bytes_copied:
  description: Bytes written on this node.
  returned: success
  type: int
source_bytes_read:
  description: Bytes this node read from shared storage.
  returned: success
  type: int
peer_bytes_read:
  description: Bytes this node fetched from peers.
  returned: success
  type: int
served_bytes:
  description: Bytes this node served to peers.
  returned: success
  type: int
reader_intervals:
  description: C([start, end]) epoch seconds of this node's shared-storage reading.
  returned: success
  type: list
  elements: list
source_fallback_files:
  description: Files read from shared storage because no peer had them in time.
  returned: success
  type: list
  elements: str
seed:
  description: This node was a seed (read part of the files from shared storage).
  returned: success
  type: bool
assigned_files:
  description: Files assigned to this node to read from shared storage.
  returned: success
  type: int
gc:
  description: >-
    What garbage collection deleted and kept after publishing (C(removed), C(removed_partials), C(kept) with why,
    C(kept_in_use), C(skipped)); a deletion makes the task changed.
  returned: success
  type: dict
"""
