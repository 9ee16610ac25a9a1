"""llmfleet: bare-metal GPU nodes to a verified multi-node SGLang/vLLM endpoint.

This package is imported under two names from one source tree:
``llmfleet`` (the CLI, tests, node-side programs) and ``ansible_collections.llmfleet.fleet.plugins.module_utils.llmfleet``
(Ansible modules in library/; AnsiballZ ships it to the node). Keep imports inside the package
relative, and keep the node-safe core stdlib-only (Python >= 3.8 on nodes).
"""

__version__ = "0.1.0"
