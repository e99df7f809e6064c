"""Overrides follow Hydra's grammar (as upstream AReaL's command line does), with one clear error per bad key."""

from __future__ import annotations

import pytest

from areal_hex_plugin.errors import HexError
from areal_hex_plugin.specs.overrides import apply_overrides

BASE = {"a": {"b": 1, "name": "x"}, "pools": [{"machines": 2}]}


@pytest.mark.parametrize(
    ("override", "key", "value"),
    [
        ("a.b=1e-3", "b", 0.001),  # Hydra's float grammar (YAML 1.1 reads "1e-3" as a string)
        ("a.name='1'", "name", "1"),  # quoted: a string, not an int
        ("a.name=x\\,y", "name", "x,y"),  # an escaped comma is not a sweep
        ("a.b=[1, 2]", "b", [1, 2]),
        ("a.b={k: 1}", "b", {"k": 1}),
        ("a.b=null", "b", None),
        ("++a.c=true", "c", True),
        ("+a.c=2", "c", 2),
    ],
)
def test_values_are_read_with_hydras_grammar(override, key, value):
    assert apply_overrides(BASE, [override])["a"][key] == value


def test_list_items_and_deletion():
    assert apply_overrides(BASE, ["pools.0.machines=3"])["pools"][0]["machines"] == 3
    assert "name" not in apply_overrides(BASE, ["~a.name"])["a"]
    assert "name" not in apply_overrides(BASE, ["~a.name=x"])["a"]


@pytest.mark.parametrize(
    ("override", "problem"),
    [
        ("a.b=1,2", "is a sweep"),  # the old parser planned with the string "1,2"
        ("~a.name=y", "is 'x', not 'y'"),  # Hydra deletes only on a match; the old parser deleted anyway
        ("a.b=[1", "is not Hydra override syntax"),
        ("a.b@pkg=1", "package"),
        ("a.nope=1", "a.nope is not in the recipe"),
        ("+a.b=2", "a.b is already in the recipe"),
        ("~a.nope", "there is no 'a.nope' to delete"),
        ("a.b", "is not key=value"),
        ("=1", "has no key"),
    ],
)
def test_bad_overrides_name_the_override_and_the_fix(override, problem):
    with pytest.raises(HexError, match="fix:") as info:
        apply_overrides(BASE, [override])
    assert info.value.field == f"override {override!r}" and problem in info.value.problem


def test_a_list_item_written_as_errors_name_it_gets_the_hydra_spelling_as_the_fix():
    """Bad-input messages name fields like pools[0].machines; pasting that into an override must say how."""
    with pytest.raises(HexError) as info:
        apply_overrides(BASE, ["pools[0].machines=3"])
    assert "write pools.0.machines=3" in info.value.fix
