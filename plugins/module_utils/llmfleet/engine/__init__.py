"""The engine: its launch plan (argv, units, GPUs), the readiness gate, start-up log reading, fit, flags and
the node-side probes (docs/engine.md). Node runtime; stdlib only."""
