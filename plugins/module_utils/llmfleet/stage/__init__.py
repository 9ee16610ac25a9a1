"""Staging a pinned model revision to node-local NVMe: manifests, the content-addressed store, the copy, leases on
shared storage, and the peer relay between nodes (docs/staging.md). Node runtime; stdlib only."""
