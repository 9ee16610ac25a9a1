"""Documentation fragment: the detach option of a module whose work can run as a detached job that
M(llmfleet.fleet.llmfleet_job_wait) waits for (the roles' way instead of C(async)/C(poll=0)).
Ansible has no fragments for RETURN: each such module lists the job's keys in its own RETURN."""

from __future__ import annotations


class ModuleDocFragment:
    DOCUMENTATION = r"""
---
options:
  detach:
    description:
      - Return at once with a job id (C(ansible_job_id), C(results_file), C(started), C(finished=false)) for
        M(llmfleet.fleet.llmfleet_job_wait); the work runs in a detached process whose job file (async_wrapper's format) then holds
        this module's result - what C(async)/C(poll=0) does, in one round trip per node instead of async's start-up
        (a temporary directory, two file copies, one more module run).
      - Check mode never detaches.
    type: bool
    default: false
"""
