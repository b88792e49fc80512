"""Every number and string a node sends is bounded by the one record checker: an int of any
length in any int field of any request or reply, or a lone surrogate in any string, is
``Invalid`` (the protocol's ``ProtocolViolation``), never another exception; each int field holds
its own range. Pure: no node."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from meshkit import protocol, record
from meshkit.record import _fields_of, _Shape

MARK = 7_777_777_777_777  # a number no sample holds: replaced in the JSON text by a huge one
LONE = "ab\ud800cd"  # a high surrogate with no low one after it


def sample(shape: _Shape) -> object:
    """A value ``shape`` takes: the smallest of its kind."""
    tag = shape.tag
    if tag == "union":
        return sample(shape.args[0])
    if tag in ("list", "tuple"):
        return [sample(shape.args[0])]
    if tag == "dict":
        return {"k": sample(shape.args[1])}
    if tag == "record":
        assert shape.cls is not None
        return sample_record(shape.cls)
    if tag in ("literal", "enum"):
        return shape.values[0]
    scalars: dict[str, object] = {"str": "x", "float": 1.0, "time": 1.0, "bool": True}
    if tag == "int":
        return max(shape.lowest, 0)
    return scalars.get(tag)


def sample_record(cls: type) -> dict[str, object]:
    return {each.name: sample(shape) for each, shape in _fields_of(cls)}


def spoiled(shape: _Shape, kind: str, bad: object) -> Iterator[object]:
    """Values of ``shape`` with one place of ``kind`` ("int" or "str") holding ``bad``: one
    value for each such place (a dict's key among them)."""
    tag = shape.tag
    if tag == kind:
        yield bad
    elif tag == "union":
        for option in shape.args:
            yield from spoiled(option, kind, bad)
    elif tag in ("list", "tuple"):
        for each in spoiled(shape.args[0], kind, bad):
            yield [sample(shape.args[0]), each]
    elif tag == "dict":
        for each in spoiled(shape.args[1], kind, bad):
            yield {"k": each}
        if kind == "str":
            yield {bad: sample(shape.args[1])}
    elif tag == "record":
        assert shape.cls is not None
        yield from spoiled_records(shape.cls, kind, bad)


def spoiled_records(cls: type, kind: str, bad: object) -> Iterator[dict[str, object]]:
    for each, shape in _fields_of(cls):
        for value in spoiled(shape, kind, bad):
            data = sample_record(cls)
            data[each.name] = value
            yield data


def every_message() -> Iterator[tuple[str, str, type]]:
    for op, (request, reply, _) in protocol.OPS.items():
        yield op, "request", request
        yield op, "reply", reply


def decode(op: str, side: str, data: dict[str, object], huge: str | None = None) -> object:
    """``data`` through the protocol's decoder, as the agent's or the controller's line; the
    mark replaced by ``huge`` digits in the text (no int of that size can be written)."""
    if side == "request":
        line = json.dumps({"v": protocol.VERSION, "op": op, "args": data})
    else:
        line = json.dumps({"ok": True, "result": data})
    if huge is not None:
        line = line.replace(str(MARK), huge)
    if side == "request":
        return protocol.decode_request(line)
    return protocol.decode_reply(op, line)


@pytest.mark.parametrize(("op", "side", "cls"), list(every_message()))
def test_every_sample_message_decodes(op: str, side: str, cls: type) -> None:
    decode(op, side, sample_record(cls))  # the samples the other tests spoil are valid


@pytest.mark.parametrize(("op", "side", "cls"), list(every_message()))
def test_an_int_of_any_length_in_any_int_field_is_a_protocol_violation(
    op: str, side: str, cls: type
) -> None:
    spoilt = list(spoiled_records(cls, "int", MARK))
    for data in spoilt:
        for digits in ("9" * 5000, "9" * 4000, "-" + "9" * 400, str(2**64)):
            with pytest.raises(protocol.ProtocolViolation) as raised:
                decode(op, side, data, digits)
            assert len(str(raised.value)) < 400  # the number is described, not written
        with pytest.raises(record.Invalid, match="is not within"):
            record.build(cls, json.loads(json.dumps(data).replace(str(MARK), "9" * 4000)), "m")


@pytest.mark.parametrize(("op", "side", "cls"), list(every_message()))
def test_a_lone_surrogate_in_any_string_is_a_protocol_violation(
    op: str, side: str, cls: type
) -> None:
    for data in spoiled_records(cls, "str", LONE):
        with pytest.raises(protocol.ProtocolViolation, match="a lone surrogate") as raised:
            decode(op, side, data)
        str(raised.value).encode("utf-8")  # the message itself prints anywhere
        assert "\\ud800" in str(raised.value)


def int_shapes(shape: _Shape) -> Iterator[_Shape]:
    if shape.tag == "int":
        yield shape
    for each in shape.args:
        yield from int_shapes(each)


def test_every_protocol_int_names_its_range_and_each_range_holds_its_ends() -> None:
    plain = set()
    for cls in vars(protocol).values():
        if isinstance(cls, type) and record.is_record(cls):
            for each, shape in _fields_of(cls):
                ranges = {(found.lowest, found.highest) for found in int_shapes(shape)}
                if record.INT_RANGES["int"] in ranges:
                    plain.add(f"{cls.__name__}.{each.name}")
    assert plain == {"Supervision.restarts_left"}  # a count that a relaunch counts down
    for name, (lowest, highest) in record.INT_RANGES.items():
        shape = _Shape("int", lowest=lowest, highest=highest)
        assert record._check(shape, lowest, name) == lowest
        assert record._check(shape, highest, name) == highest
        for outside in (lowest - 1, highest + 1):
            with pytest.raises(record.Invalid, match=f"{name}: .* is not within"):
                record._check(shape, outside, name)
        with pytest.raises(record.Invalid, match="unexpected bool"):
            record._check(shape, True, name)


@pytest.mark.parametrize(
    ("field", "value", "taken"),
    [
        ("port", 65535, True),
        ("port", 65536, False),
        ("port", -1, False),
        ("pid", 1, True),
        ("pid", 0, False),
        ("pid", 2**22 + 1, False),
        ("code", -255, True),
        ("code", 143, True),
        ("code", 256, False),
        ("size", 2**64 - 1, True),
        ("size", 2**64, False),
        ("size", -1, False),
        ("version", 2**53, True),
        ("version", 2**53 + 1, False),
        ("restarts_left", -(2**53), True),
        ("restarts_left", -(2**53) - 1, False),
    ],
)
def test_each_kind_of_int_field_holds_its_range(field: str, value: int, taken: bool) -> None:
    cls = {
        "port": protocol.PortState,
        "pid": protocol.RankSample,
        "code": protocol.ProbeReply,
        "size": protocol.FileState,
        "version": protocol.Supervision,
        "restarts_left": protocol.Supervision,
    }[field]
    data = sample_record(cls)
    data[field] = value
    if taken:
        assert getattr(record.build(cls, data, "x"), field) == value
    else:
        with pytest.raises(record.Invalid, match=rf"x\.{field}: .* is not within"):
            record.build(cls, data, "x")


def test_a_supervision_copy_with_a_huge_version_or_a_lone_surrogate_is_unreadable() -> None:
    """A node's copy is read through the checker: such a copy is none (any writer may replace
    it), where a version of 4,300 digits used to stop every write of the record, stop's too."""
    from meshkit.node.supervise import accepts, copy_of

    good = protocol.Supervision(protocol.SupervisorState.RUNNING, 1, 3)
    text = good.to_json()
    assert copy_of(text) == good
    huge = text.replace('"version": 0', '"version": ' + "9" * 4000)
    lone = text.replace('"last_restart_reason": null', '"last_restart_reason": "\\ud800"')
    beyond = text.replace('"version": 0', '"version": ' + "9" * 5000)
    for bad in (huge, lone, beyond):
        assert bad != text
        assert copy_of(bad) is None
        assert accepts(bad, good, 0)


def test_a_failure_reply_with_a_lone_surrogate_is_a_protocol_violation() -> None:
    line = json.dumps({"ok": False, "error": "ValueError: \ud800"})
    with pytest.raises(protocol.ProtocolViolation, match=r"reply\.error: a lone surrogate"):
        protocol.decode_reply("status", line)
    with pytest.raises(protocol.NodeFailure, match="ValueError: bad"):
        protocol.decode_reply("status", json.dumps({"ok": False, "error": "ValueError: bad"}))


class Trickle:
    """An agent's channel that sends ``data`` a piece at a time, ``every`` seconds apart (each
    wait well within any timeout a channel sets)."""

    def __init__(self, data: bytes, piece: int, every: float) -> None:
        self.data = data
        self.piece = piece
        self.every = every
        self.timeouts: list[float] = []

    def settimeout(self, seconds: float) -> None:
        self.timeouts.append(seconds)

    def sendall(self, data: bytes) -> None:
        pass

    def recv(self, size: int) -> bytes:
        import time

        time.sleep(self.every)
        piece = self.data[: min(size, self.piece)]
        self.data = self.data[len(piece) :]
        return piece


def agent_on(channel: object) -> object:
    from types import SimpleNamespace

    from meshkit.remote.agent import Agent

    agent = Agent.__new__(Agent)  # no node: the channel double answers
    agent.remote = SimpleNamespace(settings=SimpleNamespace(command_timeout=5.0))
    agent.channel = channel
    agent.broken = None
    agent._unread = b""
    return agent


def test_a_reply_sent_a_byte_now_and_then_ends_at_the_calls_deadline() -> None:
    import time

    from meshkit.errors import RemoteError

    reply = protocol.encode_reply(protocol.JobsReply([])).encode()
    assert len(reply) > 12  # more than a second's worth of its bytes
    channel = Trickle(reply, piece=1, every=0.1)
    agent = agent_on(channel)
    started = time.monotonic()
    with pytest.raises(RemoteError, match="did not answer JobsRequest within 1s"):
        agent.call(protocol.JobsRequest(), protocol.JobsReply, timeout=1.0)  # type: ignore[attr-defined]
    assert time.monotonic() - started < 1.5
    assert max(channel.timeouts[1:]) <= 1.0  # each wait: what is left of the call's time


def test_replies_read_whole_in_pieces_and_one_past_the_byte_bound_is_refused() -> None:
    from meshkit.errors import ProtocolError

    reply = protocol.encode_reply(protocol.JobsReply([protocol.RunningJob("j", "l")]))
    agent = agent_on(Trickle(reply.encode() * 2, piece=7, every=0))
    for _ in range(2):  # the second reply from what came past the first line
        answer = agent.call(protocol.JobsRequest(), protocol.JobsReply)  # type: ignore[attr-defined]
        assert answer == protocol.JobsReply([protocol.RunningJob("j", "l")])
    endless = agent_on(Trickle(b" " * (protocol.MAX_LINE + 65536), piece=65536, every=0))
    with pytest.raises(ProtocolError, match="exceeds"):
        endless.call(protocol.JobsRequest(), protocol.JobsReply)  # type: ignore[attr-defined]


def test_a_listing_whose_pages_never_end_is_that_nodes_problem() -> None:
    from helpers.fake_pool import HOSTS, FakePool

    from meshkit.errors import LaunchError
    from meshkit.ops import sync

    endless = protocol.ManifestReply(True, [], more=True)
    one = protocol.ManifestReply(True, [protocol.FileState("a", 1, 1.0, 0o644)])
    pool = FakePool({"manifest": {HOSTS[0]: endless, HOSTS[1]: one}})
    with pytest.raises(LaunchError) as raised:
        sync.manifests(pool, "/w", [], HOSTS[:2])
    assert "empty page of its listing" in str(raised.value)
    assert len(pool.calls) == 2  # one page each: nothing asked again
