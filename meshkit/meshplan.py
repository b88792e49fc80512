"""The mesh as data: what a node told us (facts), what to write there (plans), what unmesh takes
away, which names each node answers to, which files sshd would refuse, and the N x N check's script
and results. Pure: no I/O; ``meshkit.ops.mesh`` gathers the facts and applies the plans.
"""

from __future__ import annotations

import base64
import hashlib
import ipaddress
import re
import shlex
import stat
import struct
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from . import keys
from .errors import KeyFormatError
from .hostfile import Host, ip_of
from .keys import Merge, PublicKey

AUTHORIZED = ".ssh/authorized_keys"
KNOWN = ".ssh/known_hosts"
# Preference order for a user key that exists; new keys go to the first free one of GENERATE.
USER_KEY_SLOTS = (".ssh/id_ed25519", ".ssh/id_rsa", ".ssh/id_ecdsa")
GENERATE = {".ssh/id_ed25519": "ed25519", ".ssh/id_ecdsa": "ecdsa"}
VERIFY_BATCH = 8  # concurrent outgoing checks per node: stays under sshd's default MaxStartups (10)
_TEMP = re.compile(r"^\.(authorized_keys|known_hosts)\.meshkit-[0-9a-f]{12}$")
_HOSTNAME = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9.-]{0,252})$")


def mesh_id(hosts: Iterable[Host]) -> str:
    """Which mesh a line belongs to: derived from the hostfile's nodes (order and comments do not
    matter), so the same hostfile always unmeshes what it meshed, wherever it is run from."""
    names = sorted({h.label.lower() for h in hosts})
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
    taken = {s.path for s in slots if s.private or s.public is not None}
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
    for f in [home, *entries]:
        if f.kind == "missing":
            continue
        found = f"owner uid {f.uid}, mode {f.mode:04o}"
        if f.kind == "link":
            problems.append(
                f"{node}: {f.path} is a symlink to {f.target or '?'}; meshkit never follows a "
                "link out of ~/.ssh: replace it with a regular file (after checking its lines)"
            )
        elif f.kind not in ("file", "dir"):
            problems.append(f"{node}: {f.path} is not a regular file or directory; remove it")
        elif f.uid not in owners:
            problems.append(
                f"{node}: {f.path} belongs to someone else ({found}); sshd (StrictModes) ignores "
                f"it: check its lines, then chown it to the user"
            )
        elif f.mode & 0o022:
            problems.append(
                f"{node}: {f.path} is writable by others ({found}); sshd (StrictModes) ignores "
                f"it: check its lines (anyone could have added one), then chmod go-w {f.path}"
            )
    return problems


def sshd_directives(text: str) -> list[tuple[str, str]]:
    """``(keyword, arguments)`` of an sshd_config's global part (up to the first Match)."""
    out = []
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        # "Key value", "Key=value", "Key = value"
        word, *rest = re.split(r"[\s=]+", line, maxsplit=1)
        if word.lower() == "match":
            break
        out.append((word.lower(), rest[0] if rest else ""))
    return out


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
    ip = _ip(text)
    return ip is not None and not (
        ip.is_loopback or ip.is_link_local or ip.is_multicast or ip.is_unspecified
    )


def parse_fib_trie(text: str) -> list[str]:
    """The IPv4 addresses local to this namespace, from /proc/net/fib_trie (``/32 host LOCAL``)."""
    found, last = [], ""
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("|--"):
            last = stripped[3:].strip()
        elif stripped.startswith("/32 host LOCAL") and last:
            found.append(last)
    return [a for a in dict.fromkeys(found) if _usable_address(a)]


def parse_if_inet6(text: str) -> list[str]:
    """Global-scope IPv6 addresses from /proc/net/if_inet6 (32 hex digits, index, prefix, scope)."""
    found = []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 4 and re.fullmatch(r"[0-9a-fA-F]{32}", parts[0]) and parts[3] == "00":
            found.append(str(ipaddress.IPv6Address(bytes.fromhex(parts[0]))))
    return [a for a in dict.fromkeys(found) if _usable_address(a)]


