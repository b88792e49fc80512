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
