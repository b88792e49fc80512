"""mesh, check and unmesh over the nodes: phases over one connection (one login) and one shell
(one exec channel running a small sh loop, ``NodeShell``) per node.

inspect (read only; host keys proven by sshd in the connection) -> plan (pure, meshkit.meshplan)
-> keys (create or derive missing user keys) -> install (under the node's ~/.ssh flock: re-read,
re-merge if changed, atomic rename) -> verify (N x N from the nodes themselves). Nothing is
written anywhere unless every node passed inspection (or --skip-unreachable leaves the failed
ones out) and no name conflicts. Functions return dataclasses and print nothing; domain errors
are raised for the CLI to report.
"""

from __future__ import annotations

import contextlib
import fnmatch
import hashlib
import stat
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from .. import keys
from ..errors import KeyFormatError, MeshAbort, MeshkitError, RemoteError, UnsafeFileError
from ..hostfile import Host
from ..keys import PublicKey
from ..meshplan import (
    AUTHORIZED,
    GENERATE,
    KNOWN,
    USER_KEY_SLOTS,
    Entries,
    FileStat,
    KeySlot,
    NodeFacts,
    NodePlan,
    PairFailure,
    UnmeshPlan,
    UserKey,
    VerifyResult,
    authorized_keys_problem,
    choose_user_key,
    conflicts,
    drop_shared_addresses,
    entries,
    hostnames,
    is_meshkit_temp,
    node_names,
    parse_fib_trie,
    parse_if_inet6,
    parse_verify,
    placeholder_key,
    plan,
    plan_unmesh,
    sshd_directives,
    targets,
    unmesh_texts,
    unsafe_files,
    verify_script,
)
from ..record import replace
from ..remote import Cluster, Remote, Settings, failed, succeeded
from ..remote.connection import MAX_READ, NodeShell, Reply
from ..remote.group import ProgressFn
from ..remote.hostkeys import proven_host_keys

WRITE_ATTEMPTS = 4  # re-merges when someone changes a file while we write; then give up
SSHD_CONFIG = "/etc/ssh/sshd_config"


# ---------------------------------------------------------------- inspect

# Every read, write, key and lock of mesh and unmesh goes through one NodeShell per node (one exec
# channel, so the user's shell and its ~/.bashrc start once per node); SFTP is not used: its
# subsystem starts the user's shell too, wherever sshd runs sftp-server.


def _text(reply: Reply, path: str, limit: int, strict: bool) -> str | None:
    """A file's text (None when missing); more than ``limit`` bytes, or unreadable, is an error
    when ``strict``, else ''."""
    if reply.status == "none":
        return None
    if reply.status != "ok" or len(reply.body) > limit:
        if not strict:
            return ""
        if reply.status == "denied":
            raise MeshkitError(f"~/{path} is not readable")
        if reply.status != "ok":
            raise MeshkitError(f"reading ~/{path} failed on the node")
        raise MeshkitError(f"{path} is larger than {limit} bytes; meshkit will not read it")
    return reply.body.decode(errors="replace")


def _cat(path: str, limit: int = MAX_READ) -> str:
    """Read exactly (base64 on the wire): the files mesh rewrites, and large ones."""
    return f"cat {limit + 1} {path}"


def _txt(path: str, lines: int = 10000) -> str:
    """Read a small text file with shell builtins (no process on the node), up to ``lines``."""
    return f"txt {lines} {path}"


Stats = dict[str, tuple[int, int]]


def _stats(reply: Reply) -> Stats:
    """``stat`` answers by path: (st_mode, uid); a missing path is absent."""
    out = {}
    for line in reply.body.decode(errors="replace").splitlines():
        parts = line.split(" ", 2)
        if len(parts) == 3 and parts[0].isascii() and parts[1].isascii():
            with contextlib.suppress(ValueError):
                out[parts[2]] = (int(parts[0], 16), int(parts[1]))
    return out


# lstat of home and the two files (and the key slots in inspect); stat of ~/.ssh, which may be a
# link (to a shared home): judge what it points at. Paths here have no spaces.
LSTAT = f"stat - . {AUTHORIZED} {KNOWN}"
STAT_SSH = "stat -L .ssh"


