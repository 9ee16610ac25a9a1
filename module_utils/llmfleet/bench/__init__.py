"""The serving benchmark with the engine's own tool (docs/bench-serving.md)."""
