"""On-call commands run from the ops host over SSH: status, logs, bundle, why, stop, restart, rdma-proof
(docs/runbook.md). Ops host only: not shipped in the node runtime."""
