"""meshkit.record: every record annotation parses, and bytes from a node are checked field by field."""

import json

import pytest

from meshkit import protocol


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
