"""Which host keys a node's sshd really serves, proven by sshd itself.

A ``/etc/ssh/ssh_host_*_key.pub`` proves nothing: sshd may not load it (no ``HostKey`` line), and
trusting it lets an impostor serving only that key pass StrictHostKeyChecking. The key the
controller's own connection was shown is proven by that connection; every other key type is
proven by a key-exchange-only handshake that offers sshd just that type (paramiko's
``get_security_options().key_types``): sshd must sign the exchange with it, and nobody logs in
(the transport is closed right after the key exchange).
"""

from __future__ import annotations

import contextlib

import paramiko

from ..keys import PublicKey
from .connection import Remote

# What paramiko offers for each public key type (RSA keys sign with the SHA-2 algorithms).
ALGORITHMS = {
    "ssh-ed25519": ("ssh-ed25519",),
    "ssh-rsa": ("rsa-sha2-512", "rsa-sha2-256"),
    "ecdsa-sha2-nistp256": ("ecdsa-sha2-nistp256",),
    "ecdsa-sha2-nistp384": ("ecdsa-sha2-nistp384",),
    "ecdsa-sha2-nistp521": ("ecdsa-sha2-nistp521",),
}


def served_key(remote: Remote, kind: str) -> PublicKey | None:
    """The ``kind`` host key this node's sshd signs a key exchange with, or None when it serves
    none of that type (or the type is one paramiko cannot negotiate)."""
    algorithms = ALGORITHMS.get(kind)
    if algorithms is None:
        return None
    try:
        sock = remote.key_probe_socket()
    except (OSError, paramiko.SSHException):
        return None  # no second route to sshd: the key stays unproven (and untrusted)
    if sock is None:
        return None
    transport = paramiko.Transport(sock)
    try:
        transport.banner_timeout = remote.settings.connect_timeout
        options = transport.get_security_options()
        try:
            options.key_types = algorithms
        except ValueError:
            return None  # an algorithm this paramiko lacks: the key stays unproven
        try:
            transport.start_client(timeout=remote.settings.connect_timeout)
        except (paramiko.SSHException, EOFError, OSError):
            return None  # no common host key algorithm: sshd serves no key of this type
        key = transport.get_remote_server_key()
        return PublicKey(key.get_name(), key.get_base64())
    finally:
        with contextlib.suppress(Exception):
            transport.close()
        with contextlib.suppress(Exception):
            sock.close()


def proven_host_keys(remote: Remote, claimed: list[PublicKey]) -> tuple[list[PublicKey], list[str]]:
    """The connection's own key, plus each claimed key (from /etc/ssh) that sshd proves it serves;
    and a note for each claimed key that it does not."""
    kind, blob = remote.server_key
    proven = [PublicKey(kind, blob)]
    notes = []
    for key in claimed:
        if (key.kind, key.blob) == (kind, blob) or any(k.kind == key.kind for k in proven):
            if not any(k.blob == key.blob for k in proven):
                notes.append(f"{key.kind} key {key.fingerprint()} in /etc/ssh is not served")
            continue
        got = served_key(remote, key.kind)
        if got is not None and got.blob == key.blob:
            proven.append(PublicKey(key.kind, key.blob))
        else:
            notes.append(
                f"{key.kind} key {key.fingerprint()} in /etc/ssh is not the one sshd serves; "
                "not trusted"
            )
    return proven, notes
