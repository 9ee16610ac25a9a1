"""The API acceptance gate and the warm-up matrix against a running endpoint (docs/acceptance.md,
docs/warmup.md). Ops host only: not shipped in the node runtime (the warm-up module carries its own copy)."""
