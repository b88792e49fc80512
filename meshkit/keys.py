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
from typing import NamedTuple

from .errors import KeyFormatError
from .record import record

ECDSA = ("ecdsa-sha2-nistp256", "ecdsa-sha2-nistp384", "ecdsa-sha2-nistp521")
_SECURITY_KEYS = ("sk-ssh-ed25519@openssh.com", "sk-ecdsa-sha2-nistp256@openssh.com")
KEY_TYPES = frozenset(("ssh-ed25519", "ssh-rsa", *ECDSA, *_SECURITY_KEYS))
AUTHORIZED_TAG = "meshkit:"  # comment prefix of authorized_keys lines mesh adds: "meshkit:<node>"
KNOWN_TAG = "meshkit"  # comment of known_hosts lines mesh adds
MESH_FIELD = "mesh="  # after the tag: the meshes (ids derived from hostfiles) that rely on the line
GENERATED_COMMENT = "meshkit-generated@"  # comment of user keys mesh creates
MAX_BLOB_CHARS = 16384
_LABEL = re.compile(r"^[A-Za-z0-9_.:\[\]@-]{1,300}$")


@record
class PublicKey:
    kind: str
    blob: str
    comment: str = ""

    def fingerprint(self) -> str:  # OpenSSH's SHA256 fingerprint
        digest = hashlib.sha256(base64.b64decode(self.blob)).digest()
        return "SHA256:" + base64.b64encode(digest).decode().rstrip("=")


def parse_public_key(line: str, where: str = "key") -> PublicKey:
    """``type base64 [comment]``, validated: a known type whose blob decodes and names that type."""
    parts = line.strip().split(None, 2)
    if len(parts) < 2:
        raise KeyFormatError(
            f"{where}: expected 'type base64-key [comment]', got {line.strip()[:80]!r}"
        )
    kind = parts[0]
    blob = parts[1]
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
    comment = parts[2].strip() if len(parts) > 2 else ""
    return PublicKey(kind, blob, comment)


def _key_fields(line: str) -> tuple[list[str], int] | None:
    """Split a key line and find where its key type is (options or host patterns come before it)."""
    text = line.strip()
    if not text or text.startswith("#"):
        return None
    fields = _split_quoted(text)
    for index, field in enumerate(fields[:-1]):
        if field in KEY_TYPES:
            return fields, index
    return None


def _split_quoted(text: str) -> list[str]:
    """Whitespace split that keeps double-quoted option values (command="a b") whole."""
    return re.findall(r'(?:[^\s"]+|"(?:\\.|[^"\\])*")+', text)


def check_label(label: str) -> str:
    if not _LABEL.match(label):
        raise KeyFormatError(f"node name {label[:60]!r} cannot be used in a key comment")
    return label


def _join(existing: str, lines: Sequence[str]) -> str:
    if not lines:
        return existing
    sep = "" if not existing or existing.endswith("\n") else "\n"
    return existing + sep + "".join(line + "\n" for line in lines)


def _mesh_ids(fields: list[str], at: int, authorized: bool) -> list[str] | None:
    """The meshes a meshkit-tagged key line (as ``_key_fields`` split it) belongs to ([] for a line
    from before mesh ids: anyone's), or None when the line is not meshkit's."""
    parts = " ".join(fields[at + 2 :]).split()
    head = parts[0] if parts else ""
    if not (head.startswith(AUTHORIZED_TAG) if authorized else head == KNOWN_TAG):
        return None
    for part in parts[1:]:
        if part.startswith(MESH_FIELD):
            return [i for i in part[len(MESH_FIELD) :].split(",") if i]
    return []


def _tag(head: str, ids: Iterable[str]) -> str:
    listed = ",".join(sorted(set(ids) - {""}))
    return f"{head} {MESH_FIELD}{listed}" if listed else head


def _retag(fields: list[str], at: int, ids: Sequence[str]) -> str:
    """One of meshkit's own lines (written without options or quotes) with a new set of meshes."""
    return " ".join(fields[: at + 2]) + " " + _tag(fields[at + 2], ids) + "\n"


@record
class Merge:
    """A merged file: its new text, the lines added, and how many of meshkit's existing lines now
    also list this mesh (another mesh added them first)."""

    text: str
    added: list[str]
    claimed: int = 0
    conflicts: tuple[Conflict, ...] = ()

    @property
    def changed(self) -> bool:
        return bool(self.added or self.claimed)


def merge_authorized(
    existing: str, keys: Iterable[tuple[str, PublicKey]], mesh_id: str = ""
) -> Merge:
    """Add each ``(node label, key)`` whose key is not already authorized (under any options or
    comment); a key that another mesh's line already carries gets this mesh added to that line's
    tag, so that unmeshing either leaves it to the other. Every other line is kept byte for byte."""
    wanted: dict[str, tuple[str, PublicKey]] = {}
    for label, key in keys:
        wanted.setdefault(key.blob, (label, key))
    present: set[str] = set()  # the blobs the file already authorizes
    lines = existing.splitlines(keepends=True)
    claimed = 0
    for i, line in enumerate(lines):
        found = _key_fields(line)
        if not found:
            continue
        blob = found[0][found[1] + 1]
        ids = _mesh_ids(*found, authorized=True) if mesh_id else None
        # Another mesh's line carries a wanted key: this mesh relies on it too.
        if blob in wanted and blob not in present and ids is not None and mesh_id not in ids:
            lines[i] = _retag(*found, [*ids, mesh_id])
            claimed += 1
        present.add(blob)
    added = []
    for blob, (label, key) in wanted.items():
        if blob not in present:
            head = f"{AUTHORIZED_TAG}{check_label(label)}"
            added.append(f"{key.kind} {key.blob} {_tag(head, [mesh_id])}")
    return Merge(_join("".join(lines), added), added, claimed)


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


