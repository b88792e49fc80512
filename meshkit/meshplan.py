"""The mesh as data: what a node told us (facts), what to write there (plans), what unmesh takes
away, which names each node answers to, which files sshd would refuse. Pure: no I/O;
``meshkit.ops.mesh`` gathers the facts and applies the plans. The N x N check's script and
results are ``meshkit.verifyplan``'s.
"""

from __future__ import annotations

import base64
import hashlib
import ipaddress
import re
import stat
import struct
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from . import keys
from .errors import KeyFormatError
from .hostfile import Host, ip_of
from .keys import Merge, PublicKey

AUTHORIZED = ".ssh/authorized_keys"
KNOWN = ".ssh/known_hosts"
# Preference order for a user key that exists; new keys go to the first free one of GENERATE.
USER_KEY_SLOTS = (".ssh/id_ed25519", ".ssh/id_rsa", ".ssh/id_ecdsa")
GENERATE = {".ssh/id_ed25519": "ed25519", ".ssh/id_ecdsa": "ecdsa"}
_TEMP = re.compile(r"^\.(authorized_keys|known_hosts)\.meshkit-[0-9a-f]{12}$")
GLOBAL_SCOPE = "00"  # /proc/net/if_inet6's scope of a global address
HOSTNAME = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9.-]{0,252})$")  # a name a node may go by


def mesh_id(hosts: Iterable[Host]) -> str:
    """Which mesh a line belongs to: derived from the hostfile's nodes (order and comments do not
    matter), so the same hostfile always unmeshes what it meshed, wherever it is run from."""
    names = sorted({host.label.lower() for host in hosts})
    return hashlib.sha256("\n".join(names).encode()).hexdigest()[:10]


def is_meshkit_temp(name: str) -> bool:
    """A temp file of meshkit's atomic writes (``.authorized_keys.meshkit-<12 hex>``)."""
    return bool(_TEMP.match(name))


@dataclass(frozen=True)
class KeySlot:
    """One ``~/.ssh/id_*`` pair as found: whether the private half exists, the .pub's text."""

    path: str
    private: bool
    public: str | None


@dataclass(frozen=True)
class UserKey:
    """The node's user key: ``kept`` (both halves there), ``derive`` (private half only: its
    public half comes from ``ssh-keygen -y``) or ``generate`` (at ``path``, a slot with no file)."""

    action: str
    path: str
    key: PublicKey | None = None


def choose_user_key(slots: Sequence[KeySlot], node: str) -> UserKey:
    """The first slot with a private key wins; a .pub without its private half (held in an agent
    or a token) is never replaced: a new key goes to a slot where neither file exists."""
    for slot in slots:
        if slot.private:
            if slot.public is None:
                return UserKey("derive", slot.path)
            line = slot.public.splitlines()[0] if slot.public.strip() else ""
            key = keys.parse_public_key(line, f"{node}: ~/{slot.path}.pub")
            return UserKey("kept", slot.path, key)
    taken = {slot.path for slot in slots if slot.private or slot.public is not None}
    for path in GENERATE:
        if path not in taken:
            return UserKey("generate", path)
    raise KeyFormatError(
        f"{node}: every key file meshkit could create (~/.ssh/id_ed25519, ~/.ssh/id_ecdsa) exists "
        "without its private half; meshkit never overwrites a key file: add the private key, or "
        "remove the stray .pub"
    )


@dataclass(frozen=True)
class FileStat:
    """An lstat of a path on a node: ``kind`` is file, dir, link, other or missing."""

    path: str
    kind: str
    mode: int = 0
    uid: int = 0
    target: str = ""

    @staticmethod
    def of(path: str, st_mode: int | None, uid: int | None, target: str = "") -> FileStat:
        if st_mode is None:
            return FileStat(path, "missing")
        kind = {stat.S_IFLNK: "link", stat.S_IFDIR: "dir", stat.S_IFREG: "file"}
        mode = stat.S_IMODE(st_mode)
        return FileStat(path, kind.get(stat.S_IFMT(st_mode), "other"), mode, uid or 0, target)


