"""Served host keys proven in the connection (hostkeys-prove-00@openssh.com), and the fallback
(one key-exchange-only handshake per key type) when sshd does not prove them, against a paramiko
SSH server on loopback that serves ed25519, ecdsa and RSA host keys and, by mode, announces and
proves them, announces but refuses to prove, says nothing, forges proofs (not over this
session), or signs the RSA key with SHA-1 (ssh-rsa)."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import paramiko
import pytest

from meshkit.hostfile import Host
from meshkit.keys import PublicKey
from meshkit.remote import Remote, Settings, ssh_config
from meshkit.remote.hostkeys import FALLBACK, IN_CONNECTION, PROVE, proven_host_keys

HOSTKEYS = "hostkeys-00@openssh.com"


class NodeTransport(paramiko.Transport):
    """sshd's side: right after authentication succeeds, announce the host keys (as OpenSSH's
    notify_hostkeys does), unless the mode says nothing."""

    mode = "prove"
    keys: tuple[paramiko.PKey, ...] = ()

    def _auth_trigger(self) -> None:  # type: ignore[override]
        super()._auth_trigger()  # type: ignore[misc]
        if self.mode != "silent":
            m = paramiko.Message()
            m.add_byte(paramiko.common.cMSG_GLOBAL_REQUEST)
            m.add_string(HOSTKEYS)
            m.add_boolean(False)
            for key in self.keys:
                m.add_string(key.asbytes())
            self._send_message(m)  # type: ignore[attr-defined]


class Node(paramiko.ServerInterface):
    def __init__(self, transport: NodeTransport, keys: list[paramiko.PKey]) -> None:
        self.transport, self.keys = transport, keys

    def get_allowed_auths(self, username: str) -> str:
        return "password"

    def check_auth_password(self, username: str, password: str) -> int:
        return paramiko.AUTH_SUCCESSFUL if password == "pw" else paramiko.AUTH_FAILED

    def check_global_request(self, kind: str, msg: paramiko.Message) -> bool | tuple[bytes, ...]:
        if kind != PROVE or self.transport.mode in ("refuse", "silent"):
            return False
        sigs = []
        while msg.get_remainder():
            blob = msg.get_binary()
            key = next(k for k in self.keys if k.asbytes() == blob)
            data = paramiko.Message()
            data.add_string(PROVE)
            if self.transport.mode != "forge" or key.get_name() == "ssh-ed25519":
                data.add_string(self.transport.session_id)  # a forged proof leaves it out
            data.add_string(blob)
            if key.get_name() != "ssh-rsa":
                sigs.append(key.sign_ssh_data(data.asbytes()).asbytes())
                continue
            sig = key.sign_ssh_data(data.asbytes(), "rsa-sha2-512")
            if self.transport.mode == "sha1":  # named ssh-rsa (SHA-1), which must be refused
                sig.get_text()
                named = paramiko.Message()
                named.add_string("ssh-rsa")
                named.add_string(sig.get_binary())
                sig = named
            sigs.append(sig.asbytes())
        return tuple(sigs)


def keygen(path: Path, kind: str) -> paramiko.PKey:
    size = ["-b", "2048"] if kind == "rsa" else []
    subprocess.run(["ssh-keygen", "-q", "-t", kind, *size, "-N", "", "-f", str(path)], check=True)
    cls = {"ed25519": paramiko.Ed25519Key, "ecdsa": paramiko.ECDSAKey, "rsa": paramiko.RSAKey}
    return cls[kind].from_private_key_file(str(path))


@pytest.fixture
def node(tmp_path: Path) -> Iterator[tuple[socket.socket, list[paramiko.PKey]]]:
    keys = [keygen(tmp_path / k, k) for k in ("ed25519", "ecdsa", "rsa")]
    listener = socket.create_server(("127.0.0.1", 0))
    transports: list[paramiko.Transport] = []

    def handshake(sock: socket.socket) -> None:
        t = NodeTransport(sock)
        t.keys = tuple(keys)
        for key in keys:
            t.add_server_key(key)
        transports.append(t)
        # A client that hangs up mid-handshake (a probe offering a key type this node lacks, or
        # one that gave up under load) ends only its own connection, never the server.
        with contextlib.suppress(paramiko.SSHException, EOFError, OSError):
            t.start_server(server=Node(t, keys))

    def serve() -> None:
        while True:
            try:
                sock, _ = listener.accept()
            except OSError:
                return
            # One thread per connection, as sshd forks one per connection: a slow handshake
            # must not hold up the next probe behind it.
            threading.Thread(target=handshake, args=(sock,), daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    yield listener, keys
    listener.close()
    for t in transports:
        t.close()


def connect(tmp_path: Path, listener: socket.socket, keys: list[paramiko.PKey]) -> Remote:
    port = listener.getsockname()[1]
    known = tmp_path / "known_hosts"
    known.write_text(f"[127.0.0.1]:{port} ssh-ed25519 {keys[0].get_base64()}\n")
    conf = tmp_path / "ssh_config"
    conf.write_text(f"Host 127.0.0.1\n  UserKnownHostsFile {known}\n  IdentitiesOnly yes\n")
    settings = Settings(connect_timeout=5, password="pw", user="u", ssh_configs=(str(conf),))
    remote = Remote(Host("127.0.0.1", port=port), settings, ssh_config([str(conf)]))
    remote.conn.connect_kwargs.update(allow_agent=False, look_for_keys=False)
    return remote.open()


def public(key: paramiko.PKey) -> PublicKey:
    return PublicKey(key.get_name(), key.get_base64())


@pytest.mark.parametrize("mode", ["prove", "refuse", "silent", "forge", "sha1"])
def test_served_host_keys_are_proven_in_the_connection_or_by_the_fallback(node, tmp_path, mode):
    listener, keys = node
    NodeTransport.mode = mode
    remote = connect(tmp_path, listener, keys)
    stray = keygen(tmp_path / "stray", "ecdsa")  # in /etc/ssh, but never served
    try:
        with remote.bounded("inspect", 10):
            proven, notes, how = proven_host_keys(remote, [*map(public, keys[1:]), public(stray)])
    finally:
        remote.close()
    assert how == (IN_CONNECTION if mode in ("prove", "forge", "sha1") else FALLBACK)
    blobs = {k.blob for k in proven}
    assert public(keys[0]).blob in blobs  # the connection's own key
    assert public(stray).blob not in blobs
    assert any(public(stray).fingerprint() in n and "not trusted" in n for n in notes), notes
    ecdsa, rsa = public(keys[1]).blob, public(keys[2]).blob
    if mode == "forge":  # announced, but its signature does not cover this session: never trusted
        assert ecdsa not in blobs
        assert rsa not in blobs
        assert sum("does not verify; not trusted" in n for n in notes) == 2, notes
    elif mode == "sha1":
        assert ecdsa in blobs
        assert rsa not in blobs
        assert any("(ssh-rsa) does not verify; not trusted" in n for n in notes), notes
    else:
        assert ecdsa in blobs, notes
        assert rsa in blobs, notes


def test_the_mesh_output_says_which_nodes_proved_their_keys_how(capsys):
    from meshkit.cli.tasks.mesh import _show
    from meshkit.ops.mesh import MeshReport

    a, b, c = Host("a"), Host("b"), Host("c")
    report = MeshReport([a, b, c], "0123456789", False)
    report.host_keys_by = {a: IN_CONNECTION, b: FALLBACK, c: IN_CONNECTION}
    _show(report)
    out = capsys.readouterr().out
    assert f"host keys {IN_CONNECTION}: a, c" in out
    assert f"host keys {FALLBACK}: b" in out
