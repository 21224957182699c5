"""jrl.registry: the one registry helper."""

import pytest

from jrl.registry import Registry, UnknownName


def test_register_get_names():
    r = Registry("colour")

    @r.register("red", "rouge")
    def red():
        return 1

    r.add("blue", 2)
    assert r.get("rouge") is red and r.get("blue") == 2
    assert r.names() == ["blue", "red", "rouge"]
    assert r.get("green", None) is None


def test_unknown_name_says_what_and_valid_names():
    r = Registry("colour", {"red": 1, "blue": 2})
    with pytest.raises(
        UnknownName,
        match=r"unknown colour 'rad' \(did you mean 'red'\?\): valid names are blue, red\.",
    ):
        r.get("rad")
    with pytest.raises(ValueError, match="already registered"):
        r.add("red", 3)
