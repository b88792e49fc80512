"""meshkit.record: every record annotation parses, and bytes from a node are checked field by
field."""

import json
import subprocess
import sys

import pytest

from meshkit import protocol, record


def test_every_protocol_annotation_parses_and_round_trips() -> None:
    from meshkit import settings

    for request, reply, _ in protocol.OPS.values():
        for cls in (request, reply):
            record._fields_of(cls)  # raises on an annotation the checker cannot read
    record._fields_of(settings.Config)
    job = protocol.NodeJob("id", "s", "label", "/w", "t", ["meshkit", "run"], {"A": "1"})
    op, back = protocol.decode_request(protocol.encode_request(protocol.StartRequest(job)))
    assert op == "start"
    assert back == protocol.StartRequest(job)
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


def test_a_state_is_checked_against_its_enum_and_read_as_its_member() -> None:
    result = {"state": "running", "exit_code": None, "started": None, "last_line": None}
    reply = protocol.decode_reply("status", json.dumps({"ok": True, "result": result}))
    assert reply.state is protocol.JobState.RUNNING
    assert '"state":"running"' in protocol.encode_reply(reply)  # on the wire: its string
    gave_up = protocol.Supervision(protocol.SupervisorState.GAVE_UP, 2, 0)
    request = protocol.SupervisorRequest("ab" * 8, "t", record=gave_up, version=1)
    assert '"supervisor":"gave up"' in protocol.encode_request(request)
    shown_only = {"supervisor": "not responding", "attempt": 1, "restarts_left": 0}
    args = {"job_id": "ab" * 8, "tmux_session": "t", "record": shown_only}
    line = json.dumps({"v": protocol.VERSION, "op": "supervisor", "args": args})
    with pytest.raises(protocol.ProtocolViolation, match=r"args\.record"):
        protocol.decode_request(line)
    with pytest.raises(protocol.ProtocolViolation, match="not one of running, relaunching"):
        record.build(protocol.Supervision, shown_only, "record")


def status_line(started: str) -> str:
    """A status reply as a node would send it, ``started`` spliced in as raw JSON text."""
    fields = f'"state":"running","exit_code":null,"started":{started},"last_line":null'
    return '{"ok":true,"result":{' + fields + "}}"


@pytest.mark.parametrize(
    ("started", "why"),
    [
        ("NaN", "not JSON: NaN is not a number JSON allows"),
        ("Infinity", "not JSON: Infinity is not a number JSON allows"),
        ("-Infinity", "not JSON: -Infinity is not a number JSON allows"),
        ("1e400", r"result\.started: inf is not a finite number"),  # json reads it as inf
        ("1" + "0" * 400, r"result\.started: inf is not a finite number"),
        ("1e300", r"result\.started: 1e\+300 is not a time"),
        ("-1e12", r"result\.started: -1000000000000.0 is not a time"),
        ("253402300800", r"result\.started: 253402300800.0 is not a time"),  # year 10000
    ],
)
def test_a_number_no_reader_could_use_is_a_protocol_violation(started: str, why: str) -> None:
    with pytest.raises(protocol.ProtocolViolation, match=why):
        protocol.decode_reply("status", status_line(started))


def test_every_wall_clock_field_is_held_to_times_and_any_float_to_finite_numbers() -> None:
    reply = protocol.decode_reply("status", status_line("1700000000.5"))
    assert isinstance(reply, protocol.StatusReply)
    assert reply.started == 1700000000.5
    assert protocol.decode_reply("status", status_line("0")).started == 0.0
    clocks = {"StatusReply.started", "FactsReply.clock", "RankError.time", "DiagnoseReply.clock"}
    clocks |= {"StatusReply.ended", "Event.time", "EventsRequest.since"}
    assert wall_clock_fields() == clocks
    error = {"rank": 0, "node_rank": 0, "time": -5, "error": "x", "traceback": []}
    with pytest.raises(record.Invalid, match=r"errors\[\]\.time: -5.0 is not a time"):
        record.build(protocol.RankError, error, "errors[]")
    idle = json.loads(status_line("null"))
    idle["result"]["idle"] = 1e300  # a duration: any finite number (the node's own clock)
    assert protocol.decode_reply("status", json.dumps(idle)).idle == 1e300


def wall_clock_fields() -> set[str]:
    """Every protocol field checked as a wall-clock time."""
    found = set()
    for cls in vars(protocol).values():
        if not (isinstance(cls, type) and record.is_record(cls)):
            continue
        for each, shape in record._fields_of(cls):
            options = shape.args if shape.tag == "union" else (shape,)
            if any(option.tag == "time" for option in options):
                found.add(f"{cls.__name__}.{each.name}")
    return found


def test_a_node_never_sends_what_json_does_not_allow() -> None:
    reply = protocol.StatusReply(protocol.JobState.RUNNING, None, None, None, float("nan"))
    with pytest.raises(protocol.ProtocolViolation, match="message not sent: Out of range float"):
        protocol.encode_reply(reply)


def test_records_first_used_by_many_threads_at_once_are_whole_in_each() -> None:
    """A record becomes a dataclass at its first use: the controller's threads decode their
    nodes' first replies at once, and each must get a whole record (equal, shown, frozen),
    never one half made. In a fresh interpreter, so that no record is made yet."""
    code = """
import dataclasses, json, threading
from meshkit import protocol

THREADS = 32
job = {"job_id": "j", "session": "s", "label": "l", "workdir": "/w", "tmux_session": "t",
       "argv": ["meshkit", "run"]}
lines = {
    "status": {"state": "running", "exit_code": None, "started": 1.0, "last_line": "x"},
    "ports": {"ports": [{"port": 1, "free": True}], "ours": False},
    "start": {"started": True, "state": "running", "replaced": [], "conflicts": [
        {"job_id": "j", "label": "l"}]},
}
barrier = threading.Barrier(THREADS)
results = {op: [] for op in lines}
failures = []

def decode():
    barrier.wait()
    try:
        for op, result in lines.items():
            reply = protocol.decode_reply(op, json.dumps({"ok": True, "result": result}))
            results[op].append((reply, repr(reply)))
            try:
                reply.__setattr__(next(iter(result)), None)
                failures.append(f"{op}: not frozen")
            except dataclasses.FrozenInstanceError:
                pass
        request = protocol.decode_request(json.dumps(
            {"v": protocol.VERSION, "op": "start", "args": {"job": job}}))[1]
        results.setdefault("request", []).append((request, repr(request)))
    except Exception as exc:
        failures.append(repr(exc))

threads = [threading.Thread(target=decode) for _ in range(THREADS)]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join()
assert not failures, failures
for op, got in results.items():
    assert len(got) == THREADS, op
    assert all(each == got[0][0] for each, _ in got), op
    assert len({shown for _, shown in got}) == 1, op
    assert "(" in got[0][1] and "=" in got[0][1], op
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