def _check_files(shell: NodeShell, label: str, home: str, lst: Stats, ssh: Stats) -> None:
    """Refuse (never repair) a ~/.ssh that sshd's StrictModes would refuse, and symlinks."""
    home_stat = FileStat.of(home, *lst.get(".", (None, None)))
    found = [FileStat.of("~/.ssh", *ssh.get(".ssh", (None, None)))]
    if found[0].kind == "dir":
        for path in (AUTHORIZED, KNOWN):
            mode, uid = lst.get(path, (None, None))
            target = ""
            if mode is not None and stat.S_ISLNK(mode):
                target = shell.one(f"link - {path}").body.decode(errors="replace").strip()
            found.append(FileStat.of("~/" + path, mode, uid, target))
    problems = unsafe_files(label, home_stat, found)
    if problems:
        raise UnsafeFileError(problems)


def _authorized_keys_file(
    shell: NodeShell, path: str, text: str, depth: int
) -> tuple[str | None, str]:
    """sshd's first AuthorizedKeysFile (Include files followed in place, as sshd reads them)."""
    for word, args in sshd_directives(text):
        if word == "authorizedkeysfile":
            return args, path
        if word == "include" and depth < 4:
            for pattern in args.split():
                full = pattern if pattern.startswith("/") else f"/etc/ssh/{pattern}"
                folder, _, glob = full.rpartition("/")
                listed = shell.one(f"ls - {folder or '/'}").body.decode(errors="replace")
                names = sorted(n for n in listed.splitlines() if fnmatch.fnmatch(n, glob))
                paths = [f"{folder}/{name}" for name in names]
                replies = shell.ask(*(_txt(p) for p in paths)) if paths else []
                for included, reply in zip(paths, replies):
                    value, where = _authorized_keys_file(
                        shell, included, _text(reply, included, 256 << 10, False) or "", depth + 1
                    )
                    if value is not None:
                        return value, where
    return None, path


def _names(remote: Remote, hostname: str, files: dict[str, str]) -> list[tuple[str, str]]:
    """Gathered on the node over the same connection: its hostnames and every usable address of
    its network namespace (what ``hostname``, ``hostname -f`` and ``ip addr`` would say)."""
    host, port = remote.address
    connected = [(host, "ssh_config HostName")]
    peer = remote.peer
    if peer:
        connected.append((peer, "connected address"))
    own = hostnames(hostname, files["/etc/hosts"], files["/proc/sys/kernel/domainname"])
    addresses = parse_fib_trie(files["/proc/net/fib_trie"])
    addresses += parse_if_inet6(files["/proc/net/if_inet6"])
    return node_names(remote.host, port, connected, own, addresses)


# What inspect reads besides ~/.ssh, and how much of each (bytes).
SYSTEM_FILES = {
    "/proc/sys/kernel/hostname": 4096,
    "/etc/hosts": 256 << 10,
    "/proc/sys/kernel/domainname": 4096,
    "/proc/net/fib_trie": 4 << 20,
    "/proc/net/if_inet6": 256 << 10,
    SSHD_CONFIG: 256 << 10,
}
EXACT = {"/proc/net/fib_trie"}  # large on a router-like host: read by head -c, not line by line


# The standard host key files (others that /etc/ssh lists are read in a second round).
HOST_KEY_FILES = tuple(f"ssh_host_{k}_key.pub" for k in ("ecdsa", "ed25519", "rsa"))
# inspect's first round, sent as soon as the node's connection opens (see ``_start_shell``).
INSPECT = (
    "home",
    f"{LSTAT} {' '.join(USER_KEY_SLOTS)}",
    STAT_SSH,
    *(_txt(p + ".pub", 4) for p in USER_KEY_SLOTS),
    *(_cat(p, n) if p in EXACT else _txt(p) for p, n in SYSTEM_FILES.items()),
    _cat(AUTHORIZED),
    _cat(KNOWN),
    "ls - .ssh",
    "ls - /etc/ssh",
    *(_txt(f"/etc/ssh/{name}", 4) for name in HOST_KEY_FILES),
)


