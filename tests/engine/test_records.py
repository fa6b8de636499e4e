"""engine.core.records.record: a frozen dataclass built by a faster __init__, otherwise the same."""

from __future__ import annotations

import dataclasses
import inspect
import pickle

import pytest

from engine.core.records import record


def _fields():
    """The same fields for a `record` class and a plain frozen dataclass: positional, defaults,
    a default factory, a field set only from its default, and a keyword-only one."""
    return {
        "__annotations__": {"a": "int", "b": "tuple", "c": "list", "d": "int", "e": "int"},
        "b": (),
        "c": dataclasses.field(default_factory=list),
        "d": dataclasses.field(default=3, init=False),
        "e": dataclasses.field(default=4, kw_only=True),
    }


Fast = record(type("Fast", (), _fields()))
Plain = dataclasses.dataclass(frozen=True)(type("Plain", (), _fields()))


@pytest.mark.parametrize("args, kwargs", [((1,), {}), ((1, (2,)), {}), ((1, (2,), [3]), {"e": 5}),
                                          ((), {"a": 1, "c": [7]})])
def test_a_record_is_built_as_the_dataclass_is(args, kwargs):
    fast, plain = Fast(*args, **kwargs), Plain(*args, **kwargs)
    assert dataclasses.asdict(fast) == dataclasses.asdict(plain)
    assert repr(fast).removeprefix("Fast") == repr(plain).removeprefix("Plain")
    assert fast == Fast(*args, **kwargs)
    assert dataclasses.replace(fast, a=9).a == 9 and dataclasses.replace(fast, a=9).e == fast.e
    assert pickle.loads(pickle.dumps(fast)) == fast


def test_a_record_has_the_dataclass_signature_and_stays_frozen():
    assert list(inspect.signature(Fast).parameters) == list(inspect.signature(Plain).parameters)
    with pytest.raises(TypeError):
        Fast(1, (), [], 5)  # e is keyword-only
    with pytest.raises(TypeError):
        Fast()
    fast = Fast(1)
    assert fast.c is not Fast(1).c  # a fresh default per instance
    with pytest.raises(dataclasses.FrozenInstanceError):
        fast.a = 2


def test_a_record_runs_post_init_and_hashes():
    @record(kw_only=True)
    class Checked:
        size: int

        def __post_init__(self):
            if self.size < 0:
                raise ValueError("size must be >= 0")

    with pytest.raises(ValueError, match="size must be >= 0"):
        Checked(size=-1)
    assert hash(Checked(size=2)) == hash(Checked(size=2))
    assert {Checked(size=2), Checked(size=2)} == {Checked(size=2)}


def test_a_slotted_record_is_refused():
    with pytest.raises(TypeError, match="slotted"):
        record(slots=True)
