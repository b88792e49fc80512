"""Which host keys a node's sshd really serves, proven by sshd itself.

A ``/etc/ssh/ssh_host_*_key.pub`` proves nothing: sshd may not load it, and trusting it lets an
impostor serving only that key pass StrictHostKeyChecking. The connection's own key is proven by
its key exchange; the others inside the same connection, as OpenSSH's ``UpdateHostKeys`` does
(PROTOCOL, "Host key rotation"): sshd announces its keys (``hostkeys-00@openssh.com``) and, on
request (``hostkeys-prove-00@openssh.com``), signs each with this session's id; a key whose
signature does not verify is not trusted. Only when sshd announces nothing or refuses to prove
(older than OpenSSH 6.8, or not OpenSSH) does each claimed key type get a key-exchange-only
handshake offering sshd just that type, so that it must sign the exchange with it (no login).
"""

from __future__ import annotations

import base64
import contextlib

import paramiko

from ..keys import ECDSA, PublicKey
from .connection import Remote

PROVE = "hostkeys-prove-00@openssh.com"
IN_CONNECTION = "proven in the connection (hostkeys-prove-00@openssh.com)"
FALLBACK = "proven by one key exchange per key type (sshd did not prove them in the connection)"

# What paramiko offers for each public key type (RSA keys sign with the SHA-2 algorithms).
ALGORITHMS: dict[str, tuple[str, ...]] = {k: (k,) for k in ("ssh-ed25519", *ECDSA)}
ALGORITHMS["ssh-rsa"] = ("rsa-sha2-512", "rsa-sha2-256")


def served_key(remote: Remote, kind: str) -> PublicKey | None:
    """The ``kind`` host key this node's sshd signs a key exchange with, or None when it serves
    none of that type, or when it cannot be asked (then the key stays unproven, and untrusted)."""
    algorithms = ALGORITHMS.get(kind, ())
    try:
        sock = remote.key_probe_socket() if algorithms else None
    except (OSError, paramiko.SSHException):
        return None  # no second route to sshd
    if sock is None:
        return None
    transport = paramiko.Transport(sock)
    try:
        transport.banner_timeout = remote.settings.connect_timeout
        transport.get_security_options().key_types = algorithms
        transport.start_client(timeout=remote.settings.connect_timeout)
        key = transport.get_remote_server_key()
        return PublicKey(key.get_name(), key.get_base64())
    except (ValueError, paramiko.SSHException, EOFError, OSError):
        return None  # an algorithm this paramiko lacks, or no common one: sshd serves no such key
    finally:
        with contextlib.suppress(Exception):
            transport.close()
        with contextlib.suppress(Exception):
            sock.close()


def prove_in_connection(remote: Remote) -> tuple[list[PublicKey], list[str]] | None:
    """The keys sshd announced whose signature over (request name, session id, key) verifies,
    and a note for each that did not; None when sshd announced none or refused to prove them."""
    blobs = remote.announced_host_keys() or []
    reply = remote.global_request(PROVE, blobs) if blobs else None
    if reply is None:
        return None
    proven: list[PublicKey] = []
    notes: list[str] = []
    for blob in blobs:
        signature = reply.get_binary() if reply.get_remainder() else b""
        try:
            kind = paramiko.Message(blob).get_text()
            key = paramiko.PKey.from_type_string(kind, blob)
        except Exception:  # a key type this paramiko cannot check (security keys, certificates)
            notes.append("sshd announced a host key of a type meshkit cannot check; not trusted")
            continue
        public = PublicKey(kind, base64.b64encode(blob).decode())
        signed = paramiko.Message()
        for part in (PROVE, remote.session_id, blob):
            signed.add_string(part)
        algorithm = paramiko.Message(signature).get_text() if signature else ""
        try:
            ok = algorithm in ALGORITHMS.get(kind, ()) and bool(
                key.verify_ssh_sig(signed.asbytes(), paramiko.Message(signature))
            )
        except Exception:
            ok = False
        if ok:
            proven.append(public)
        else:
            notes.append(
                f"{kind} key {public.fingerprint()}: sshd's proof ({algorithm or 'none'}) does not "
                "verify; not trusted"
            )
    return proven, notes


def proven_host_keys(
    remote: Remote, claimed: list[PublicKey]
) -> tuple[list[PublicKey], list[str], str]:
    """The connection's own key and the keys sshd proves it serves (in the connection, or by the
    fallback handshakes, one per claimed type not yet proven); a note for each claimed key (from
    /etc/ssh) that it does not serve; and how they were proven (IN_CONNECTION or FALLBACK)."""
    kind, blob = remote.server_key
    proven = [PublicKey(kind, blob)]
    found = prove_in_connection(remote)
    if found is not None:
        proven_in_connection, notes = found
        proven += [key for key in proven_in_connection if key.blob != blob]
        how = IN_CONNECTION
    else:
        notes = []
        how = FALLBACK
        for key in claimed:
            if not any(known.kind == key.kind for known in proven):
                got = served_key(remote, key.kind)
                if got is not None and got.blob == key.blob:
                    proven.append(PublicKey(key.kind, key.blob))
    served = {key.blob for key in proven}
    for key in claimed:
        if key.blob not in served:
            notes.append(
                f"{key.kind} key {key.fingerprint()} in /etc/ssh is not the one sshd serves; "
                "not trusted"
            )
    return proven, notes, how
