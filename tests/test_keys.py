import base64
import hashlib
import hmac
import struct

import pytest

from meshkit import keys
from meshkit.keys import (
    KeyFormatError,
    PublicKey,
    merge_authorized,
    merge_known_hosts,
    parse_public_key,
    remove_tagged,
)


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
    m = merge_authorized(existing, [("n0", a), ("n1", b), ("n2", b)])
    assert m.text.startswith(existing)
    assert m.added == [f"{b.kind} {b.blob} meshkit:n1"]
    again = merge_authorized(m.text, [("n0", a), ("n1", b)])
    assert (again.text, again.added, again.changed) == (m.text, [], False)
    assert "$(" not in merge_authorized("", [("n0", make_key(comment="$(x)"))]).text
    m = merge_authorized("no newline at end", [("n1", b)])
    assert m.text == f"no newline at end\n{b.kind} {b.blob} meshkit:n1\n"


def test_merge_known_hosts_names_hashed_and_conflicts():
    k, other = make_key(seed="host"), make_key(seed="other")
    salt = b"0123456789abcdef0123"
    digest = hmac.new(salt, b"10.0.0.1", hashlib.sha1).digest()
    salt_text = base64.b64encode(salt).decode()
    digest_text = base64.b64encode(digest).decode()
    hashed = f"|1|{salt_text}|{digest_text} {k.kind} {k.blob}\n"
    m = merge_known_hosts(hashed, [(["10.0.0.1", "node1"], k)])
    assert m.added == [f"node1 {k.kind} {k.blob} meshkit"]
    assert not m.conflicts
    assert m.text.startswith(hashed)
    assert merge_known_hosts(m.text, [(["10.0.0.1", "node1"], k)]).added == []
    m = merge_known_hosts(f"node1 {other.kind} {other.blob}\n", [(["node1"], k)])
    conflicts = m.conflicts
    assert m.added == []
    assert conflicts[0].name == "node1"
    assert conflicts[0].lineno == 1
    assert "ssh-keygen -R 'node1'" in conflicts[0].describe("n0")


def test_remove_tagged_removes_exactly_ours():
    a, b = make_key(seed="a"), make_key(seed="b")
    original = f"# keep\n{line(a)}\n\n"
    text = merge_authorized(original, [("n1", b)]).text
    assert remove_tagged(text, known_hosts=False) == (original, 1)
    known = merge_known_hosts(original, [(["h"], b)]).text
    assert remove_tagged(known, known_hosts=True) == (original, 1)
    assert remove_tagged(f"{line(a)} meshkit\n", known_hosts=False)[1] == 0


def test_two_meshes_share_a_line_and_unmesh_takes_only_its_own_tag():
    a, b, h = make_key(seed="a"), make_key(seed="b"), make_key(seed="h")
    admin = f"{line(a)}\n"
    one = merge_authorized(admin, [("n1", b)], "mesha")
    assert one.added == [f"{b.kind} {b.blob} meshkit:n1 mesh=mesha"]
    two = merge_authorized(one.text, [("n1", b), ("n0", a)], "meshb")
    assert two.added == []
    assert two.claimed == 1  # the admin's line for a is not claimed
    assert "meshkit:n1 mesh=mesha,meshb" in two.text
    assert two.text.startswith(admin)
    assert keys.listed_by_others(two.text, b, "mesha")
    text, n = remove_tagged(two.text, known_hosts=False, mesh_id="mesha")
    assert n == 1
    assert "meshkit:n1 mesh=meshb" in text
    assert not keys.listed_by_others(text, b, "meshb")
    assert remove_tagged(text, known_hosts=False, mesh_id="meshb") == (admin, 1)
    kh = merge_known_hosts("", [(["n1", "10.0.0.1"], h)], "mesha")
    kh2 = merge_known_hosts(kh.text, [(["n1"], h)], "meshb")
    assert kh2.added == []
    assert kh2.claimed == 1
    assert "meshkit mesh=mesha,meshb" in kh2.text
    assert merge_known_hosts(kh2.text, [(["n1"], h)], "meshb").changed is False
    assert remove_tagged(kh2.text, known_hosts=True, mesh_id="meshb")[0] == kh.text
    # lines from before mesh ids belong to whoever unmeshes
    assert remove_tagged(f"n1 {h.kind} {h.blob} meshkit\n", True, "mesha") == ("", 1)
