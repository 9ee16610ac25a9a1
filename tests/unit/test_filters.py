import pytest
from ansible.errors import AnsibleFilterError

from llmfleet_filters import FilterModule, llmfleet_duplicates


@pytest.mark.parametrize(
    ("mapping", "expected"),
    [
        ({}, {}),
        ({"n1": "10.0.0.1", "n2": "10.0.0.2"}, {}),
        ({"n1": "10.0.0.1", "n2": "10.0.0.1"}, {"10.0.0.1": ["n1", "n2"]}),
        ({"n3": "a", "n1": "a", "n2": "b", "n4": "b", "n5": "c"}, {"a": ["n1", "n3"], "b": ["n2", "n4"]}),
        ({"n1": "", "n2": "", "n3": None, "n4": None}, {}),  # unset values are not duplicates
    ],
)
def test_duplicates(mapping, expected):
    assert llmfleet_duplicates(mapping) == expected


def test_duplicates_rejects_non_mapping():
    with pytest.raises(AnsibleFilterError, match="expects a mapping"):
        llmfleet_duplicates(["10.0.0.1", "10.0.0.1"])


def test_registered_name():
    assert FilterModule().filters()["llmfleet_duplicates"] is llmfleet_duplicates
