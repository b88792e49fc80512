"""authorized_keys and known_hosts as data: parse, validate, merge, tag, untag. Pure: text in, text
out. Remote text (key comments included) is data, never shell: only validated key types and base64
blobs are copied into new lines, with comments that meshkit writes itself."""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import re
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from .errors import KeyFormatError

KEY_TYPES = frozenset(
    {
        "ssh-ed25519",
        "ssh-rsa",
        "ecdsa-sha2-nistp256",
        "ecdsa-sha2-nistp384",
        "ecdsa-sha2-nistp521",
        "sk-ssh-ed25519@openssh.com",
        "sk-ecdsa-sha2-nistp256@openssh.com",
    }
)
USER_KEY_TYPES = (
    "ssh-ed25519",
    "ssh-rsa",
    "ecdsa-sha2-nistp256",
    "ecdsa-sha2-nistp384",
    "ecdsa-sha2-nistp521",
)
AUTHORIZED_TAG = "meshkit:"  # comment prefix of authorized_keys lines mesh adds: "meshkit:<node>"
KNOWN_TAG = "meshkit"  # comment of known_hosts lines mesh adds
GENERATED_COMMENT = "meshkit-generated@"  # comment of user keys mesh creates
MAX_BLOB_CHARS = 16384
_LABEL = re.compile(r"^[A-Za-z0-9_.:\[\]@-]{1,300}$")


@dataclass(frozen=True)
class PublicKey:
    kind: str
    blob: str
    comment: str = ""

    def fingerprint(self) -> str:
        """OpenSSH's SHA256 fingerprint."""
        digest = hashlib.sha256(base64.b64decode(self.blob)).digest()
        return "SHA256:" + base64.b64encode(digest).decode().rstrip("=")


def parse_public_key(line: str, where: str = "key") -> PublicKey:
    """``type base64 [comment]``, validated: a known type whose blob decodes and names that type."""
    parts = line.strip().split(None, 2)
    if len(parts) < 2:
        raise KeyFormatError(
            f"{where}: expected 'type base64-key [comment]', got {line.strip()[:80]!r}"
        )
    kind, blob = parts[0], parts[1]
    if kind not in KEY_TYPES:
        raise KeyFormatError(f"{where}: unknown key type {kind[:40]!r}")
    if len(blob) > MAX_BLOB_CHARS or not re.fullmatch(r"[A-Za-z0-9+/]+={0,2}", blob):
        raise KeyFormatError(f"{where}: the {kind} key is not base64")
    try:
        raw = base64.b64decode(blob, validate=True)
        (size,) = struct.unpack(">I", raw[:4])
        embedded = raw[4 : 4 + size].decode("ascii")
    except (binascii.Error, struct.error, UnicodeDecodeError):
        raise KeyFormatError(f"{where}: the {kind} key does not decode") from None
    if embedded != kind:
        raise KeyFormatError(f"{where}: the key says {kind} but its data is {embedded[:40]!r}")
    return PublicKey(kind, blob, parts[2].strip() if len(parts) > 2 else "")


def _key_fields(line: str) -> tuple[list[str], int] | None:
    """Split a key line and find where its key type is (options or host patterns come before it)."""
    text = line.strip()
    if not text or text.startswith("#"):
        return None
    fields = _split_quoted(text)
    for i, f in enumerate(fields[:-1]):
        if f in KEY_TYPES:
            return fields, i
    return None


def _split_quoted(text: str) -> list[str]:
    """Whitespace split that keeps double-quoted option values (command="a b") whole."""
    return re.findall(r'(?:[^\s"]+|"(?:\\.|[^"\\])*")+', text)


def _comment(fields: list[str], at: int) -> str:
    return " ".join(fields[at + 2 :])


def check_label(label: str) -> str:
    if not _LABEL.match(label):
        raise KeyFormatError(f"node name {label[:60]!r} cannot be used in a key comment")
    return label


def _join(existing: str, lines: Sequence[str]) -> str:
    if not lines:
        return existing
    sep = "" if not existing or existing.endswith("\n") else "\n"
    return existing + sep + "".join(line + "\n" for line in lines)


