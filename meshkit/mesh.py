"""The mesh: every node can SSH to every node (itself included) with keys and strict host keys.

Phases over one connection per node: inspect (read only) -> plan (pure) -> keys (create missing user
keys) -> install (atomic SFTP writes) -> verify (N x N from the nodes themselves). Nothing is
written anywhere unless every node passed inspection (or --skip-unreachable leaves the failed ones
out), and no plan conflicts.
"""

from __future__ import annotations

import base64
import hashlib
import shlex
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from . import keys
from .errors import KeyFormatError
from .hostfile import Host
from .keys import Inspection, PublicKey
from .remote import Cluster, Remote

AUTHORIZED = ".ssh/authorized_keys"
KNOWN = ".ssh/known_hosts"
USER_KEY_FILES = (".ssh/id_ed25519", ".ssh/id_rsa", ".ssh/id_ecdsa")
VERIFY_BATCH = 8  # concurrent outgoing checks per node: stays under sshd's default MaxStartups (10)

# Read-only: which user key exists (with its private half), and the host keys sshd serves.
INSPECT = r"""
for f in .ssh/id_ed25519 .ssh/id_rsa .ssh/id_ecdsa; do
  if [ -f "$f" ] && [ -f "$f.pub" ]; then printf 'userkey '; head -n 1 "$f.pub"; fi
done
for f in /etc/ssh/ssh_host_*_key.pub; do
  if [ -f "$f" ]; then printf 'hostkey '; head -n 1 "$f"; fi
done
"""

# Creates an ed25519 key only if none exists; flock on ~/.ssh serialises nodes that share a home.
KEYGEN = (
    r"""
umask 077
mkdir -p .ssh && chmod 700 .ssh
flock .ssh sh -c 'for f in .ssh/id_ed25519 .ssh/id_rsa .ssh/id_ecdsa; do [ -f "$f" ] && exit 0; done
  ssh-keygen -q -t ed25519 -N "" -C "meshkit-generated@$(hostname)" -f .ssh/id_ed25519'
"""
    + INSPECT
)


@dataclass
class NodeFacts:
    host: Host
    inspection: Inspection
    authorized: str | None
    known: str | None


@dataclass
class NodePlan:
    generate_key: bool = False
    authorized: str = ""
    authorized_added: list[str] = field(default_factory=list)
    known: str = ""
    known_added: list[str] = field(default_factory=list)
    conflicts: list[str] = field(default_factory=list)

    @property
    def changes(self) -> bool:
        return self.generate_key or bool(self.authorized_added or self.known_added)


def inspect(remote: Remote) -> NodeFacts:
    """Read-only, over SFTP alone (no remote shell is started): the user key (the first of
    USER_KEY_FILES whose private half exists too), the host keys sshd serves, and the two files."""
    text = "".join(f"userkey {pub}\n" for pub in _user_keys(remote)[:1])
    text += "".join(f"hostkey {pub}\n" for pub in _host_keys(remote))
    facts = keys.parse_inspection(text, remote.host.label)
    kind, blob = remote.server_key
    if not any(k.kind == kind and k.blob == blob for k in facts.host_keys):
        raise KeyFormatError(
            f"the {kind} host key this connection was shown is not among /etc/ssh/ssh_host_*_key.pub; "
            "is sshd using other key files?"
        )
    return NodeFacts(remote.host, facts, remote.read_text(AUTHORIZED), remote.read_text(KNOWN))


def _user_keys(remote: Remote) -> list[str]:
    found = []
    for path in USER_KEY_FILES:
        pub = remote.read_text(path + ".pub")
        if pub is not None and remote.exists(path):
            found.append(pub.splitlines()[0] if pub.strip() else "")
    return found


def _host_keys(remote: Remote) -> list[str]:
    names = sorted(
        n
        for n in remote.listdir("/etc/ssh")
        if n.startswith("ssh_host_") and n.endswith("_key.pub")
    )
    return [line for n in names if (line := (remote.read_text(f"/etc/ssh/{n}") or "").strip())]


def generate_key(remote: Remote) -> Inspection:
    code, out, err = remote.run(KEYGEN)
    if code != 0:
        raise KeyFormatError(
            f"creating ~/.ssh/id_ed25519 failed (exit {code}): {err.strip()[:200]}"
        )
    return keys.parse_inspection(out, remote.host.label)


def known_names(host: Host, addresses: Sequence[str]) -> list[str]:
    """Every name a node is reached by: as written in the hostfile, and by each of its addresses."""
    return list(
        dict.fromkeys([host.known_hosts_name(), *(host.known_hosts_name(a) for a in addresses)])
    )


def plan(
    facts: Sequence[NodeFacts], addresses: Mapping[str, Sequence[str]]
) -> dict[Host, NodePlan]:
    """Pure: the new authorized_keys and known_hosts of every node. A node whose user key does not
    exist yet gets a placeholder plan (``generate_key``); run ``plan`` again once keys exist."""
    user_keys = [
        (f.host.label, f.inspection.user_key) for f in facts if f.inspection.user_key is not None
    ]
    host_entries = [
        (known_names(f.host, addresses.get(f.host.host, ())), k)
        for f in facts
        for k in f.inspection.host_keys
    ]
    plans = {}
    for f in facts:
        auth, auth_added = keys.merge_authorized(f.authorized or "", user_keys)
        known, known_added, conflicts = keys.merge_known_hosts(f.known or "", host_entries)
        plans[f.host] = NodePlan(
            generate_key=f.inspection.user_key is None,
            authorized=auth,
            authorized_added=auth_added,
            known=known,
            known_added=known_added,
            conflicts=[c.describe(f.host.label) for c in conflicts],
        )
    return plans