def unsafe_files(node: str, home: FileStat, entries: Sequence[FileStat]) -> list[str]:
    """What sshd's StrictModes would refuse (group/world-writable, owned by someone other than the
    user or root), and symlinks (meshkit never follows one out of ~/.ssh, nor replaces it): one
    line per path with what was found and the fix. Such a node is refused, never repaired: making
    the file acceptable would also arm whatever lines someone planted in it."""
    owners = {0, home.uid}
    problems = []
    for entry in [home, *entries]:
        if entry.kind == "missing":
            continue
        path = entry.path
        found = f"owner uid {entry.uid}, mode {entry.mode:04o}"
        if entry.kind == "link":
            problems.append(
                f"{node}: {path} is a symlink to {entry.target or '?'}; meshkit never follows a "
                "link out of ~/.ssh: replace it with a regular file (after checking its lines)"
            )
        elif entry.kind not in ("file", "dir"):
            problems.append(f"{node}: {path} is not a regular file or directory; remove it")
        elif entry.uid not in owners:
            problems.append(
                f"{node}: {path} belongs to someone else ({found}); sshd (StrictModes) ignores "
                f"it: check its lines, then chown it to the user"
            )
        elif entry.mode & 0o022:
            problems.append(
                f"{node}: {path} is writable by others ({found}); sshd (StrictModes) ignores "
                f"it: check its lines (anyone could have added one), then chmod go-w {path}"
            )
    return problems


def sshd_directives(text: str) -> list[tuple[str, str]]:
    """``(keyword, arguments)`` of an sshd_config's global part (up to the first Match)."""
    directives = []
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        # "Key value", "Key=value", "Key = value"
        word, *rest = re.split(r"[\s=]+", line, maxsplit=1)
        if word.lower() == "match":
            break
        directives.append((word.lower(), rest[0] if rest else ""))
    return directives


def authorized_keys_problem(node: str, value: str | None, where: str, home: str) -> str | None:
    """An AuthorizedKeysFile that does not include ~/.ssh/authorized_keys: mesh's keys would
    never be read there."""
    if value is None:
        return None  # sshd's default: .ssh/authorized_keys .ssh/authorized_keys2
    ours = {".ssh/authorized_keys", "%h/.ssh/authorized_keys", "~/.ssh/authorized_keys"}
    ours.add(f"{home.rstrip('/')}/.ssh/authorized_keys")
    if any(token in ours for token in value.split()):
        return None
    return (
        f"{node}: sshd reads AuthorizedKeysFile {value[:120]} ({where}), not "
        "~/.ssh/authorized_keys, so the keys mesh installs would never be used; add "
        ".ssh/authorized_keys to AuthorizedKeysFile, or leave this node out (--exclude)"
    )


def _ip(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    return ip_of(text.split("%")[0])  # an IPv6 address may carry its zone: fe80::1%eth0


def _usable_address(text: str) -> bool:
    address = _ip(text)
    if address is None:
        return False
    # These name every machine (loopback, link-local), or none.
    names_every_machine = address.is_loopback or address.is_link_local
    return not (names_every_machine or address.is_multicast or address.is_unspecified)


def parse_fib_trie(text: str) -> list[str]:
    """The IPv4 addresses local to this namespace, from /proc/net/fib_trie (``/32 host LOCAL``)."""
    found: list[str] = []
    last = ""  # the address of the last "|--" line: a "/32 host LOCAL" line below it is local
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("|--"):
            last = stripped[3:].strip()
        elif stripped.startswith("/32 host LOCAL") and last:
            found.append(last)
    return [address for address in dict.fromkeys(found) if _usable_address(address)]


def parse_if_inet6(text: str) -> list[str]:
    """Global-scope IPv6 addresses from /proc/net/if_inet6 (32 hex digits, index, prefix, scope)."""
    found = []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) < 4 or not re.fullmatch(r"[0-9a-fA-F]{32}", parts[0]):
            continue
        digits = parts[0]
        scope = parts[3]
        if scope == GLOBAL_SCOPE:
            found.append(str(ipaddress.IPv6Address(bytes.fromhex(digits))))
    return [address for address in dict.fromkeys(found) if _usable_address(address)]


def hostnames(kernel_hostname: str, hosts_text: str, domainname: str = "") -> list[str]:
    """The node's short hostname and its fully qualified names: /etc/hosts names that extend the
    hostname with a domain, and hostname.domainname when the kernel has one."""
    name = kernel_hostname.strip()
    if not HOSTNAME.match(name) or name.lower() == "localhost":
        return []
    short = name.split(".")[0]
    names = [short, name]
    for line in hosts_text.splitlines():
        fields = line.split("#", 1)[0].split()
        if not fields or not _usable_address(fields[0]):
            continue
        for alias in fields[1:]:
            if alias.startswith(short + ".") and HOSTNAME.match(alias):
                names.append(alias)
    domain = domainname.strip()
    if domain and domain != "(none)" and HOSTNAME.match(domain) and "." not in name:
        names.append(f"{short}.{domain}")
    return list(dict.fromkeys(names))


