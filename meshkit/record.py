"""Frozen value records for the code every node interpreter runs: the protocol, the pure core
(hostfile, topology, sources, distenv, job, keys) and the settings.

Why not ``dataclasses``: importing it pulls in ``inspect`` (about 25 ms in a fresh interpreter)
and it builds each class's methods through ``exec``. Every agent, every ``meshkit env`` and every
``meshkit run`` on every node pays that, and 64 nodes share this project's benchmark machine's two
cores. A record here is built from its annotations with shared, generic methods: no ``exec``, no
``typing``, no ``inspect``. Type checkers see a frozen dataclass (``dataclass_transform``).

What it supports is what the tree uses: frozen classes, defaults, ``field(default_factory=...)``,
``__post_init__``, inheritance of fields, ``replace``, ``asdict`` and ``fields``.
"""

from __future__ import annotations

TYPE_CHECKING = False  # no runtime `typing` (see meshkit/__init__.py)
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import TypeVar, dataclass_transform

    T = TypeVar("T")
    R = TypeVar("R")
else:

    def dataclass_transform(**_: object) -> object:
        return lambda function: function


class FrozenInstanceError(AttributeError):
    """An assignment to a field of a record (records are values)."""


class _Missing:
    def __repr__(self) -> str:
        return "MISSING"


MISSING: object = _Missing()


class Field:
    """One field: its name, its annotation (a string), and its default or default factory."""

    __slots__ = ("default", "default_factory", "name", "type")

    def __init__(self, name: str, type: str, default: object, default_factory: object) -> None:
        self.name = name
        self.type = type
        self.default = default
        self.default_factory = default_factory

    def __repr__(self) -> str:
        return f"Field({self.name!r}: {self.type})"


class _Factory:
    __slots__ = ("make",)

    def __init__(self, make: Callable[[], object]) -> None:
        self.make = make


def field(*, default_factory: Callable[[], T]) -> T:
    """A field whose default is made afresh for each record (a list, a dict)."""
    # The class body holds this marker until `record` reads it; to a type checker it is a T.
    return _Factory(default_factory)  # type: ignore[return-value]


def _init(self: object, *args: object, **kwargs: object) -> None:
    spec: tuple[Field, ...] = self.__record_fields__  # type: ignore[attr-defined]
    name = type(self).__name__
    if len(args) > len(spec):
        raise TypeError(f"{name}() takes {len(spec)} arguments, {len(args)} given")
    for index, f in enumerate(spec):
        if index < len(args):
            if f.name in kwargs:
                raise TypeError(f"{name}() got two values for {f.name!r}")
            value = args[index]
        elif f.name in kwargs:
            value = kwargs.pop(f.name)
        elif f.default is not MISSING:
            value = f.default
        elif f.default_factory is not MISSING:
            value = f.default_factory()  # type: ignore[operator]
        else:
            raise TypeError(f"{name}() missing argument {f.name!r}")
        object.__setattr__(self, f.name, value)
    if kwargs:
        raise TypeError(f"{name}() got an unexpected argument {next(iter(kwargs))!r}")
    post = getattr(self, "__post_init__", None)
    if post is not None:
        post()


def _values(self: object) -> tuple[object, ...]:
    return tuple(getattr(self, f.name) for f in self.__record_fields__)  # type: ignore[attr-defined]


def _repr(self: object) -> str:
    inner = ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in self.__record_fields__)  # type: ignore[attr-defined]
    return f"{type(self).__qualname__}({inner})"


def _eq(self: object, other: object) -> bool:
    if other.__class__ is not self.__class__:
        return NotImplemented  # type: ignore[no-any-return]  # Python's protocol for "ask other"
    return _values(self) == _values(other)


def _hash(self: object) -> int:
    return hash(_values(self))


def _frozen_setattr(self: object, name: str, value: object) -> None:
    raise FrozenInstanceError(f"cannot assign to field {name!r} of {type(self).__name__}")


def _frozen_delattr(self: object, name: str) -> None:
    raise FrozenInstanceError(f"cannot delete field {name!r} of {type(self).__name__}")


