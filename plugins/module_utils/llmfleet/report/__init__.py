"""The deployment report: HTML page and markdown from a run's records (docs/report.md). Ops host only: not
shipped in the node runtime."""
