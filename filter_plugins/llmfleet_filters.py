"""Pure helpers for llmfleet templates and assertions."""

from __future__ import annotations

from collections.abc import Mapping

from ansible.errors import AnsibleFilterError


def llmfleet_duplicates(mapping: Mapping) -> dict:
    """{value: [keys...]} for every value that more than one key has (empty values ignored).

    Used to name the nodes that share something that must be unique (fabric IP, machine-id).
    """
    if not isinstance(mapping, Mapping):
        raise AnsibleFilterError(
            f"llmfleet_duplicates expects a mapping of host -> value, got {type(mapping).__name__}"
        )
    seen: dict = {}
    for key, value in mapping.items():
        if value in (None, ""):
            continue
        seen.setdefault(value, []).append(key)
    return {value: sorted(keys) for value, keys in seen.items() if len(keys) > 1}


class FilterModule:
    def filters(self) -> dict:
        return {"llmfleet_duplicates": llmfleet_duplicates}
