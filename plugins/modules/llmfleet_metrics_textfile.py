#!/usr/bin/python
"""Ansible module: write one Prometheus text file for node_exporter's textfile collector on this node."""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: llmfleet_metrics_textfile
short_description: Write llmfleet's metrics of one source as a Prometheus text file for node_exporter
description:
  - Builds the metrics of one I(source) from the I(record) a role already has (a module's registered result or a
    report), adds the constant I(labels) and I(node), renders them in the Prometheus text exposition format 0.0.4
    and writes I(directory)/I(name) atomically (a hidden temporary file in the same directory, fsynced, mode 0644,
    renamed over the target). docs/metrics.md lists every metric.
  - C(changed) when the new content differs from the file there, byte for byte; nothing is ignored, so a metric
    whose value moved (a timestamp, a measured bandwidth) is a change. Staging and readiness metrics are written
    so that a rerun that changed nothing writes the same file; measurements (collective check, acceptance, bench)
    differ on every run.
  - Refuses a target that is a symlink or not a regular file, and a missing I(directory) unless I(create).
extends_documentation_fragment:
  - llmfleet.fleet.llmfleet_check_mode
options:
  directory:
    description:
      - The directory node_exporter's textfile collector reads (C(--collector.textfile.directory)); the role
        variable C(llmfleet_metrics_dir).
    type: path
    required: true
  name:
    description: File name in I(directory); must end in C(.prom) (the collector reads only C(*.prom)).
    type: str
    required: true
  source:
    description:
      - What I(record) is - C(stage) (one node's M(llmfleet.fleet.llmfleet_model_stage) result), C(nccl_check) (the
        C(llmfleet_nccl_verdict) result with this node's rank results beside it), C(engine_ready) (the
        M(llmfleet.fleet.llmfleet_engine_ready) result, or the registered loop of them), C(acceptance) (the C(llmfleet accept
        --json) report), C(bench) (the C(llmfleet bench) results.json).
    type: str
    choices: [stage, nccl_check, engine_ready, acceptance, bench]
    required: true
  record:
    description: The record of I(source).
    type: dict
    required: true
  labels:
    description:
      - Constant labels added to every sample (low-cardinality, e.g. C(deployment)); C(model) and C(revision) here
        name a failed staging run's revision, whose result names neither.
    type: dict
    default: {}
  node:
    description:
      - This node's inventory name; added as the label C(node), and how C(nccl_check) and C(engine_ready) find
        this node in a fleet-wide record (required for those two).
    type: str
    default: ""
  create:
    description:
      - Create I(directory) (mode 0755, never its parents) when it is missing. Off by default, so that a mistyped
        directory fails instead of filling a directory nobody scrapes.
    type: bool
    default: false
attributes:
  check_mode:
    support: full
    details: Builds the file and compares it with the one there; writes nothing and creates no directory.
  diff_mode:
    support: full
    details: The old and the new file content.
author: llmfleet developers (@llmfleet)
"""

EXAMPLES = r"""
- name: Staging metrics for node_exporter
  llmfleet.fleet.llmfleet_metrics_textfile:
    directory: /var/lib/node_exporter/textfile_collector
    name: llmfleet_stage_qwen3.8.prom
    source: stage
    record: "{{ _model_stage_result }}"
    labels:
      deployment: qwen38
      model: qwen3.8
      revision: d2dc35658bcf77e66643428cb52e774cc3b5bd29
    node: "{{ inventory_hostname }}"
"""

RETURN = r"""
path:
  description: The metrics file.
  returned: always
  type: str
created:
  description: The directory was created (would be, in check mode).
  returned: always
  type: bool
families:
  description: Metric names in the file.
  returned: always
  type: list
  elements: str
series:
  description: Samples in the file.
  returned: always
  type: int
diff:
  description: C(before) and C(after), the old (empty when there was none) and the new file content.
  returned: in diff mode
  type: dict
"""

from ansible.module_utils.basic import AnsibleModule

from ansible_collections.llmfleet.fleet.plugins.module_utils.llmfleet.metrics import SOURCES, textfile


def argument_spec() -> dict:
    """The options (a fresh dict each call: AnsibleModule stores defaults by reference)."""
    return {
        "directory": {"type": "path", "required": True},
        "name": {"type": "str", "required": True},
        "source": {"type": "str", "choices": list(SOURCES), "required": True},
        "record": {"type": "dict", "required": True},
        "labels": {"type": "dict", "default": {}},
        "node": {"type": "str", "default": ""},
        "create": {"type": "bool", "default": False},
    }


def build_module() -> AnsibleModule:
    return AnsibleModule(argument_spec=argument_spec(), supports_check_mode=True)


def run(module: AnsibleModule) -> None:
    p = module.params
    try:
        res = textfile(
            p["directory"], p["name"], p["source"], p["record"], labels=p["labels"], node=p["node"],
            create=p["create"], check_mode=module.check_mode,
        )  # fmt: skip
    except (ValueError, OSError) as e:
        where = f"{p['directory']}/{p['name']}"
        module.fail_json(msg=f"llmfleet_metrics_textfile {where} (source {p['source']}): {e}")
    out = {k: res[k] for k in ("path", "changed", "created", "families", "series")}
    if module._diff:
        out["diff"] = {"before": res["before"], "after": res["after"], "before_header": res["path"],
                       "after_header": res["path"]}  # fmt: skip
    module.exit_json(**out)


def main() -> None:
    run(build_module())


if __name__ == "__main__":
    main()
