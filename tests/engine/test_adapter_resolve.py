"""The request's `adapter` field: "none"/"base" parts mean the base model in every form, and an
unknown name is echoed back cut to 64 characters (a 10,000-character name is not)."""

import pytest

from engine.adapters.registry import AdapterRegistry, Mounted, UnknownAdapter


def _reg():
    reg = AdapterRegistry(model=None)
    for g, name in enumerate(("A", "B"), 1):
        reg.mounted[name] = Mounted(name, "/x", 4, 1.0, 0, 1, g)
    return reg


@pytest.mark.parametrize("spec,want", [("none", ()), ("none+A", ("A",)), ("B+none+A", ("A", "B")),
                                       (["none"], ()), (["base", "B"], ("B",)), ("A,B", ("A", "B")),
                                       ("", ()), ("  ", ()), ("+", ())])
def test_none_is_the_base_in_every_form(spec, want):
    assert _reg().resolve(spec) == want


def test_unknown_names_are_cut_in_the_message():
    with pytest.raises(UnknownAdapter) as e:
        _reg().resolve("x" * 10_000)
    assert len(str(e.value)) < 120 and e.value.param == "adapter"
    with pytest.raises(UnknownAdapter, match='unknown adapter "Z"'):
        _reg().resolve("A+Z")
