"""meshkit.record: the frozen records of the node-side code, against what dataclasses did."""

import json

import pytest

from meshkit import protocol
from meshkit.record import FrozenInstanceError, asdict, field, fields, record, replace


@record
class Point:
    x: int
    y: int = 0
    tags: list[str] = field(default_factory=list)


@record
class Checked:
    low: int
    high: int

    def __post_init__(self) -> None:
        if self.low > self.high:
            raise ValueError("low above high")


@record
class Labelled(Point):
    label: str = ""


def test_init_defaults_and_factories_are_fresh() -> None:
    a, b = Point(1), Point(x=2, y=3)
    assert (a.x, a.y, a.tags, b.x, b.y) == (1, 0, [], 2, 3)
    a.tags.append("t")
    assert Point(1).tags == []  # a new list per record
    assert Point.y == 0  # the class keeps a plain default (settings reads it)


def test_bad_arguments_are_type_errors() -> None:
    with pytest.raises(TypeError, match="missing argument 'x'"):
        Point()  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="unexpected argument 'z'"):
        Point(1, z=2)  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="two values"):
        Point(1, x=2)  # type: ignore[misc]
    with pytest.raises(TypeError, match="takes 3 arguments"):
        Point(1, 2, [], 4)  # type: ignore[call-arg]


def test_frozen_equal_hashable_and_readable() -> None:
    p = Point(1, 2)
    with pytest.raises(FrozenInstanceError):
        p.x = 3  # type: ignore[misc]
    with pytest.raises(AttributeError):
        del p.x  # type: ignore[misc]
    assert p == Point(1, 2) and p != Point(2, 1) and p != (1, 2, [])
    assert hash(Checked(1, 2)) == hash(Checked(1, 2))
    assert {Checked(1, 2), Checked(1, 2)} == {Checked(1, 2)}
    assert repr(p) == "Point(x=1, y=2, tags=[])"


def test_post_init_checks_construction_and_replace() -> None:
    with pytest.raises(ValueError, match="low above high"):
        Checked(3, 2)
    c = Checked(1, 2)
    assert replace(c, high=5) == Checked(1, 5)
    with pytest.raises(ValueError):
        replace(c, low=9)
    with pytest.raises(TypeError, match="no field 'mid'"):
        replace(c, mid=1)


def test_inheritance_fields_asdict_and_match() -> None:
    item = Labelled(1, 2, ["a"], "l")
    assert [f.name for f in fields(Labelled)] == ["x", "y", "tags", "label"]
    assert asdict(item) == {"x": 1, "y": 2, "tags": ["a"], "label": "l"}
    assert Labelled.__match_args__ == ("x", "y", "tags", "label")  # type: ignore[attr-defined]


def test_a_required_field_after_a_default_is_refused() -> None:
    with pytest.raises(TypeError, match="without a default"):

        @record
        class Bad:
            a: int = 0
            b: int  # type: ignore[misc]


def test_replace_still_serves_dataclasses() -> None:
    from dataclasses import dataclass

    @dataclass(frozen=True)
    class D:
        a: int

    assert replace(D(1), a=2) == D(2)


def test_every_protocol_annotation_parses_and_round_trips() -> None:
    from meshkit import record, settings

    for request, reply, _ in protocol.OPS.values():
        for cls in (request, reply):
            record._fields_of(cls)  # raises on an annotation the checker cannot read
    record._fields_of(settings.Config)
    job = protocol.NodeJob("id", "s", "label", "/w", "t", ["meshkit", "run"], {"A": "1"})
    op, back = protocol.decode_request(protocol.encode_request(protocol.StartRequest(job)))
    assert op == "start" and back == protocol.StartRequest(job)
    line = json.dumps({"ok": True, "result": {"code": True, "out": "", "err": ""}})
    with pytest.raises(protocol.ProtocolViolation, match=r"result\.code"):
        protocol.decode_reply("doctor_probe", line)
    line = json.dumps(
        {
            "ok": True,
            "result": {"state": "gone", "exit_code": None, "started": None, "last_line": None},
        }
    )
    with pytest.raises(protocol.ProtocolViolation, match="not one of running, exited, absent"):
        protocol.decode_reply("status", line)