def inspect(remote: Remote, shell: NodeShell) -> NodeFacts:
    """Read only, in one pipelined round over the node shell (two when sshd_config includes
    files or /etc/ssh holds other host key files): refuses unsafe files; finds the user key, the
    host keys sshd proves it serves, every name the node answers to, the two files, stale
    temps. The first round was sent when the connection opened (``_start_shell``)."""
    label = remote.host.label
    with remote.bounded("inspect"):
        first = shell.receive(len(INSPECT))
        home, lst, ssh = first[0].text, _stats(first[1]), _stats(first[2])
        k = len(USER_KEY_SLOTS)
        publics, rest = first[3 : 3 + k], first[3 + k :]
        files = {p: _text(r, p, n, False) or "" for (p, n), r in zip(SYSTEM_FILES.items(), rest)}
        authorized, known, in_ssh, in_etc = rest[len(SYSTEM_FILES) : len(SYSTEM_FILES) + 4]
        standard = dict(zip(HOST_KEY_FILES, rest[len(SYSTEM_FILES) + 4 :]))
        _check_files(shell, label, home, lst, ssh)
        # sshd must read ~/.ssh/authorized_keys, or the keys mesh installs are never used.
        value, where = _authorized_keys_file(shell, SSHD_CONFIG, files[SSHD_CONFIG], 0)
        problem = authorized_keys_problem(label, value, where, home)
        if problem:
            raise RemoteError(problem)
        slots = [
            KeySlot(path, path in lst, _text(public, path + ".pub", 64 << 10, True))
            for path, public in zip(USER_KEY_SLOTS, publics)
        ]
        user = choose_user_key(slots, label)
        claimed, notes = _claimed_host_keys(shell, _listing(in_etc), standard)
        host_keys, unproven, how = proven_host_keys(remote, claimed)
        hostname = files["/proc/sys/kernel/hostname"].strip()
        return NodeFacts(
            host=remote.host,
            user=user,
            host_keys=tuple(host_keys),
            names=tuple(_names(remote, hostname, files)),
            authorized=_text(authorized, AUTHORIZED, MAX_READ, True),
            known=_text(known, KNOWN, MAX_READ, True),
            hostname=hostname,
            stale=tuple(n for n in _listing(in_ssh) if is_meshkit_temp(n)),
            notes=tuple(notes + unproven),
            home=home,
            host_keys_by=how,
        )


def _listing(reply: Reply) -> list[str]:
    return reply.body.decode(errors="replace").splitlines() if reply.status == "ok" else []


def _claimed_host_keys(
    shell: NodeShell, listing: list[str], standard: dict[str, Reply]
) -> tuple[list[PublicKey], list[str]]:
    names = sorted(n for n in listing if n.startswith("ssh_host_") and n.endswith("_key.pub"))
    others = [n for n in names if n not in standard]
    replies = (
        {**standard, **dict(zip(others, shell.ask(*(_txt(f"/etc/ssh/{n}", 4) for n in others))))}
        if others
        else standard
    )
    found, notes = [], []
    for name in names:
        text = (_text(replies[name], name, 64 << 10, False) or "").strip()
        try:
            found.append(keys.parse_public_key(text, f"/etc/ssh/{name}"))
        except KeyFormatError as exc:
            notes.append(str(exc))
    return found, notes


def own_hostname(remote: Remote) -> str:
    try:
        code, out, _ = remote.run("head -c 256 /proc/sys/kernel/hostname")
        return out.strip() if code == 0 else ""
    except (OSError, MeshkitError):
        return ""


# ---------------------------------------------------------------- keys and install


def make_user_key(remote: Remote, shell: NodeShell, user: UserKey) -> UserKey:
    """Create (ssh-keygen) or derive (ssh-keygen -y) the node's user key under the ~/.ssh lock;
    never overwrites (a file that appeared meanwhile is kept, and its public half read)."""
    label = remote.host.label
    if user.action == "derive":
        spec = "derive"
    else:
        spec = f"{GENERATE[user.path]}:{keys.GENERATED_COMMENT}{keys.check_label(label)}"
    with remote.bounded("keys"):
        reply = shell.one(f"keygen {spec} {user.path}")
    if reply.status != "ok":
        verb = "deriving the public half of" if user.action == "derive" else "creating"
        err = reply.body.decode(errors="replace").strip()[:200] or "could not lock ~/.ssh"
        raise KeyFormatError(
            f"{verb} ~/{user.path} failed ({reply.text or 'flock'}): {err}"
            + (
                "; is the key protected by a passphrase? write its .pub yourself"
                if user.action == "derive"
                else ""
            )
        )
    text = reply.body.decode(errors="replace").strip()
    line = text.splitlines()[0] if text else ""
    return replace(user, key=keys.parse_public_key(line, f"{label}: ~/{user.path}.pub"))


