"""meshkit.record: every record annotation parses, and bytes from a node are checked field by
field."""

import json

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
