import base64
import hashlib
import hmac
import struct

import pytest

from meshkit import keys
from meshkit.hostfile import Host
from meshkit.keys import (
    KeyFormatError,
    PublicKey,
    merge_authorized,
    merge_known_hosts,
    parse_public_key,
    remove_tagged,
)
from meshkit.mesh import NodeFacts, parse_verify, placeholder_key, plan, verify_script


def make_key(kind: str = "ssh-ed25519", seed: str = "a", comment: str = "c") -> PublicKey:
    raw = (
        struct.pack(">I", len(kind))
        + kind.encode()
        + struct.pack(">I", 32)
        + hashlib.sha256(seed.encode()).digest()
    )
    return PublicKey(kind, base64.b64encode(raw).decode(), comment)


def line(k: PublicKey) -> str:
    return f"{k.kind} {k.blob} {k.comment}"


def test_parse_validates_type_and_blob():
    k = make_key(comment="$(rm -rf /) `x`")
    assert parse_public_key(line(k)) == k
    with pytest.raises(KeyFormatError, match="unknown key type"):
        parse_public_key("ssh-evil AAAA x")
    with pytest.raises(KeyFormatError, match="not base64"):
        parse_public_key("ssh-ed25519 $(reboot) x")
    with pytest.raises(KeyFormatError, match="its data is 'ssh-rsa'"):
        parse_public_key(f"ssh-ed25519 {make_key('ssh-rsa').blob}")
    with pytest.raises(KeyFormatError, match="expected 'type base64-key"):
        parse_public_key("ssh-ed25519")
    assert k.fingerprint().startswith("SHA256:")


def test_merge_authorized_keeps_lines_dedups_and_is_idempotent():
    a, b = make_key(seed="a"), make_key(seed="b")
    existing = f'# admin\nno-pty,command="echo hi there" {line(a)}\n'
    text, added = merge_authorized(existing, [("n0", a), ("n1", b), ("n2", b)])
    assert text.startswith(existing) and added == [f"{b.kind} {b.blob} meshkit:n1"]
    assert merge_authorized(text, [("n0", a), ("n1", b)]) == (text, [])
    assert "$(" not in merge_authorized("", [("n0", make_key(comment="$(x)"))])[0]
    text, _ = merge_authorized("no newline at end", [("n1", b)])
    assert text == f"no newline at end\n{b.kind} {b.blob} meshkit:n1\n"


def test_merge_known_hosts_names_hashed_and_conflicts():
    k, other = make_key(seed="host"), make_key(seed="other")
    salt = b"0123456789abcdef0123"
    digest = hmac.new(salt, b"10.0.0.1", hashlib.sha1).digest()
    hashed = f"|1|{base64.b64encode(salt).decode()}|{base64.b64encode(digest).decode()} {k.kind} {k.blob}\n"
    text, added, conflicts = merge_known_hosts(hashed, [(["10.0.0.1", "node1"], k)])
    assert (
        added == [f"node1 {k.kind} {k.blob} meshkit"] and not conflicts and text.startswith(hashed)
    )
    assert merge_known_hosts(text, [(["10.0.0.1", "node1"], k)])[1] == []
    _, added, conflicts = merge_known_hosts(f"node1 {other.kind} {other.blob}\n", [(["node1"], k)])
    assert added == [] and conflicts[0].name == "node1" and conflicts[0].lineno == 1
    assert "ssh-keygen -R 'node1'" in conflicts[0].describe("n0")


def test_remove_tagged_removes_exactly_ours():
    a, b = make_key(seed="a"), make_key(seed="b")
    original = f"# keep\n{line(a)}\n\n"
    text, _ = merge_authorized(original, [("n1", b)])
    assert remove_tagged(text, known_hosts=False) == (original, 1)
    known, _, _ = merge_known_hosts(original, [(["h"], b)])
    assert remove_tagged(known, known_hosts=True) == (original, 1)
    assert remove_tagged(f"{line(a)} meshkit\n", known_hosts=False)[1] == 0


def test_parse_inspection_prefers_first_user_key_and_needs_host_keys():
    u1, u2, h = (
        make_key(seed="u1", comment="meshkit-generated@n1"),
        make_key(seed="u2"),
        make_key(seed="h"),
    )
    got = keys.parse_inspection(
        f"userkey {line(u1)}\nuserkey {line(u2)}\nhostkey {line(h)}\n", "n1"
    )
    assert got.user_key == u1 and got.host_keys == (h,) and got.generated
    with pytest.raises(KeyFormatError, match="no readable /etc/ssh"):
        keys.parse_inspection(f"userkey {line(u1)}\n", "n1")


def test_plan_every_node_gets_every_key_under_every_name():
    hosts = [Host("node0"), Host("10.0.0.2", port=2222)]
    facts = [
        NodeFacts(
            hosts[0], keys.Inspection(make_key(seed="u0"), (make_key(seed="h0"),), False), "", None
        ),
        NodeFacts(hosts[1], keys.Inspection(None, (make_key(seed="h1"),), False), None, None),
    ]
    plans = plan(facts, {"node0": ["10.0.0.1"], "10.0.0.2": ["10.0.0.2"]})
    assert plans[hosts[1]].generate_key and not plans[hosts[0]].generate_key
    assert len(plans[hosts[1]].authorized_added) == 1
    known = plans[hosts[0]].known_added
    assert known[0].startswith("node0,10.0.0.1 ") and known[1].startswith("[10.0.0.2]:2222 ")
    assert placeholder_key(hosts[0]) != placeholder_key(hosts[1])
    parse_public_key(line(placeholder_key(hosts[0])))  # well-formed


def test_verify_script_quotes_hosts_and_parses_results():
    hosts = [Host("a"), Host("b", user="u", port=2200), Host("c")]
    script = verify_script(hosts, 5, start=1)
    assert "-p 2200 -l u -- b true" in script
    assert script.index("-- b true") < script.index("-- c true") < script.index("-- a true")
    out = "ok 0\nfail 1 Permission denied (publickey).\n"
    failures = parse_verify(hosts[0], hosts, out)
    assert [(f.target.host, f.error) for f in failures] == [
        ("b", "Permission denied (publickey)."),
        ("c", "no result"),
    ]