@dataclass_transform(frozen_default=True, field_specifiers=(field,))
def record(cls: type[T]) -> type[T]:
    """Make ``cls`` a frozen record of its annotated fields (like ``@dataclass(frozen=True)``)."""
    spec: list[Field] = []
    for base in reversed(cls.__mro__[1:]):
        for inherited in base.__dict__.get("__record_fields__", ()):
            spec = [f for f in spec if f.name != inherited.name] + [inherited]
    # Own annotations only (inherited fields come from the bases above); not inspect: its import
    # is the cost this module exists to avoid.
    own = cls.__dict__.get("__annotations__", {})  # noqa: RUF063
    for name, kind in own.items():
        kind = kind if isinstance(kind, str) else getattr(kind, "__name__", str(kind))
        if kind.startswith(("ClassVar", "typing.ClassVar")):
            continue
        value = cls.__dict__.get(name, MISSING)
        factory: object = MISSING
        if isinstance(value, _Factory):
            factory, value = value.make, MISSING
            delattr(cls, name)
        spec = [f for f in spec if f.name != name] + [Field(name, kind, value, factory)]
    seen_default = False
    for f in spec:
        has_default = f.default is not MISSING or f.default_factory is not MISSING
        if seen_default and not has_default:
            raise TypeError(f"{cls.__name__}: field {f.name!r} without a default follows one with")
        seen_default = seen_default or has_default
    methods: dict[str, object] = {
        "__init__": _init,
        "__repr__": _repr,
        "__eq__": _eq,
        "__hash__": _hash,
        "__setattr__": _frozen_setattr,
        "__delattr__": _frozen_delattr,
    }
    for name, method in methods.items():
        if name not in cls.__dict__ or (name == "__hash__" and cls.__dict__[name] is None):
            setattr(cls, name, method)
    setattr(cls, "__record_fields__", tuple(spec))  # noqa: B010  (unknown to the checker)
    setattr(cls, "__match_args__", tuple(f.name for f in spec))  # noqa: B010
    return cls


def is_record(thing: object) -> bool:
    """Whether ``thing`` is a record class or a record."""
    kind = thing if isinstance(thing, type) else type(thing)
    return hasattr(kind, "__record_fields__")


def fields(thing: object) -> tuple[Field, ...]:
    """The fields of a record class or record, in order."""
    kind = thing if isinstance(thing, type) else type(thing)
    spec: tuple[Field, ...] | None = getattr(kind, "__record_fields__", None)
    if spec is None:
        raise TypeError(f"{kind.__name__} is not a record")
    return spec


def replace(obj: R, /, **changes: object) -> R:
    """A copy of ``obj`` with ``changes`` (checked again by ``__post_init__``). The one
    ``replace`` of the tree: a dataclass (the controller-side results) goes to ``dataclasses``."""
    if not is_record(obj):
        import dataclasses  # only the controller side has dataclasses, and has it imported

        return dataclasses.replace(obj, **changes)  # type: ignore[type-var]
    values = {f.name: getattr(obj, f.name) for f in fields(obj)}
    for name in changes:
        if name not in values:
            raise TypeError(f"{type(obj).__name__} has no field {name!r}")
    values.update(changes)
    return type(obj)(**values)


def asdict(obj: object) -> dict[str, object]:
    """The record ``obj`` as plain JSON-able data, nested records, lists and dicts included."""
    return {f.name: _plain(getattr(obj, f.name)) for f in fields(obj)}


def _plain(value: object) -> object:
    if hasattr(type(value), "__record_fields__"):
        return asdict(value)
    if isinstance(value, (list, tuple)):
        return type(value)(_plain(item) for item in value)
    if isinstance(value, dict):
        return {_plain(k): _plain(v) for k, v in value.items()}
    return value


# ---- building records from untrusted data ---------------------------------------------------------
# The one checker of the tree: the protocol builds every request and reply with it (bytes read from
# a node are data, never trusted structure) and the settings build the configuration with it.


class Invalid(ValueError):
    """Data that does not fit a record's annotations; the message names where (``args.job.env``)."""


