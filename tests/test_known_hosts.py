"""A command reads each known_hosts file once, and every node's connection finds in it exactly
the keys that adding the whole file would give it."""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
import subprocess
from pathlib import Path

import paramiko

from meshkit.remote.connection import read_known_hosts


def public_line(names: str, key: paramiko.PKey) -> str:
    return f"{names} {key.get_name()} {key.get_base64()}\n"


def hashed(name: str) -> str:
    """OpenSSH's HashKnownHosts form of ``name`` (``|1|salt|hmac``)."""
    salt = os.urandom(20)
    digest = hmac.new(salt, name.encode(), hashlib.sha1).digest()
    return f"|1|{base64.b64encode(salt).decode()}|{base64.b64encode(digest).decode()}"


def test_each_node_finds_what_the_whole_file_gives_it_and_the_file_is_parsed_once(tmp_path):
    keys = [paramiko.Ed25519Key.from_private_key_file(make_key(tmp_path, i)) for i in range(4)]
    ecdsa = paramiko.ECDSAKey.generate()
    path = tmp_path / "known_hosts"
    path.write_text(
        "# a comment, then a line paramiko cannot read\n"
        "@cert-authority *.example.org ssh-ed25519 AAAA\n"
        + public_line("node0,10.0.0.1", keys[0])
        + public_line("node1", keys[1])
        + public_line("[node2]:2222", keys[2])
        + public_line(hashed("node3"), keys[3])
        + public_line("node0", ecdsa)  # a second type for node0: the file's order is kept
        + public_line("node1", keys[3])  # a later line for the same type wins
        + f"@revoked * ssh-ed25519 {keys[2].get_base64()}\n"
    )
    whole = paramiko.HostKeys()  # every name of every line added, as each node had it
    for line in path.read_text().splitlines():
        if line.startswith(("#", "@")):
            continue
        entry = paramiko.hostkeys.HostKeyEntry.from_line(line)
        for name in entry.hostnames:
            whole.add(name, entry.key.get_name(), entry.key)
    known = read_known_hosts(str(path))
    for name in ("node0", "10.0.0.1", "node1", "[node2]:2222", "node2", "node3", "other"):
        own = paramiko.HostKeys()
        known.add_to(own, name)
        expected = whole.lookup(name)
        found = own.lookup(name)
        if expected is None:
            assert found is None, name
            continue
        assert found is not None, name
        assert list(found.keys()) == list(expected.keys()), name
        for kind in expected:
            assert found[kind] == expected[kind], (name, kind)
        # only that node's lines (and hashed ones, which may be anyone's) are added
        assert len(own.keys()) <= 2 + len(known.hashed), name
    assert known.revoked == {("ssh-ed25519", keys[2].get_base64())}
    assert read_known_hosts(str(path)) is known  # unchanged: not parsed again
    with path.open("a") as handle:
        handle.write(public_line("node9", keys[0]))
    again = read_known_hosts(str(path))
    assert again is not known
    own = paramiko.HostKeys()
    again.add_to(own, "node9")
    assert own.lookup("node9") is not None
    assert read_known_hosts(str(tmp_path / "absent")).lines == ()


def make_key(directory: Path, index: int) -> str:
    """An ed25519 key from ssh-keygen (paramiko cannot generate one)."""
    path = directory / f"key{index}"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(path)], check=True)
    return str(path)
