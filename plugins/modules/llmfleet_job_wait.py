#!/usr/bin/python
"""Documentation stub of the llmfleet_job_wait action plugin (action_plugins/): ansible-doc and ansible-lint
find the documentation of an action here, in a module of the same name. The action runs on the controller;
this file is never sent to a node."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: llmfleet_job_wait
short_description: Wait for an async llmfleet job, printing progress instead of retries
description:
  - Waits for the async job I(jid) to finish, then cleans up its async status file and returns the job's
    own result (without the async bookkeeping keys). The waiting is done on the node - a shell loop that looks at
    the job's status file every I(poll) seconds and returns as soon as it no longer says running, or when the next
    progress line is due - so a finished job is seen within I(poll) with one SSH round trip per progress line, not
    per look. The status file is read as C(async_status) reads it, and a finished job's result is taken from it as
    the module runner would parse it, then the file is removed with C(rm); the C(async_status) module, a Python
    start-up on the node, runs only for a status file that is missing or holds no result (it says why).
  - While the job runs, prints one line per node every I(interval) seconds - from the job's progress JSON on
    the node when I(progress_path) is given (staging - bytes done / total, rate, shared storage vs peers; the
    engine gate - each node's unit and start-up phase, the API), else how long it has been running. No
    C(FAILED - RETRYING) lines, and the standard stdout callbacks keep working.
  - Fails after I(timeout) seconds naming the last progress; the job itself goes on on the node until its
    async limit.
  - An action plugin (C(action_plugins/llmfleet_job_wait.py)); this module file only documents it.
extends_documentation_fragment:
  - llmfleet.fleet.llmfleet_check_mode
  - llmfleet.fleet.llmfleet_action
  - llmfleet.fleet.llmfleet_no_diff
options:
  jid:
    description: The async job id (C(ansible_job_id) of the job task's registered result).
    type: str
    required: true
  results_file:
    description: >-
      The job's status file on the node, as the task that started it returned it (C(results_file)) - for a job a module
      detached itself (M(llmfleet.fleet.llmfleet_nccl_check) with C(detach=true)); without it, I(jid) in the async directory.
    type: str
  what:
    description: What the job does, for the progress and timeout lines (e.g. C(single-node NCCL worlds)).
    type: str
    required: true
  progress_path:
    description: >-
      The job's progress JSON where the job runs (the node; the ops host for a job delegated there), read
      between polls. Without it, the lines only say how long the job has been running.
    type: path
  progress:
    description: >-
      How to read I(progress_path) - C(stage) (M(llmfleet.fleet.llmfleet_model_stage)'s progress), C(gate)
      (M(llmfleet.fleet.llmfleet_engine_ready)'s progress) - or C(none) (no progress file).
    type: str
    default: none
    choices: [none, stage, gate]
  timeout:
    description: Seconds before giving up waiting (the job goes on until its own async limit).
    type: int
    default: 21600
  interval:
    description: Seconds between progress lines.
    type: float
    default: 5
  poll:
    description: Seconds (> 0) between two looks at the job's status file, on the node; a finished job is seen within it.
    type: float
    default: 0.25
  timeout_hint:
    description: Appended to the timeout message - what the running job keeps and how a rerun behaves.
    type: str
    default: ""
attributes:
  check_mode:
    support: full
    details: Only reads the job's status and progress file; the async status file is removed once the job has finished.
author: llmfleet developers (@llmfleet)
"""

EXAMPLES = r"""
# _stage_job: what llmfleet_model_stage with detach=true registered (its EXAMPLES start it).
- name: Wait for staging, showing progress
  llmfleet.fleet.llmfleet_job_wait:
    jid: "{{ _stage_job.ansible_job_id }}"
    results_file: "{{ _stage_job.results_file }}"
    what: staging
    progress_path: /var/lib/llmfleet/stage-progress.json
    progress: stage
    timeout: 21600
  register: _stage_result
"""

RETURN = r"""
changed:
  description: What the job returned as C(changed).
  returned: always
  type: bool
"""