def merge_authorized(existing: str, keys: Iterable[tuple[str, PublicKey]]) -> tuple[str, list[str]]:
    """Add each ``(node label, key)`` whose key is not already authorized (under any options or
    comment). Existing lines are kept byte for byte. Returns the new text and the lines added."""
    present = set()
    for line in existing.splitlines():
        found = _key_fields(line)
        if found:
            fields, at = found
            present.add(fields[at + 1])
    added = []
    for label, key in keys:
        if key.blob not in present:
            present.add(key.blob)
            added.append(f"{key.kind} {key.blob} {AUTHORIZED_TAG}{check_label(label)}")
    return _join(existing, added), added


def _hashed_match(pattern: str, name: str) -> bool:
    """OpenSSH HashKnownHosts entries: ``|1|base64(salt)|base64(hmac-sha1(salt, name))``."""
    try:
        _, magic, salt, digest = pattern.split("|")
        if magic != "1":
            return False
        mac = hmac.new(base64.b64decode(salt), name.encode(), hashlib.sha1).digest()
        return hmac.compare_digest(base64.b64encode(mac).decode(), digest)
    except (ValueError, binascii.Error):
        return False


def _names_match(patterns: str, name: str) -> bool:
    return any(
        _hashed_match(p, name) if p.startswith("|") else p.lower() == name.lower()
        for p in patterns.split(",")
    )


@dataclass(frozen=True)
class Conflict:
    name: str
    kind: str
    lineno: int

    def describe(self, node: str) -> str:
        return (
            f"{node}: known_hosts line {self.lineno} has a different {self.kind} key for {self.name} "
            f"(reinstalled node?); check it, then remove it on {node} with: ssh-keygen -R {self.name!r}"
        )


def merge_known_hosts(
    existing: str, entries: Iterable[tuple[Sequence[str], PublicKey]]
) -> tuple[str, list[str], list[Conflict]]:
    """Add a line for each host key under every name not already covered (plain or hashed).
    A name already listed with a *different* key of the same type is a conflict, never overwritten."""
    known = []
    for lineno, line in enumerate(existing.splitlines(), 1):
        found = _key_fields(line)
        if found and not found[0][0].startswith("@") and found[1] == 1:
            fields = found[0]
            known.append((fields[0], fields[1], fields[2], lineno))
    added, conflicts = [], []
    for names, key in entries:
        missing = []
        for name in names:
            same = [k for k in known if k[1] == key.kind and _names_match(k[0], name)]
            if any(k[2] == key.blob for k in same):
                continue
            if same:
                conflicts.append(Conflict(name, key.kind, same[0][3]))
                continue
            missing.append(check_label(name))
        if missing:
            line = f"{','.join(missing)} {key.kind} {key.blob} {KNOWN_TAG}"
            added.append(line)
            known.append((",".join(missing), key.kind, key.blob, 0))
    return _join(existing, added), added, conflicts


def remove_tagged(existing: str, known_hosts: bool) -> tuple[str, int]:
    """Drop exactly the lines mesh added (by their tag); every other line is kept byte for byte."""
    kept, removed = [], 0
    for line in existing.splitlines(keepends=True):
        found = _key_fields(line)
        if found:
            comment = _comment(*found)
            ours = comment == KNOWN_TAG if known_hosts else comment.startswith(AUTHORIZED_TAG)
            if ours:
                removed += 1
                continue
        kept.append(line)
    return "".join(kept), removed


@dataclass(frozen=True)
class Inspection:
    """What a node told us about itself (see mesh.INSPECT)."""

    user_key: PublicKey | None
    host_keys: tuple[PublicKey, ...]
    generated: bool  # the user key is one that mesh created


def parse_inspection(text: str, node: str) -> Inspection:
    """Lines ``userkey <pub line>`` (first one wins, in preference order) and ``hostkey <pub line>``."""
    user_key, host_keys = None, []
    for raw in text.splitlines():
        tag, _, rest = raw.partition(" ")
        if tag == "userkey" and user_key is None:
            user_key = parse_public_key(rest, f"{node}: ~/.ssh user key")
        elif tag == "hostkey":
            host_keys.append(parse_public_key(rest, f"{node}: /etc/ssh host key"))
    if not host_keys:
        raise KeyFormatError(
            f"{node}: no readable /etc/ssh/ssh_host_*_key.pub; is this an OpenSSH server?"
        )
    generated = user_key is not None and user_key.comment.startswith(GENERATED_COMMENT)
    return Inspection(user_key, tuple(host_keys), generated)
