"""`llmfleet exec`: the unit's main process around an engine - exit codes kept, the deployment link, the record,
the serving health probe (docs/wrapper.md). Node runtime; stdlib only."""