@dataclass
class Written:
    """What install did on one node: the merges it wrote, and the stale temps it removed."""

    plan: NodePlan
    cleaned: int = 0
    remerged: bool = False


def _digest(reply: Reply) -> str:
    return "none" if reply.status == "none" else hashlib.sha256(reply.body).hexdigest()


def _temp(path: str) -> str:
    head, _, name = path.rpartition("/")
    return f"{head}/.{name}.meshkit-{uuid.uuid4().hex[:12]}"


@contextlib.contextmanager
def _locked(remote: Remote, shell: NodeShell) -> Iterator[list[Reply]]:
    """Hold flock on ~/.ssh (the node shell's own descriptor) while the body runs, and hand it
    the files as read under the lock: LSTAT, STAT_SSH, the listing of ~/.ssh, both files. The node
    lets go by itself if we vanish (EOF) or after the phase's time, so a dropped link never
    leaves the lock held."""
    hold = max(1, int(remote.remaining()) + 1)
    got = shell.ask(f"lock {hold}", LSTAT, STAT_SSH, "ls - .ssh", _cat(AUTHORIZED), _cat(KNOWN))
    if got[0].status != "ok":
        raise MeshkitError(
            "could not lock ~/.ssh (flock): is another meshkit run holding it, or is flock "
            "(util-linux) missing?"
        )
    try:
        yield got[1:]
    finally:
        if remote.conn.transport is not None and remote.conn.transport.is_active():
            with contextlib.suppress(Exception):
                shell.one("unlock")


def _put(
    shell: NodeShell, now: Sequence[Reply], new: tuple[str | None, str | None], clean: Sequence[str]
) -> bool:
    """Remove ``clean``; write the files of ``new`` that differ from ``now`` as temps; then, in
    one node-side step, compare both files with what ``now`` read and rename the temps over them
    (or remove a file that mesh emptied): False (nothing renamed, temps gone) when someone
    changed them meanwhile."""
    requests: list[str | tuple[str, bytes]] = [f"rm - .ssh/{name}" for name in clean]
    moves = []
    for path, old, text in zip((AUTHORIZED, KNOWN), now, new):
        current = old.body.decode(errors="replace") if old.status == "ok" else ""
        if text is None or text == current:
            moves.append("-")
        elif not text.strip():
            moves.append("!" if old.status != "none" else "-")  # it held only what mesh added
        else:
            data = text.encode()
            moves.append(_temp(path))
            requests.append((f"put {len(data)} {moves[-1]}", data))
    if moves == ["-", "-"]:
        if requests:
            shell.ask(*requests)
        return True
    requests.append(
        (f"commit {_digest(now[0])} {_digest(now[1])}", f"{' '.join(moves)}\n".encode())
    )
    replies = shell.ask(*requests)
    if any(r.status != "ok" for r in replies[:-1]) or replies[-1].status not in ("ok", "changed"):
        raise MeshkitError("writing ~/.ssh files failed on the node (disk full? read-only?)")
    return replies[-1].status == "ok"


def install(
    remote: Remote, shell: NodeShell, fact: NodeFacts, planned: NodePlan, wanted: Entries
) -> Written:
    """Under the node's ~/.ssh flock: clean stale temps, re-read both files and re-merge if they
    changed since inspect, write temps, compare once more right before the renames (re-merging
    again if a writer that ignores the lock got in between). Bounded by command_timeout."""
    label = remote.host.label
    with remote.bounded("install"), _locked(remote, shell) as got:
        stale = [n for n in _listing(got[2]) if is_meshkit_temp(n)]
        files = got[3:5]
        _check_files(shell, label, fact.home, _stats(got[0]), _stats(got[1]))
        inspected = (fact.authorized, fact.known)
        current = planned
        for attempt in range(WRITE_ATTEMPTS):
            files, now = _reread(shell, files, attempt)
            if now != inspected or attempt:
                auth, known = wanted.merge(now[0] or "", now[1] or "")
                if known.conflicts:
                    raise MeshkitError(
                        [c.describe(label) for c in known.conflicts]
                        + ["known_hosts changed during mesh and now conflicts; nothing written"]
                    )
                current = replace(planned, authorized=auth, known=known)
            new = (
                current.authorized.text if current.authorized.changed else None,
                current.known.text if current.known.changed else None,
            )
            if _put(shell, files, new, stale if not attempt else ()):
                return Written(current, len(stale), now != inspected)
        raise MeshkitError(
            f"~/.ssh files kept changing while mesh wrote them ({WRITE_ATTEMPTS} tries); "
            "rerun mesh when nothing else edits them"
        )