@record
class Conflict:
    name: str
    kind: str
    lineno: int

    def describe(self, node: str) -> str:
        return (
            f"{node}: known_hosts line {self.lineno} has a different {self.kind} key for "
            f"{self.name} (reinstalled node?); check it, then remove it on {node} with: "
            f"ssh-keygen -R {self.name!r}"
        )


class Known(NamedTuple):
    """One known_hosts line in the index: ordered as added (the file's order)."""

    order: int
    patterns: str
    kind: str
    blob: str
    line: int  # its index in the file; -1: a line new in this merge


class _KnownIndex:
    """known_hosts lines by (key type, name), so that merging every node's names into every
    node's file is one lookup per name instead of matching each name against every line (N names
    times N lines). Hashed names (``|1|...``) cannot be indexed: they are matched one by one.
    ``matching`` keeps the file's order."""

    def __init__(self) -> None:
        self.plain: dict[tuple[str, str], list[Known]] = {}
        self.hashed: list[Known] = []
        self.count = 0

    def add(self, patterns: str, kind: str, blob: str, index: int) -> None:
        entry = Known(self.count, patterns, kind, blob, index)
        self.count += 1
        for pattern in dict.fromkeys(name.lower() for name in patterns.split(",")):
            if pattern.startswith("|"):
                self.hashed.append(entry)
            else:
                self.plain.setdefault((kind, pattern), []).append(entry)

    def matching(self, kind: str, name: str) -> list[Known]:
        found = set(self.plain.get((kind, name.lower()), []))
        for entry in self.hashed:
            if entry.kind != kind:
                continue
            if any(_hashed_match(pattern, name) for pattern in entry.patterns.split(",")):
                found.add(entry)
        return sorted(found)


def merge_known_hosts(
    existing: str, entries: Iterable[tuple[Sequence[str], PublicKey]], mesh_id: str = ""
) -> Merge:
    """Add a line for each host key under every name not already covered (plain or hashed).
    A name already listed with a *different* key of the same type is a conflict, never overwritten.
    A name covered only by other meshes' lines gets this mesh added to one of those lines' tag."""
    lines = existing.splitlines(keepends=True)
    known = _KnownIndex()
    tags: dict[int, list[str]] = {-1: [mesh_id]}  # meshkit's lines' meshes; -1: lines added here
    for i, line in enumerate(lines):
        found = _key_fields(line)
        if found and not found[0][0].startswith("@") and found[1] == 1:
            fields = found[0]
            known.add(fields[0], fields[1], fields[2], i)
            ids = _mesh_ids(*found, authorized=False)
            if ids is not None:
                tags[i] = ids
    added: list[str] = []
    conflicts: list[Conflict] = []
    claimed: set[int] = set()
    for names, key in entries:
        missing = []
        for name in names:
            same = known.matching(key.kind, name)
            covering = [entry.line for entry in same if entry.blob == key.blob]
            # Nothing is needed when a covering line is someone else's or lists this mesh already.
            if mesh_id and covering and all(i in tags and mesh_id not in tags[i] for i in covering):
                i = covering[0]
                tags[i] = [*tags[i], mesh_id]
                lines[i] = _retag(_split_quoted(lines[i].strip()), 1, tags[i])
                claimed.add(i)
            if covering:
                continue
            if same:
                conflicts.append(Conflict(name, key.kind, same[0].line + 1))
                continue
            missing.append(check_label(name))
        if missing:
            added.append(f"{','.join(missing)} {key.kind} {key.blob} {_tag(KNOWN_TAG, [mesh_id])}")
            known.add(",".join(missing), key.kind, key.blob, -1)
    return Merge(_join("".join(lines), added), added, len(claimed), tuple(conflicts))


def remove_tagged(existing: str, known_hosts: bool, mesh_id: str = "") -> tuple[str, int]:
    """Take this mesh off meshkit's lines: a line that no other mesh lists any more is dropped
    (lines from before mesh ids belong to whoever unmeshes). Other lines are kept byte for byte.
    Returns the new text and how many lines were dropped or untagged. Without ``mesh_id``, every
    line of meshkit's is dropped."""
    kept: list[str] = []
    changed = 0
    for line in existing.splitlines(keepends=True):
        found = _key_fields(line)
        if found:
            ids = _mesh_ids(*found, authorized=not known_hosts)
            if ids is not None and (not mesh_id or not ids or mesh_id in ids):
                changed += 1
                rest = [other for other in ids if other != mesh_id] if mesh_id else []
                if rest:
                    kept.append(_retag(*found, rest))
                continue
        kept.append(line)
    return "".join(kept), changed


def listed_by_others(text: str, key: PublicKey, mesh_id: str) -> bool:
    """Whether another mesh's authorized_keys line still carries ``key`` (then a generated key
    stays: that mesh still uses it)."""
    for line in text.splitlines():
        found = _key_fields(line)
        if found and found[0][found[1] + 1] == key.blob:
            ids = _mesh_ids(*found, authorized=True)
            if ids and any(other != mesh_id for other in ids):
                return True
    return False
