"""Documentation fragment: the options that say where a model revision comes from on shared storage and how
many nodes may read it at once (M(llmfleet.fleet.llmfleet_model_manifest) and M(llmfleet.fleet.llmfleet_model_stage) read the same source)."""

from __future__ import annotations


class ModuleDocFragment:
    DOCUMENTATION = r"""
---
options:
  source_allow_links_into:
    description:
      - Directories outside I(source) that a link in the source may point into. A link whose target leaves the source
        and these directories is refused (the task fails naming the link and where it points), as is anything but a
        regular file (a FIFO, socket or device), since staging copies as root, leaves the files readable by every user
        and serves them to peers. Links within the source always work (a hub-cache snapshot's links into
        C(../../blobs)).
    type: list
    elements: path
    default: []
  revision:
    description: 40-hex commit of the revision.
    type: str
    required: true
  max_source_readers:
    description: Fleet-wide cap of nodes reading shared storage at once (>= 1).
    type: int
    default: 2
"""
