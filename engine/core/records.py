"""Frozen records that cost what mutable ones cost to build.

A frozen dataclass's generated ``__init__`` sets each field through ``object.__setattr__``:
about 2.5 us for a record of eight fields, against 0.5 us for a mutable one. The scheduler,
the block manager and the output processor build several records per sequence per step, so
at a few hundred sequences that alone is milliseconds a step. :func:`record` is
``dataclasses.dataclass(frozen=True)`` with an ``__init__`` that fills the new instance's
``__dict__`` directly (0.8 us): the record is as frozen as before once built (assignment
raises ``FrozenInstanceError``), and equality, hashing, ``repr``, pickling and
``dataclasses.replace`` are the dataclass's own.
"""

from __future__ import annotations

import dataclasses

_FACTORY = object()  # a field with a default_factory that the caller left out


def record(cls=None, /, **options):
    """A frozen dataclass (``options`` as ``dataclasses.dataclass`` takes them, but no
    ``slots``), built by :func:`_direct_init`'s ``__init__``. Use as ``@record`` or
    ``@record(kw_only=True)``."""
    if options.get("slots"):
        raise TypeError("record() fills the instance __dict__; a slotted class has none")

    def wrap(cls):
        cls = dataclasses.dataclass(frozen=True, **options)(cls)
        cls.__init__ = _direct_init(cls)
        return cls

    return wrap if cls is None else wrap(cls)


def _direct_init(cls):
    """An ``__init__`` with the dataclass's signature (positional fields, then keyword-only
    ones, defaults and default factories) that writes each field into ``self.__dict__`` and
    then runs ``__post_init__``, if the class has one."""
    namespace = {"_FACTORY": _FACTORY}
    positional, keyword, body = [], [], []
    for field in dataclasses.fields(cls):
        name = field.name
        if field.default is not dataclasses.MISSING:
            namespace[f"_default_{name}"] = field.default
            value, parameter = name, f"{name}=_default_{name}"
        elif field.default_factory is not dataclasses.MISSING:
            namespace[f"_factory_{name}"] = field.default_factory
            value, parameter = f"_factory_{name}() if {name} is _FACTORY else {name}", f"{name}=_FACTORY"
        else:
            value, parameter = name, name
        if not field.init:  # set from its default (if it has one), never passed
            if value == parameter == name:
                continue
            value = f"_default_{name}" if field.default is not dataclasses.MISSING else f"_factory_{name}()"
        else:
            (keyword if field.kw_only else positional).append(parameter)
        body.append(f"    fields[{name!r}] = {value}")
    if hasattr(cls, "__post_init__"):
        body.append("    self.__post_init__()")
    parameters = ", ".join(["self", *positional, *(["*", *keyword] if keyword else [])])
    source = f"def __init__({parameters}):\n    fields = self.__dict__\n" + "\n".join(body) + "\n"
    exec(source, namespace)  # noqa: S102 (code built from the class's own field names, as dataclasses does)
    init = namespace["__init__"]
    init.__qualname__ = f"{cls.__qualname__}.__init__"
    init.__doc__ = cls.__init__.__doc__
    return init
