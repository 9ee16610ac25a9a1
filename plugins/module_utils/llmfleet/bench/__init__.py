"""The serving benchmark with the engine's own tool (docs/measurements/bench-serving.md)."""
