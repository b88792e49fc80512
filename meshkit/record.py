"""Frozen value records (``@record``: a frozen dataclass) and the one checker that builds them
from untrusted data: the protocol builds every request and reply with it, the settings build
the configuration with it.

Records are plain dataclasses rather than hand-made classes: the import they cost a node's
interpreter is small against one parallel step on real machines. Each becomes a dataclass
at its first use (an instance, ``fields``, ``build``), not at import: making one compiles
six methods, and making all of the protocol's records was most of every node agent's start,
and of the controller's, where a command uses two or three of them.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import threading
from dataclasses import MISSING, Field, asdict, dataclass, field, is_dataclass, replace

TYPE_CHECKING = False  # no runtime `typing` (see meshkit/__init__.py)
if TYPE_CHECKING:
    from typing import TypeVar, dataclass_transform

    T = TypeVar("T")
else:

    def dataclass_transform(**_: object) -> object:
        return lambda function: function


__all__ = [
    "INT_RANGES",
    "Bytes",
    "Count",
    "ExitCode",
    "FileMode",
    "Index",
    "Invalid",
    "Pid",
    "Port",
    "StrEnum",
    "WallTime",
    "asdict",
    "build",
    "field",
    "fields",
    "is_record",
    "replace",
    "split",
]

# A field annotated ``WallTime`` is a wall-clock time (seconds since 1970): a float that
# ``build`` also holds to the range ``datetime`` can show, so no reader fails on a time it was
# sent. The last day is 9999-12-31 UTC: datetime's last year, a day short for time zones.
WallTime = float
EARLIEST_TIME = 0.0
LATEST_TIME = 253_402_214_400.0

# Every int a record gets is held to a range: a plain ``int`` to what a double holds exactly
# (what JSON carries between any two programs), a field annotated with one of the names below to
# its narrower one. So no reader meets a number it cannot add to, format or store: Python refuses
# to write an int of over 4,300 digits (a version of that size once blocked every supervision
# write, ``stop`` included, and ended ``top``). Each name is ``int`` to the type checker.
Count = int  # how many of something, a version, a generation, an offset, a page
Index = int  # a rank, a node's rank, a GPU's index
Bytes = int  # a size, memory, a byte counter (a network port's counts 64 bits)
Port = int  # a TCP port (0: any)
Pid = int  # a process id: the kernel's PID_MAX_LIMIT is 2**22
ExitCode = int  # an exit code, or minus the signal that ended the process (Python's returncode)
FileMode = int  # permission bits
INT_RANGES: dict[str, tuple[int, int]] = {
    "int": (-(2**53), 2**53),
    "Count": (0, 2**53),
    "Index": (0, 2**31 - 1),
    "Bytes": (0, 2**64 - 1),
    "Port": (0, 65535),
    "Pid": (1, 2**22),
    "ExitCode": (-255, 255),
    "FileMode": (0, 0o7777),
}


@dataclass_transform(frozen_default=True, field_specifiers=(field,))
def record(cls: type[T]) -> type[T]:
    """Make ``cls`` a frozen record of its annotated fields (a frozen dataclass), at its first
    use: its first instance, ``fields`` or ``build``."""
    if "__new__" in vars(cls):
        raise TypeError(f"record {cls.__name__}: its __new__ is the one record sets")
    _PENDING.add(cls)
    type.__setattr__(cls, "__new__", staticmethod(_new_record))
    return cls


_PENDING: set[type] = set()  # records not yet made dataclasses
# Held while a record is made a dataclass: the controller's threads decode their nodes' first
# replies at once, and none may see a record half made (its __init__ set, its __eq__ not yet).
_MAKING = threading.RLock()


def complete(cls: type) -> None:
    """Make every record in ``cls``'s bases and ``cls`` itself a dataclass, bases first, each
    once; nothing to do for a class whose records are complete (or that has none)."""
    if _PENDING.isdisjoint(cls.__mro__):  # a record leaves _PENDING only once it is complete
        return
    with _MAKING:
        for each in reversed(cls.__mro__):
            if each in _PENDING:
                dataclass(frozen=True)(each)
                _PENDING.discard(each)


def _new_record(cls: type, *args: object, **kwargs: object) -> object:
    """Every record's ``__new__``: the class is completed before its first instance, whose
    ``__init__`` (the dataclass's) Python looks up after this returns."""
    complete(cls)
    return object.__new__(cls)


def fields(cls: type) -> tuple[Field[object], ...]:
    """``dataclasses.fields`` of a record class (completed first)."""
    complete(cls)
    return dataclasses.fields(cls)


def is_record(cls: type) -> bool:
    """Whether ``cls`` is a record (or any dataclass), complete or not yet."""
    return cls in _PENDING or is_dataclass(cls)


class StrEnum(str, enum.Enum):
    """An enum whose members are their strings: in JSON, in messages and in comparisons alike
    (Python 3.11's ``enum.StrEnum``; a node may run an older Python)."""

    def __str__(self) -> str:
        return str.__str__(self)

    def __format__(self, format_spec: str) -> str:
        return str.__format__(self, format_spec)


class Invalid(ValueError):
    """Data that does not fit a record's annotations; the message names where
    (``args.job.env``)."""


def build(cls: type[T], data: object, where: str) -> T:
    """A ``cls`` record from JSON-like ``data``, every field checked against its annotation."""
    if not isinstance(data, dict):
        raise Invalid(f"{where}: expected an object")
    values = {}
    for record_field, shape in _fields_of(cls):
        name = record_field.name
        if name in data:
            values[name] = _check(shape, data[name], f"{where}.{name}")
        elif record_field.default is MISSING and record_field.default_factory is MISSING:
            raise Invalid(f"{where}.{name}: missing")
    return cls(**values)


@dataclass(frozen=True)
class _Shape:
    """An annotation, parsed once. ``tag``: a scalar type's name, ``list``, ``tuple``, ``dict``,
    ``literal`` (its strings in ``values``), ``enum`` (the class in ``cls``, its members'
    strings in ``values``), ``union``, ``record`` (the class in ``cls``) or ``time`` (a
    ``WallTime``). An ``int``'s range (``INT_RANGES``) is in ``lowest`` and ``highest``."""

    tag: str
    args: tuple[_Shape, ...] = ()
    cls: type | None = None
    values: tuple[str, ...] = ()
    lowest: int = 0
    highest: int = 0


_SHAPES: dict[type, tuple[tuple[Field[object], _Shape], ...]] = {}
_SCALARS = ("str", "int", "float", "bool", "None")
_PLAIN = {"bool": bool}  # scalars whose type alone decides
# a JSON value's type -> the shapes that take that type (a union says why the one it fits refused)
_KINDS: dict[type, tuple[str, ...]] = {
    int: ("int", "float", "time"),
    float: ("int", "float", "time"),
    str: ("str", "literal", "enum"),
    dict: ("record", "dict"),
    list: ("list", "tuple"),
}


def _fields_of(cls: type) -> tuple[tuple[Field[object], _Shape], ...]:
    found = _SHAPES.get(cls)
    if found is None:
        import sys  # already loaded: only to find the names the annotations use

        names = sys.modules[cls.__module__].__dict__
        found = tuple((each, _shape(str(each.type), names)) for each in fields(cls))
        _SHAPES[cls] = found
    return found


def _shape(text: str, names: dict[str, object]) -> _Shape:
    """The shape of an annotation string: ``list[int]``, ``tuple[str, ...]``, ``str | None``,
    ``dict[str, str]``, ``Literal['a', 'b']``, or a record class or string enum of the module
    that uses it, or ``WallTime``, or an int's name in ``INT_RANGES``. The tree's records use
    nothing else (a test parses them all)."""
    options = split(text, "|")
    if len(options) > 1:
        return _Shape("union", tuple(_shape(option, names) for option in options))
    text = text.strip()
    if text.endswith("]"):
        head, _, inner = text[:-1].partition("[")
        parts = split(inner, ",")
        if head == "Literal":
            return _Shape("literal", values=tuple(part.strip().strip("'\"") for part in parts))
        if head == "tuple" and len(parts) == 2 and parts[1].strip() == "...":
            return _Shape("tuple", (_shape(parts[0], names),))
        args = tuple(_shape(arg, names) for arg in parts)
        if (head, len(args)) in (("list", 1), ("dict", 2)):
            return _Shape(head, args)
    elif text in INT_RANGES:
        lowest, highest = INT_RANGES[text]
        return _Shape("int", lowest=lowest, highest=highest)
    elif text in _SCALARS:
        return _Shape(text)
    elif text == "WallTime":
        return _Shape("time")
    else:
        found = names.get(text)
        if isinstance(found, type) and issubclass(found, StrEnum):
            return _Shape("enum", cls=found, values=tuple(member.value for member in found))
        if isinstance(found, type) and is_record(found):
            return _Shape("record", cls=found)
    raise TypeError(f"record: unsupported annotation {text!r}")


def split(text: str, sep: str) -> list[str]:
    """``text`` cut at ``sep`` outside brackets (``n[1,3],m`` at ``,``: two parts)."""
    parts = []
    depth = 0
    start = 0
    for at, char in enumerate(text):
        depth += (char == "[") - (char == "]")
        if char == sep and depth == 0:
            parts.append(text[start:at])
            start = at + 1
    parts.append(text[start:])
    return parts


def _check(shape: _Shape, value: object, where: str) -> object:
    tag = shape.tag
    if tag == "union":
        # the refusal of the option of the value's own kind (a number out of range, a record's
        # field, a string's surrogate) says more than "unexpected"
        refused = None
        for option in shape.args:
            try:
                return _check(option, value, where)
            except Invalid as exc:
                if option.tag in _KINDS.get(type(value), ()):
                    refused = exc
        if refused is not None:
            raise refused
        raise Invalid(f"{where}: unexpected {type(value).__name__}")
    if tag == "None":
        if value is None:
            return None
    elif tag in ("list", "tuple"):
        if isinstance(value, (list, tuple)):
            (item,) = shape.args
            items = [_check(item, each, f"{where}[]") for each in value]
            return items if tag == "list" else tuple(items)
    elif tag == "dict":
        if isinstance(value, dict):
            key_shape, value_shape = shape.args
            return {
                _check(key_shape, key, where): _check(value_shape, each, where)
                for key, each in value.items()
            }
    elif tag == "record":
        assert shape.cls is not None
        return build(shape.cls, value, where)
    elif tag in ("literal", "enum"):
        if isinstance(value, str) and value in shape.values:
            return value if shape.cls is None else shape.cls(value)
        raise Invalid(f"{where}: {str(value)[:40]!r} is not one of {', '.join(shape.values)}")
    elif tag in ("float", "time"):
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            try:
                number = float(value)
            except OverflowError:  # an int of hundreds of digits
                number = math.inf
            if not math.isfinite(number):
                raise Invalid(f"{where}: {number!r} is not a finite number")
            if tag == "time" and not EARLIEST_TIME <= number <= LATEST_TIME:
                why = "is not a time (seconds from 1970 to year 9999)"
                raise Invalid(f"{where}: {number!r} {why}")
            return number
    elif tag == "int":
        if isinstance(value, int) and not isinstance(value, bool):
            if shape.lowest <= value <= shape.highest:
                return value
            bounds = f"{shape.lowest}..{shape.highest}"
            raise Invalid(f"{where}: {_shown(value)} is not within {bounds}")
    elif tag == "str":
        if isinstance(value, str):
            _check_text(value, where)
            return value
    elif tag in _PLAIN and isinstance(value, _PLAIN[tag]):
        return value
    raise Invalid(f"{where}: unexpected {type(value).__name__}")


def _check_text(value: str, where: str) -> None:
    """A string is refused, not mended, when it holds a lone surrogate (``\\ud800``): JSON's
    escapes can carry one, but no UTF-8 does, so printing it, writing it to a file or encoding it
    raises. No honest sender makes one (the agent decodes bytes with replacement), and mending
    would change the data a record stands for (a file's path) behind its reader's back."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        shown = ascii(value[max(0, exc.start - 20) : exc.start + 20])
        raise Invalid(f"{where}: a lone surrogate at character {exc.start} of {shown}") from None


def _shown(number: int) -> str:
    """An int for a message: whole when short, else how long it is (Python will not write one of
    over 4,300 digits, and nobody reads one of 40)."""
    if abs(number) < 10**24:
        return str(number)
    digits = int(abs(number).bit_length() * math.log10(2)) + 1
    return f"a number of about {digits} digits"
