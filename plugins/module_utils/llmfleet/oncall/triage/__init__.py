"""Triage of an incident bundle: the rules behind `llmfleet why`. Ops host only."""