def _reread(
    shell: NodeShell, files: list[Reply], attempt: int
) -> tuple[list[Reply], tuple[str | None, str | None]]:
    """Both files as the lock's first read gave them, or (a later attempt) read again."""
    if attempt:
        files = shell.ask(_cat(AUTHORIZED), _cat(KNOWN))
    return files, (
        _text(files[0], AUTHORIZED, MAX_READ, True),
        _text(files[1], KNOWN, MAX_READ, True),
    )


def apply_unmesh(
    remote: Remote, shell: NodeShell, change: UnmeshPlan, fact: NodeFacts, mesh: str
) -> UnmeshPlan:
    """Under the ~/.ssh flock, re-read and take this mesh's lines off what is there now."""
    with remote.bounded("unmesh"), _locked(remote, shell) as got:
        stale = [n for n in _listing(got[2]) if is_meshkit_temp(n)]
        files = got[3:5]
        result = change
        for attempt in range(WRITE_ATTEMPTS):
            files, now = _reread(shell, files, attempt)
            if now != (fact.authorized, fact.known):
                auth, a_n, known, k_n = unmesh_texts(now[0], now[1], mesh)
                result = replace(
                    change, authorized=auth, authorized_removed=a_n, known=known, known_removed=k_n
                )
            new = (
                result.authorized if result.authorized_removed else None,
                result.known if result.known_removed else None,
            )
            if _put(shell, files, new, stale if not attempt else ()):
                break
        else:
            raise MeshkitError("~/.ssh files kept changing during unmesh; rerun it")
        if result.remove_key:
            shell.ask(f"rm - {result.remove_key}", f"rm - {result.remove_key}.pub")
        return result


# ---------------------------------------------------------------- verify