def hostnames(kernel_hostname: str, hosts_text: str, domainname: str = "") -> list[str]:
    """The node's short hostname and its fully qualified names: /etc/hosts names that extend the
    hostname with a domain, and hostname.domainname when the kernel has one."""
    name = kernel_hostname.strip()
    if not _HOSTNAME.match(name) or name.lower() == "localhost":
        return []
    short = name.split(".")[0]
    out = [short, name]
    for line in hosts_text.splitlines():
        fields = line.split("#", 1)[0].split()
        if fields and _usable_address(fields[0]):
            out += [a for a in fields[1:] if a.startswith(short + ".") and _HOSTNAME.match(a)]
    domain = domainname.strip()
    if domain and domain != "(none)" and _HOSTNAME.match(domain) and "." not in name:
        out.append(f"{short}.{domain}")
    return list(dict.fromkeys(out))


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
    items += [(n, "hostname") for n in own_names]
    items += [(a, "address") for a in addresses]
    seen: dict[str, tuple[str, str]] = {}
    for name, why in items:
        # localhost, and loopback and link-local addresses, name every machine
        if not name or name.lower() == "localhost" or (_ip(name) and not _usable_address(name)):
            continue
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
    shared = {n for n, hosts in found.items() if len(hosts) > 1 and n not in chosen}
    kept = {
        host: [(n, why) for n, why in names if not (why == "address" and n.lower() in shared)]
        for host, names in named.items()
    }
    notes = [
        f"address {n} is on {len(found[n])} nodes (a local bridge such as docker0?): recorded for "
        "none of them"
        for n in sorted(shared)
    ]
    return kept, notes


def name_conflicts(named: Mapping[Host, Sequence[tuple[str, str]]]) -> list[str]:
    """A name or address two nodes both answer to cannot be in known_hosts for either: the
    second node's key would be refused (or the first's trusted for the second)."""
    claims: dict[str, list[tuple[Host, str]]] = {}
    for host, names in named.items():
        for name, why in names:
            claims.setdefault(name.lower(), []).append((host, why))
    return [
        f"name {key!r} is claimed by "
        + " and ".join(f"{h.label} ({why})" for h, why in who)
        + ": make it unique (hostname, address) or leave one node out (--exclude)"
        for key, who in claims.items()
        if len({h for h, _ in who}) > 1
    ]


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
    return Entries(
        tuple((f.host.label, f.user.key) for f in facts if f.user.key is not None),
        tuple((tuple(n for n, _ in f.names), k) for f in facts for k in f.host_keys),
        mesh,
    )


def plan(facts: Sequence[NodeFacts], mesh: str) -> dict[Host, NodePlan]:
    """The new authorized_keys and known_hosts of every node (a node whose user key is still to
    be created or derived is left out of the others' files: plan again once keys exist)."""
    wanted = entries(facts, mesh)
    merged = {f.host: wanted.merge(f.authorized or "", f.known or "") for f in facts}
    return {f.host: NodePlan(f.user.action, *merged[f.host], f.stale) for f in facts}


def conflicts(facts: Sequence[NodeFacts], plans: Mapping[Host, NodePlan]) -> list[str]:
    """Everything that stops the mesh before anything is written: shared names, known_hosts lines
    that already give a name another key."""
    lines = name_conflicts({f.host: f.names for f in facts})
    return lines + [c.describe(f.host.label) for f in facts for c in plans[f.host].known.conflicts]


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
        return bool(self.authorized_removed or self.known_removed or self.remove_key or self.stale)


def unmesh_texts(
    authorized: str | None, known: str | None, mesh: str
) -> tuple[str | None, int, str | None, int]:
    """Both files without this mesh's lines (a missing one stays missing), and how many lines
    each lost or had untagged."""
    auth, auth_n = keys.remove_tagged(authorized or "", known_hosts=False, mesh_id=mesh)
    kh, known_n = keys.remove_tagged(known or "", known_hosts=True, mesh_id=mesh)
    return (None if authorized is None else auth), auth_n, (None if known is None else kh), known_n


def plan_unmesh(f: NodeFacts, mesh: str, keep_keys: bool) -> UnmeshPlan:
    """Take this mesh off the node's files; delete the key mesh generated there unless asked to
    keep it or another mesh still lists it."""
    auth, auth_removed, known, known_removed = unmesh_texts(f.authorized, f.known, mesh)
    key_file, kept = None, None
    user = f.user.key
    if not keep_keys and user is not None and user.comment.startswith(keys.GENERATED_COMMENT):
        if keys.listed_by_others(auth or "", user, mesh):
            kept = f"~/{f.user.path} stays: another mesh still lists it"
        else:
            key_file = f.user.path
    return UnmeshPlan(auth, auth_removed, known, known_removed, key_file, kept, f.stale)


def placeholder_key(host: Host) -> PublicKey:
    """Stands in for a user key that --dry-run would create (never written anywhere): a well-formed
    ed25519 blob derived from the node's name, so each node's placeholder is distinct."""
    raw = struct.pack(">I", 11) + b"ssh-ed25519" + struct.pack(">I", 32)
    raw += hashlib.sha256(host.label.encode()).digest()
    return PublicKey("ssh-ed25519", base64.b64encode(raw).decode(), f"(new key of {host.label})")


@dataclass(frozen=True)
class PairFailure:
    source: Host
    target: Host
    error: str


@dataclass(frozen=True)
class Target:
    """One way to reach a node from the others: by the hostfile spelling (a full login: it proves
    the user keys and the host key), or by its hostname (its host-key check alone)."""

    index: int
    name: str
    by: str  # "hostfile" or "hostname"

    @property
    def key(self) -> str:  # how the script's output names it: its rank, then "h" by hostname
        return f"{self.index}{'h' if self.by == 'hostname' else ''}"