def build(cls: type[T], data: object, where: str) -> T:
    """A ``cls`` record from JSON-like ``data``, every field checked against its annotation."""
    if not isinstance(data, dict):
        raise Invalid(f"{where}: expected an object")
    values = {}
    for f, shape in _fields_of(cls):
        if f.name in data:
            values[f.name] = _check(shape, data[f.name], f"{where}.{f.name}")
        elif f.default is MISSING and f.default_factory is MISSING:
            raise Invalid(f"{where}.{f.name}: missing")
    return cls(**values)


def check(cls: type, name: str, value: object, where: str) -> object:
    """``value`` checked against the annotation of ``cls``'s field ``name``."""
    for f, shape in _fields_of(cls):
        if f.name == name:
            return _check(shape, value, where)
    raise KeyError(name)


class _Shape:
    """An annotation, parsed once: ``tag`` is a scalar type's name, ``list``, ``tuple``, ``dict``,
    ``literal`` (``values``), ``union`` or ``record`` (then ``record`` is the class)."""

    __slots__ = ("args", "record", "tag", "values")

    def __init__(
        self,
        tag: str,
        args: tuple[_Shape, ...] = (),
        record: type | None = None,
        values: tuple[str, ...] = (),
    ) -> None:
        self.tag = tag
        self.args = args
        self.record = record
        self.values = values


_SHAPES: dict[type, tuple[tuple[Field, _Shape], ...]] = {}
_SCALARS = ("str", "int", "float", "bool", "None")


def _fields_of(cls: type) -> tuple[tuple[Field, _Shape], ...]:
    found = _SHAPES.get(cls)
    if found is None:
        import sys  # already loaded: only to find the names the annotations use

        names = sys.modules[cls.__module__].__dict__
        found = _SHAPES[cls] = tuple((f, _shape(f.type, names)) for f in fields(cls))
    return found


def _shape(text: str, names: dict[str, object]) -> _Shape:
    """The shape of an annotation string: ``list[int]``, ``tuple[str, ...]``, ``str | None``,
    ``dict[str, str]``, ``Literal['a', 'b']``, or a record class of the module that uses it. The
    tree's records use nothing else (a test parses them all)."""
    options = _split(text, "|")
    if len(options) > 1:
        return _Shape("union", tuple(_shape(option, names) for option in options))
    text = text.strip()
    if text.endswith("]"):
        head, _, inner = text[:-1].partition("[")
        parts = _split(inner, ",")
        if head == "Literal":
            return _Shape("literal", values=tuple(p.strip().strip("'\"") for p in parts))
        if head == "tuple" and len(parts) == 2 and parts[1].strip() == "...":
            return _Shape("tuple", (_shape(parts[0], names),))
        args = tuple(_shape(arg, names) for arg in parts)
        if (head, len(args)) in (("list", 1), ("dict", 2)):
            return _Shape(head, args)
    elif text in _SCALARS:
        return _Shape(text)
    else:
        found = names.get(text)
        if isinstance(found, type) and is_record(found):
            return _Shape("record", record=found)
    raise TypeError(f"record: unsupported annotation {text!r}")


def _split(text: str, sep: str) -> list[str]:
    """``text`` cut at ``sep`` outside brackets."""
    parts, depth, start = [], 0, 0
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
        for option in shape.args:
            try:
                return _check(option, value, where)
            except Invalid:
                continue
        raise Invalid(f"{where}: unexpected {type(value).__name__}")
    if tag == "None":
        if value is None:
            return None
    elif tag in ("list", "tuple"):
        if isinstance(value, (list, tuple)):
            (item,) = shape.args
            items = [_check(item, v, f"{where}[]") for v in value]
            return items if tag == "list" else tuple(items)
    elif tag == "dict":
        if isinstance(value, dict):
            key, val = shape.args
            return {_check(key, k, where): _check(val, v, where) for k, v in value.items()}
    elif tag == "record":
        assert shape.record is not None
        return build(shape.record, value, where)
    elif tag == "literal":
        if isinstance(value, str) and value in shape.values:
            return value
        raise Invalid(f"{where}: {str(value)[:40]!r} is not one of {', '.join(shape.values)}")
    elif tag == "float":
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif tag == "int":
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif (tag == "str" and isinstance(value, str)) or (tag == "bool" and isinstance(value, bool)):
        return value
    raise Invalid(f"{where}: unexpected {type(value).__name__}")