def node_names(
    host: Host,
    port: int | None,
    connected: Sequence[tuple[str, str]],
    own_names: Sequence[str],
    addresses: Sequence[str],
) -> list[tuple[str, str]]:
    """Every name the node answers to, with where it came from: the hostfile spelling, what the
    controller connected to (ssh_config HostName, the peer address), the node's own hostnames and
    usable addresses; first source wins. Written as known_hosts has them: ``[name]:port`` off
    port 22."""
    items = [(host.host, "hostfile"), *connected]
    items += [(name, "hostname") for name in own_names]
    items += [(address, "address") for address in addresses]
    seen: dict[str, tuple[str, str]] = {}
    for name, why in items:
        if not name or name.lower() == "localhost":
            continue
        if _ip(name) and not _usable_address(name):
            continue  # loopback and link-local addresses, like localhost, name every machine
        written = name if port in (None, 22) else f"[{name}]:{port}"
        seen.setdefault(written.lower(), (written, why))
    return list(seen.values())


def drop_shared_addresses(
    named: Mapping[Host, Sequence[tuple[str, str]]],
) -> tuple[dict[Host, list[tuple[str, str]]], list[str]]:
    """An address that several nodes find on their own interfaces (and that nobody named them by:
    not the hostfile, not ssh_config) names none of them: a local bridge such as docker0 has the
    same address everywhere. It is recorded for none of them, with a note, instead of stopping
    the mesh; a name anyone chose stays a conflict (``name_conflicts``)."""
    found: dict[str, set[Host]] = {}
    chosen: set[str] = set()
    for host, names in named.items():
        for name, why in names:
            if why == "address":
                found.setdefault(name.lower(), set()).add(host)
            else:
                chosen.add(name.lower())
    shared = {name for name, hosts in found.items() if len(hosts) > 1 and name not in chosen}
    kept: dict[Host, list[tuple[str, str]]] = {}
    for host, names in named.items():
        kept[host] = [
            (name, why) for name, why in names if not (why == "address" and name.lower() in shared)
        ]
    notes = [
        f"address {address} is on {len(found[address])} nodes (a local bridge such as docker0?): "
        "recorded for none of them"
        for address in sorted(shared)
    ]
    return kept, notes


def name_conflicts(named: Mapping[Host, Sequence[tuple[str, str]]]) -> list[str]:
    """A name or address two nodes both answer to cannot be in known_hosts for either: the
    second node's key would be refused (or the first's trusted for the second)."""
    claims: dict[str, list[tuple[Host, str]]] = {}
    for host, names in named.items():
        for name, why in names:
            claims.setdefault(name.lower(), []).append((host, why))
    problems = []
    for name, claimants in claims.items():
        if len({host for host, _ in claimants}) < 2:
            continue
        who = " and ".join(f"{host.label} ({why})" for host, why in claimants)
        problems.append(
            f"name {name!r} is claimed by {who}: make it unique (hostname, address) or leave one "
            "node out (--exclude)"
        )
    return problems


@dataclass
class NodeFacts:
    """What inspect found on a node (nothing here came from anywhere but the node and the
    controller's own connection to it)."""

    host: Host
    user: UserKey
    host_keys: tuple[PublicKey, ...]
    names: tuple[tuple[str, str], ...]
    authorized: str | None
    known: str | None
    hostname: str = ""
    stale: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    home: str = ""
    host_keys_by: str = ""  # how sshd proved them: remote.hostkeys.IN_CONNECTION or FALLBACK


@dataclass
class NodePlan:
    user_key: str  # kept | generate | derive
    authorized: Merge
    known: Merge
    stale: tuple[str, ...] = ()

    @property
    def changes(self) -> bool:
        edits = self.authorized.changed or self.known.changed
        return edits or self.user_key != "kept" or bool(self.stale)