def install(remote: Remote, node_plan: NodePlan) -> None:
    remote.ensure_dir(".ssh", 0o700)
    if node_plan.authorized_added:
        remote.write_atomic(AUTHORIZED, node_plan.authorized, 0o600)
    if node_plan.known_added:
        remote.write_atomic(KNOWN, node_plan.known, 0o600)


@dataclass(frozen=True)
class PairFailure:
    source: Host
    target: Host
    error: str


def verify_script(hosts: Sequence[Host], connect_timeout: float, start: int = 0) -> str:
    """From one node to every node: plain OpenSSH, BatchMode, strict host keys. Host data enters the
    script only through shlex.join. Node ``start`` begins with target ``start``, so at any moment
    each target gets about one batch of logins, not all N."""
    lines = [
        'check() { i=$1; shift; if out=$("$@" 2>&1 </dev/null); then echo "ok $i"; '
        'else echo "fail $i $(printf %s "$out" | tr "\\n" " " | cut -c1-300)"; fi; }'
    ]
    order = [(start + k) % len(hosts) for k in range(len(hosts))]
    for k, i in enumerate(order):
        target = hosts[i]
        argv = [
            "ssh",
            "-o",
            "BatchMode=yes",
            "-o",
            "StrictHostKeyChecking=yes",
            "-o",
            f"ConnectTimeout={int(connect_timeout)}",
            "-o",
            "LogLevel=ERROR",
        ]
        if target.port:
            argv += ["-p", str(target.port)]
        if target.user:
            argv += ["-l", target.user]
        argv += ["--", target.host, "true"]
        lines.append(f"check {i} {shlex.join(argv)} &")
        if (k + 1) % VERIFY_BATCH == 0:
            lines.append("wait")
    lines.append("wait")
    return "\n".join(lines) + "\n"


def parse_verify(source: Host, hosts: Sequence[Host], output: str) -> list[PairFailure]:
    seen: dict[int, str | None] = {}
    for line in output.splitlines():
        status, _, rest = line.partition(" ")
        index, _, error = rest.partition(" ")
        if status in ("ok", "fail") and index.isdigit() and int(index) < len(hosts):
            seen[int(index)] = None if status == "ok" else (error.strip() or "failed")
    return [
        PairFailure(source, target, seen[i] or "" if i in seen else "no result")
        for i, target in enumerate(hosts)
        if seen.get(i, "no result") is not None
    ]


def verify(cluster: Cluster, hosts: Sequence[Host]) -> list[PairFailure]:
    """The N x N check, run on the nodes over the controller's existing connections."""
    # Each node makes N logins, VERIFY_BATCH at a time; each batch may take up to connect_timeout
    # (and on an oversubscribed machine, logins queue for CPU): budget the batches on top of the
    # usual command timeout.
    batches = -(-len(hosts) // VERIFY_BATCH)
    timeout = cluster.settings.command_timeout + cluster.settings.connect_timeout * batches
    rank = {h: i for i, h in enumerate(hosts)}
    results = cluster.each(
        "verify",
        lambda r: r.run(
            verify_script(hosts, cluster.settings.connect_timeout, rank[r.host]), timeout=timeout
        )[1],
        hosts,
    )
    failures: list[PairFailure] = []
    for source in hosts:
        outcome = results.get(source)
        if outcome is None or outcome.value is None:
            reason = (
                cluster.failures.get(source)
                or (outcome.error if outcome else None)
                or "unreachable"
            )
            failures += [
                PairFailure(source, t, f"controller cannot use {source.label}: {reason}")
                for t in hosts
            ]
        else:
            failures += parse_verify(source, hosts, outcome.value)
    return failures


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
class Unmesh:
    authorized: str | None
    authorized_removed: int
    known: str | None
    known_removed: int
    remove_key: str | None  # the generated key file to delete, if any


def plan_unmesh(f: NodeFacts, keep_keys: bool) -> Unmesh:
    auth, auth_removed = keys.remove_tagged(f.authorized or "", known_hosts=False)
    known, known_removed = keys.remove_tagged(f.known or "", known_hosts=True)
    key_file = None
    if not keep_keys and f.inspection.generated and f.inspection.user_key is not None:
        key_file = {"ssh-ed25519": ".ssh/id_ed25519", "ssh-rsa": ".ssh/id_rsa"}.get(
            f.inspection.user_key.kind, ".ssh/id_ecdsa"
        )
    return Unmesh(
        auth if f.authorized is not None else None,
        auth_removed,
        known if f.known is not None else None,
        known_removed,
        key_file,
    )


def apply_unmesh(remote: Remote, change: Unmesh) -> None:
    for path, text, removed in (
        (AUTHORIZED, change.authorized, change.authorized_removed),
        (KNOWN, change.known, change.known_removed),
    ):
        if removed and text is not None:
            if text.strip():
                remote.write_atomic(path, text, 0o600)
            else:
                remote.remove(path)  # it held only what mesh added
    if change.remove_key:
        remote.remove(change.remove_key)
        remote.remove(change.remove_key + ".pub")


def placeholder_key(host: Host) -> PublicKey:
    """Stands in for a user key that --dry-run would create (never written anywhere): a well-formed
    ed25519 blob derived from the node's name, so each node's placeholder is distinct."""
    raw = (
        struct.pack(">I", 11)
        + b"ssh-ed25519"
        + struct.pack(">I", 32)
        + hashlib.sha256(host.label.encode()).digest()
    )
    return PublicKey("ssh-ed25519", base64.b64encode(raw).decode(), f"(new key of {host.label})")
