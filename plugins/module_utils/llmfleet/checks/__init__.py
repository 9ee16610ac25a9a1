"""Checks before serving: preflight, the fabric topology and the NCCL check (docs/preflight.md, docs/topology.md,
docs/nccl-check.md). Node runtime; stdlib only."""