def targets(hosts: Sequence[Host], own_hostnames: Mapping[Host, str]) -> list[Target]:
    out = []
    for i, h in enumerate(hosts):
        out.append(Target(i, h.host, "hostfile"))
        name = own_hostnames.get(h, "")
        if name and name.lower() != h.host.lower() and _HOSTNAME.match(name):
            out.append(Target(i, name, "hostname"))
    return out


# A login ("check"), and a host-key check alone ("keycheck"): a key exchange, then the "none"
# authentication, which sshd refuses; OpenSSH says "Permission denied" only after the host key
# passed StrictHostKeyChecking, so that refusal is the proof (and no shell starts on the target).
VERIFY_FUNCTIONS = (
    'check() { i=$1; shift; if out=$("$@" 2>&1 </dev/null); then echo "ok $i"; '
    'else echo "fail $i $(printf %s "$out" | tr "\\n" " " | cut -c1-300)"; fi; }\n'
    'keycheck() { i=$1; shift; out=$("$@" 2>&1 </dev/null) && { echo "ok $i"; return; }; '
    'case $out in *"Permission denied ("*) echo "ok $i" ;; '
    '*) echo "fail $i $(printf %s "$out" | tr "\\n" " " | cut -c1-300)" ;; esac; }'
)
VERIFY_OPTIONS = ("BatchMode=yes", "StrictHostKeyChecking=yes", "LogLevel=ERROR")


def verify_script(
    hosts: Sequence[Host], connect_timeout: float, start: int, own_hostnames: Mapping[Host, str]
) -> str:
    """From one node to every node: a full login by the hostfile spelling, and a host-key check
    by the node's hostname; plain OpenSSH, BatchMode, strict host keys. Host data enters the
    script only through shlex.join. Node ``start`` begins with target ``start``, so each target
    gets about one batch of connections at a time, not all N."""
    lines = [VERIFY_FUNCTIONS]
    every = targets(hosts, own_hostnames)
    order = sorted(every, key=lambda t: ((t.index - start) % len(hosts), t.by))
    options = (*VERIFY_OPTIONS, f"ConnectTimeout={int(connect_timeout)}")
    ssh = ["ssh", *(word for option in options for word in ("-o", option))]
    for k, t in enumerate(order):
        target = hosts[t.index]
        keycheck = t.by == "hostname"
        argv = [*ssh, "-o", "PreferredAuthentications=none"] if keycheck else [*ssh]
        argv += ["-p", str(target.port)] if target.port else []
        argv += ["-l", target.user] if target.user else []
        argv += ["--", t.name, "true"]
        lines.append(f"{'keycheck' if keycheck else 'check'} {t.key} {shlex.join(argv)} &")
        if (k + 1) % VERIFY_BATCH == 0:
            lines.append("wait")
    lines.append("wait")
    return "\n".join(lines) + "\n"


def parse_verify(
    source: Host, hosts: Sequence[Host], output: str, own_hostnames: Mapping[Host, str]
) -> list[PairFailure]:
    """One failure per target that did not answer ``ok`` by every name it was tried by."""
    seen: dict[str, str | None] = {}
    for line in output.splitlines():
        status, _, rest = line.partition(" ")
        key, _, error = rest.partition(" ")
        if status in ("ok", "fail"):
            seen[key] = None if status == "ok" else (error.strip() or "failed")
    errors: dict[int, list[str]] = {}
    for t in targets(hosts, own_hostnames):
        result = seen.get(t.key, "no result")
        if result is not None:
            how = f" (host key by hostname {t.name})" if t.by == "hostname" else ""
            errors.setdefault(t.index, []).append(f"{result}{how}")
    # One failure per pair, whichever names failed.
    return [PairFailure(source, hosts[i], "; ".join(e)) for i, e in sorted(errors.items())]


def matrix(hosts: Sequence[Host], failures: Sequence[PairFailure]) -> str:
    """``from \\ to`` grid of ok (.) and failed (X) pairs, rows and columns by rank."""
    bad = {(f.source, f.target) for f in failures}
    header = "from\\to " + " ".join(f"{i:>3}" for i in range(len(hosts)))
    rows = [
        f"{i:>3} {h.label[:20]:<20} "
        + " ".join(f"{'X' if (h, t) in bad else '.':>3}" for t in hosts)
        for i, h in enumerate(hosts)
    ]
    return "\n".join([header, *rows])


@dataclass
class VerifyResult:
    hosts: list[Host]
    failures: list[PairFailure] = field(default_factory=list)

    @property
    def ok_pairs(self) -> int:
        return len(self.hosts) ** 2 - len({(f.source, f.target) for f in self.failures})