@dataclass(frozen=True)
class Entries:
    """What every node's two files must list: every node's user key, every host key by names."""

    user_keys: tuple[tuple[str, PublicKey], ...]
    host_keys: tuple[tuple[tuple[str, ...], PublicKey], ...]
    mesh_id: str

    def merge(self, authorized: str, known: str) -> tuple[Merge, Merge]:
        return (
            keys.merge_authorized(authorized, self.user_keys, self.mesh_id),
            keys.merge_known_hosts(known, self.host_keys, self.mesh_id),
        )


def entries(facts: Sequence[NodeFacts], mesh: str) -> Entries:
    """Every node's user key (those known yet), and every host key under its node's names."""
    user_keys = []
    host_keys = []
    for fact in facts:
        if fact.user.key is not None:
            user_keys.append((fact.host.label, fact.user.key))
        names = tuple(name for name, _ in fact.names)
        host_keys += [(names, key) for key in fact.host_keys]
    return Entries(tuple(user_keys), tuple(host_keys), mesh)


def plan(facts: Sequence[NodeFacts], mesh: str) -> dict[Host, NodePlan]:
    """The new authorized_keys and known_hosts of every node (a node whose user key is still to
    be created or derived is left out of the others' files: plan again once keys exist)."""
    wanted = entries(facts, mesh)
    plans = {}
    for fact in facts:
        authorized, known = wanted.merge(fact.authorized or "", fact.known or "")
        plans[fact.host] = NodePlan(fact.user.action, authorized, known, fact.stale)
    return plans


def conflicts(facts: Sequence[NodeFacts], plans: Mapping[Host, NodePlan]) -> list[str]:
    """Everything that stops the mesh before anything is written: shared names, known_hosts lines
    that already give a name another key."""
    lines = name_conflicts({fact.host: fact.names for fact in facts})
    for fact in facts:
        known = plans[fact.host].known
        lines += [conflict.describe(fact.host.label) for conflict in known.conflicts]
    return lines


@dataclass
class UnmeshPlan:
    authorized: str | None
    authorized_removed: int
    known: str | None
    known_removed: int
    remove_key: str | None  # the generated key file to delete, if any
    kept_key: str | None = None  # why a generated key stays
    stale: tuple[str, ...] = ()

    @property
    def changes(self) -> bool:
        removes_lines = self.authorized_removed or self.known_removed
        return bool(removes_lines or self.remove_key or self.stale)


def unmesh_texts(
    authorized: str | None, known: str | None, mesh: str
) -> tuple[str | None, int, str | None, int]:
    """Both files without this mesh's lines (a missing one stays missing), and how many lines
    each lost or had untagged."""
    authorized_text, authorized_removed = keys.remove_tagged(
        authorized or "", known_hosts=False, mesh_id=mesh
    )
    known_text, known_removed = keys.remove_tagged(known or "", known_hosts=True, mesh_id=mesh)
    new_authorized = None if authorized is None else authorized_text
    new_known = None if known is None else known_text
    return new_authorized, authorized_removed, new_known, known_removed


def plan_unmesh(facts: NodeFacts, mesh: str, keep_keys: bool) -> UnmeshPlan:
    """Take this mesh off the node's files; delete the key mesh generated there unless asked to
    keep it or another mesh still lists it."""
    unmeshed = unmesh_texts(facts.authorized, facts.known, mesh)
    authorized, authorized_removed, known, known_removed = unmeshed
    key_file = None  # the generated key to delete
    kept = None  # why the generated key stays
    user = facts.user.key
    generated = user is not None and user.comment.startswith(keys.GENERATED_COMMENT)
    if not keep_keys and user is not None and generated:
        if keys.listed_by_others(authorized or "", user, mesh):
            kept = f"~/{facts.user.path} stays: another mesh still lists it"
        else:
            key_file = facts.user.path
    return UnmeshPlan(
        authorized, authorized_removed, known, known_removed, key_file, kept, facts.stale
    )


def placeholder_key(host: Host) -> PublicKey:
    """Stands in for a user key that --dry-run would create (never written anywhere): a well-formed
    ed25519 blob derived from the node's name, so each node's placeholder is distinct."""
    raw = struct.pack(">I", 11) + b"ssh-ed25519" + struct.pack(">I", 32)
    raw += hashlib.sha256(host.label.encode()).digest()
    blob = base64.b64encode(raw).decode()
    return PublicKey("ssh-ed25519", blob, f"(new key of {host.label})")