def verify(
    cluster: Cluster,
    hosts: Sequence[Host],
    own: dict[Host, str] | None = None,
    shells: dict[Host, NodeShell] | None = None,
) -> VerifyResult:
    """The N x N check, run on the nodes over the controller's existing connections (over their
    node shells when given: no new shell on the source): one full login per ordered pair by the
    hostfile spelling; by each node's own hostname, its host-key check alone (no login)."""
    from ..meshplan import VERIFY_BATCH

    if own is None:
        own = {
            h: v
            for h, v in succeeded(cluster.each("names", own_hostname, hosts, quiet=True)).items()
        }
    # Each node makes its logins VERIFY_BATCH at a time; each batch may take up to connect_timeout:
    # budget the batches on top of the usual command timeout.
    batches = -(-len(targets(hosts, own)) // VERIFY_BATCH)
    timeout = cluster.settings.command_timeout + cluster.settings.connect_timeout * batches
    rank = {h: i for i, h in enumerate(hosts)}

    def run(r: Remote) -> str:
        with r.bounded("verify", timeout):
            script = verify_script(hosts, cluster.settings.connect_timeout, rank[r.host], own)
            shell = (shells or {}).get(r.host)
            if shell is None:
                return r.run(script, timeout=timeout)[1]
            data = script.encode()
            return shell.one((f"sh {len(data)}", data)).body.decode(errors="replace")

    results = cluster.each("verify", run, hosts)
    out = VerifyResult(list(hosts))
    for source in hosts:
        outcome = results.get(source)
        if outcome is None or outcome.value is None:
            reason = (
                cluster.failures.get(source)
                or (outcome.error if outcome else None)
                or "unreachable"
            )
            out.failures += [
                PairFailure(source, t, f"controller cannot use {source.label}: {reason}")
                for t in hosts
            ]
        else:
            out.failures += parse_verify(source, hosts, outcome.value, own)
    return out


# ---------------------------------------------------------------- the operations


@dataclass
class NodeReport:
    host: Host
    user_key: str  # kept | create | created | derive | derived
    authorized_added: list[str] = field(default_factory=list)
    authorized_claimed: int = 0
    known_added: list[str] = field(default_factory=list)
    known_claimed: int = 0
    cleaned: int = 0
    result: str = "unchanged"  # changed | unchanged | failed (or "would change" in a dry run)
    error: str | None = None
    notes: list[str] = field(default_factory=list)


@dataclass
class MeshReport:
    hosts: list[Host]
    mesh_id: str
    dry_run: bool
    nodes: list[NodeReport] = field(default_factory=list)
    left_out: dict[Host, str] = field(default_factory=dict)
    names: dict[Host, list[tuple[str, str]]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    verify: VerifyResult | None = None
    host_keys_by: dict[Host, str] = field(default_factory=dict)  # how each node's were proven

    @property
    def failed(self) -> list[NodeReport]:
        return [n for n in self.nodes if n.result == "failed"]

    @property
    def ok(self) -> bool:
        return not self.failed and not self.left_out and not (self.verify and self.verify.failures)


class Shells:
    """Each node's one shell for this run, started as its connection opens (Cluster's
    ``on_open``, in the connecting worker) with inspect's first round already sent, so the
    user's shell start-up (its ~/.bashrc) overlaps the other nodes' connects."""

    def __init__(self) -> None:
        self.shells: dict[Host, NodeShell] = {}
        self.errors: dict[Host, Exception] = {}

    def start(self, remote: Remote) -> None:
        try:
            self.shells[remote.host] = NodeShell(remote, *INSPECT)
        except Exception as exc:  # on_open must not raise: inspect reports it for this node
            self.errors[remote.host] = exc

    def __getitem__(self, host: Host) -> NodeShell:
        if host in self.errors:
            raise self.errors[host]
        return self.shells[host]


def _abort(failures: dict[Host, str], what: str) -> MeshAbort:
    lines = [f"{what}: {len(failures)} node(s) failed, so no node was changed:"]
    lines += [f"  {h.label}: {err}" for h, err in failures.items()]
    lines.append("  fix them, or rerun with --skip-unreachable to leave them out")
    return MeshAbort(lines)


def _node_report(f: NodeFacts, p: NodePlan, dry_run: bool) -> NodeReport:
    verb = {"generate": "create", "derive": "derive", "kept": "kept"}[p.user_key]
    if not dry_run and verb != "kept":
        verb += "d"
    return NodeReport(
        f.host,
        verb,
        p.authorized.added,
        p.authorized.claimed,
        p.known.added,
        p.known.claimed,
        len(p.stale),
        ("would change" if dry_run else "changed") if p.changes else "unchanged",
        notes=list(f.notes),
    )


def mesh(
    hosts: Sequence[Host],
    settings: Settings,
    mesh_id: str,
    *,
    skip_unreachable: bool = False,
    dry_run: bool = False,
    check: bool = True,
    progress: ProgressFn | None = None,
) -> MeshReport:
    """Passwordless SSH among ``hosts`` with strict host keys, in one login per node."""
    if dry_run:
        settings = replace(settings, record_new_host_keys=False)
    report = MeshReport(list(hosts), mesh_id, dry_run)
    shells = Shells()
    with Cluster(hosts, settings, progress=progress, on_open=shells.start) as cluster:
        inspected = cluster.each("inspect", lambda r: inspect(r, shells[r.host]))
        failures = {**cluster.failures, **failed(inspected)}
        if failures and not skip_unreachable:
            raise _abort(failures, "mesh")
        facts = [f for h in hosts if (f := succeeded(inspected).get(h)) is not None]
        if not facts:
            raise MeshAbort("mesh: no node is reachable")
        report.left_out = failures
        kept, shared = drop_shared_addresses({f.host: f.names for f in facts})
        for f in facts:
            f.names = tuple(kept[f.host])
        report.notes = shared
        report.names = {f.host: list(f.names) for f in facts}
        report.host_keys_by = {f.host: f.host_keys_by for f in facts}
        live = [f.host for f in facts]
        if dry_run:
            shown = [
                f if f.user.key else replace(f, user=replace(f.user, key=placeholder_key(f.host)))
                for f in facts
            ]
            plans = plan(shown, mesh_id)
            for f in facts:
                plans[f.host].user_key = f.user.action
            stop = conflicts(facts, plans)
            if stop:
                raise MeshkitError([*stop, "mesh: conflicts; nothing would be written"])
            report.nodes = [_node_report(f, plans[f.host], True) for f in facts]
            return report
        # Conflicts between names are known before any key is made: stop before writing.
        stop = conflicts(facts, plan(facts, mesh_id))
        if stop:
            raise MeshkitError([*stop, "mesh: conflicts; nothing was written"])
        todo = [f for f in facts if f.user.action != "kept"]
        made = cluster.each(
            "keys",
            lambda r: make_user_key(
                r, shells[r.host], next(f.user for f in todo if f.host == r.host)
            ),
            [f.host for f in todo],
        )
        bad = failed(made)
        if bad:
            raise MeshkitError(
                [f"  {h.label}: {e}" for h, e in bad.items()]
                + ["mesh: user keys failed; authorized_keys and known_hosts were not changed"]
            )
        for f in facts:
            f.user = succeeded(made).get(f.host, f.user)
        plans = plan(facts, mesh_id)
        stop = conflicts(facts, plans)
        if stop:
            raise MeshkitError([*stop, "mesh: conflicts; nothing was written"])
        wanted = entries(facts, mesh_id)
        by_host = {f.host: f for f in facts}
        needed = [h for h in live if plans[h].changes]
        written = cluster.each(
            "install",
            lambda r: install(r, shells[r.host], by_host[r.host], plans[r.host], wanted),
            needed,
        )
        for f in facts:
            outcome = written.get(f.host)
            p = outcome.value.plan if outcome and outcome.value else plans[f.host]
            node = _node_report(f, p, False)
            if outcome is not None and outcome.value is not None:
                node.cleaned = outcome.value.cleaned
                if outcome.value.remerged:
                    node.notes.append("files changed since inspect: merged again before writing")
            if outcome is not None and outcome.error is not None:
                node.result, node.error = "failed", outcome.error
            report.nodes.append(node)
        if check and not report.failed:
            report.verify = verify(
                cluster, live, {f.host: f.hostname for f in facts}, shells.shells
            )
    return report


def check(
    hosts: Sequence[Host], settings: Settings, progress: ProgressFn | None = None
) -> VerifyResult:
    """Every pair, from the nodes themselves: a login by the hostfile spelling, the host-key
    check by hostname."""
    with Cluster(hosts, settings, progress=progress) as cluster:
        return verify(cluster, hosts)


@dataclass
class UnmeshNode:
    host: Host
    plan: UnmeshPlan
    result: str = "unchanged"  # removed | unchanged | failed (or "would change")
    error: str | None = None


@dataclass
class UnmeshReport:
    mesh_id: str
    dry_run: bool
    nodes: list[UnmeshNode] = field(default_factory=list)

    @property
    def failed(self) -> list[UnmeshNode]:
        return [n for n in self.nodes if n.result == "failed"]


def unmesh(
    hosts: Sequence[Host],
    settings: Settings,
    mesh_id: str,
    *,
    keep_keys: bool = False,
    dry_run: bool = False,
    progress: ProgressFn | None = None,
) -> UnmeshReport:
    """Take this mesh's lines off every node (lines other meshes also list stay, with their tag),
    delete the keys it generated that no other mesh lists, clean stale temp files."""
    if dry_run:
        settings = replace(settings, record_new_host_keys=False)
    report = UnmeshReport(mesh_id, dry_run)
    shells = Shells()
    with Cluster(hosts, settings, progress=progress, on_open=shells.start) as cluster:
        inspected = cluster.each("inspect", lambda r: inspect(r, shells[r.host]))
        failures = {**cluster.failures, **failed(inspected)}
        if failures:
            raise _abort(failures, "unmesh")
        facts = succeeded(inspected)
        changes = {h: plan_unmesh(f, mesh_id, keep_keys) for h, f in facts.items()}
        if not dry_run:
            done = cluster.each(
                "remove",
                lambda r: apply_unmesh(r, shells[r.host], changes[r.host], facts[r.host], mesh_id),
                [h for h in hosts if changes[h].changes],
            )
        for h in hosts:
            ch = changes[h]
            node = UnmeshNode(
                h, ch, ("would change" if dry_run else "removed") if ch.changes else "unchanged"
            )
            if not dry_run and h in done:
                if done[h].error is not None:
                    node.result, node.error = "failed", done[h].error
                elif done[h].value is not None:
                    node.plan = done[h].value  # type: ignore[assignment]
            report.nodes.append(node)
    return report
