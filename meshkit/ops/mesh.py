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
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from .. import keys
from .. import meshplan as mp
from ..errors import KeyFormatError, MeshAbort, MeshkitError, RemoteError, UnsafeFileError
from ..hostfile import Host
from ..keys import PublicKey
from ..meshplan import AUTHORIZED, KNOWN, USER_KEY_SLOTS, NodeFacts, NodePlan, UnmeshPlan, UserKey
from ..record import replace
from ..remote import Cluster, Remote, Settings, failed, succeeded
from ..remote.connection import MAX_READ, NodeShell, Reply
from ..remote.group import ProgressFn
from ..remote.hostkeys import proven_host_keys

WRITE_ATTEMPTS = 4  # re-merges when someone changes a file while we write; then give up
SSHD_CONFIG = "/etc/ssh/sshd_config"
T = TypeVar("T")
Texts = tuple[str | None, str | None]  # authorized_keys and known_hosts (None: missing, or kept)
Change = Callable[[Texts], tuple[Texts, T]]  # the files as they are now -> what to write, and why


def _text(reply: Reply, path: str, limit: int = MAX_READ) -> str | None:
    """A file mesh relies on: its text, None when missing; unreadable or too large is an error."""
    if reply.status == "none":
        return None
    if reply.status == "denied":
        raise MeshkitError(f"~/{path} is not readable")
    if reply.status != "ok":
        raise MeshkitError(f"reading ~/{path} failed on the node")
    if len(reply.body) > limit:
        raise MeshkitError(f"{path} is larger than {limit} bytes; meshkit will not read it")
    return reply.body.decode(errors="replace")


def _body(reply: Reply, limit: int) -> str:
    """A system file's text, or '' when it is missing, unreadable or larger than ``limit``."""
    ok = reply.status == "ok" and len(reply.body) <= limit
    return reply.body.decode(errors="replace") if ok else ""


def _cat(path: str, limit: int = MAX_READ) -> str:
    """Read exactly (base64 on the wire): the files mesh rewrites, and large ones."""
    return f"cat {limit + 1} {path}"


def _txt(path: str, lines: int = 10000) -> str:
    """Read a small text file with shell builtins (no process on the node), up to ``lines``."""
    return f"txt {lines} {path}"


def _listing(reply: Reply) -> list[str]:
    return reply.body.decode(errors="replace").splitlines() if reply.status == "ok" else []


Stats = dict[str, tuple[int, int]]


def _stats(reply: Reply) -> Stats:
    """``stat`` answers by path: (st_mode, uid); a missing path is absent."""
    out = {}
    for line in _listing(reply):
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
    home_stat = mp.FileStat.of(home, *lst.get(".", (None, None)))
    found = [mp.FileStat.of("~/.ssh", *ssh.get(".ssh", (None, None)))]
    if found[0].kind == "dir":
        for path in (AUTHORIZED, KNOWN):
            mode, uid = lst.get(path, (None, None))
            target = ""
            if mode is not None and stat.S_ISLNK(mode):
                target = shell.ask(f"link - {path}")[0].body.decode(errors="replace").strip()
            found.append(mp.FileStat.of("~/" + path, mode, uid, target))
    problems = mp.unsafe_files(label, home_stat, found)
    if problems:
        raise UnsafeFileError(problems)


def _authorized_keys_file(
    shell: NodeShell, path: str, text: str, depth: int
) -> tuple[str | None, str]:
    """sshd's first AuthorizedKeysFile (Include files followed in place, as sshd reads them)."""
    for word, args in mp.sshd_directives(text):
        if word == "authorizedkeysfile":
            return args, path
        if word == "include" and depth < 4:
            for pattern in args.split():
                full = pattern if pattern.startswith("/") else f"/etc/ssh/{pattern}"
                folder, _, glob = full.rpartition("/")
                listed = _listing(shell.ask(f"ls - {folder or '/'}")[0])
                names = sorted(fnmatch.filter(listed, glob))
                paths = [f"{folder}/{name}" for name in names]
                for included, reply in zip(paths, shell.ask(*map(_txt, paths)) if paths else []):
                    text = _body(reply, 256 << 10)
                    value, where = _authorized_keys_file(shell, included, text, depth + 1)
                    if value is not None:
                        return value, where
    return None, path


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
# inspect's first round, sent as soon as the node's connection opens (see ``Shells``).
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
    host keys sshd proves it serves, every name the node answers to (its hostnames and every
    usable address of its network namespace), the two files, stale temps. The first round was
    sent when the connection opened (``Shells``)."""
    label = remote.host.label
    with remote.bounded("inspect"):
        got = iter(shell.receive(len(INSPECT)))  # in INSPECT's order
        home, lst, ssh = next(got).text, _stats(next(got)), _stats(next(got))
        publics = [next(got) for _ in USER_KEY_SLOTS]
        files = {p: _body(next(got), n) for p, n in SYSTEM_FILES.items()}
        authorized, known, in_ssh, in_etc = next(got), next(got), next(got), next(got)
        standard = {name: next(got) for name in HOST_KEY_FILES}
        _check_files(shell, label, home, lst, ssh)
        # sshd must read ~/.ssh/authorized_keys, or the keys mesh installs are never used.
        value, where = _authorized_keys_file(shell, SSHD_CONFIG, files[SSHD_CONFIG], 0)
        problem = mp.authorized_keys_problem(label, value, where, home)
        if problem:
            raise RemoteError(problem)
        slots = [
            mp.KeySlot(path, path in lst, _text(public, path + ".pub", 64 << 10))
            for path, public in zip(USER_KEY_SLOTS, publics)
        ]
        claimed, notes = _claimed_host_keys(shell, _listing(in_etc), standard)
        host_keys, unproven, how = proven_host_keys(remote, claimed)
        hostname = files["/proc/sys/kernel/hostname"].strip()
        connected = [(remote.address[0], "ssh_config HostName")]
        connected += [(remote.peer, "connected address")] if remote.peer else []
        own = mp.hostnames(hostname, files["/etc/hosts"], files["/proc/sys/kernel/domainname"])
        addresses = mp.parse_fib_trie(files["/proc/net/fib_trie"])
        addresses += mp.parse_if_inet6(files["/proc/net/if_inet6"])
        names = mp.node_names(remote.host, remote.address[1], connected, own, addresses)
        return NodeFacts(
            host=remote.host,
            user=mp.choose_user_key(slots, label),
            host_keys=tuple(host_keys),
            names=tuple(names),
            authorized=_text(authorized, AUTHORIZED),
            known=_text(known, KNOWN),
            hostname=hostname,
            stale=tuple(n for n in _listing(in_ssh) if mp.is_meshkit_temp(n)),
            notes=tuple(notes + unproven),
            home=home,
            host_keys_by=how,
        )


def _claimed_host_keys(
    shell: NodeShell, listing: list[str], standard: dict[str, Reply]
) -> tuple[list[PublicKey], list[str]]:
    names = sorted(n for n in listing if n.startswith("ssh_host_") and n.endswith("_key.pub"))
    others = [n for n in names if n not in standard]
    asked = shell.ask(*(_txt(f"/etc/ssh/{n}", 4) for n in others)) if others else []
    replies = {**standard, **dict(zip(others, asked))}
    found, notes = [], []
    for name in names:
        text = _body(replies[name], 64 << 10).strip()
        try:
            found.append(keys.parse_public_key(text, f"/etc/ssh/{name}"))
        except KeyFormatError as exc:
            notes.append(str(exc))
    return found, notes


def own_hostname(remote: Remote) -> str:  # a failure leaves the node out of ``each``'s results
    code, out, _ = remote.run("head -c 256 /proc/sys/kernel/hostname")
    return out.strip() if code == 0 else ""


def make_user_key(remote: Remote, shell: NodeShell, user: UserKey) -> UserKey:
    """Create (ssh-keygen) or derive (ssh-keygen -y) the node's user key under the ~/.ssh lock;
    never overwrites (a file that appeared meanwhile is kept, and its public half read)."""
    label = remote.host.label
    derive = user.action == "derive"
    spec = "derive"
    if not derive:
        spec = f"{mp.GENERATE[user.path]}:{keys.GENERATED_COMMENT}{keys.check_label(label)}"
    with remote.bounded("keys"):
        reply = shell.ask(f"keygen {spec} {user.path}")[0]
    if reply.status != "ok":
        err = reply.body.decode(errors="replace").strip()[:200] or "could not lock ~/.ssh"
        raise KeyFormatError(
            f"{'deriving the public half of' if derive else 'creating'} ~/{user.path} failed "
            f"({reply.text or 'flock'}): {err}"
            + ("; is the key protected by a passphrase? write its .pub yourself" if derive else "")
        )
    text = reply.body.decode(errors="replace").strip()
    line = text.splitlines()[0] if text else ""
    return replace(user, key=keys.parse_public_key(line, f"{label}: ~/{user.path}.pub"))


def _put(shell: NodeShell, now: Sequence[Reply], new: Texts, clean: Sequence[str]) -> bool:
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
            head, _, name = path.rpartition("/")
            moves.append(f"{head}/.{name}.meshkit-{uuid.uuid4().hex[:12]}")
            requests.append((f"put {len(text.encode())} {moves[-1]}", text.encode()))
    if moves == ["-", "-"]:
        if requests:
            shell.ask(*requests)
        return True
    digests = ["none" if r.status == "none" else hashlib.sha256(r.body).hexdigest() for r in now]
    commit = f"commit {' '.join(digests)}"
    replies = shell.ask(*requests, (commit, f"{' '.join(moves)}\n".encode()))
    if any(r.status != "ok" for r in replies[:-1]) or replies[-1].status not in ("ok", "changed"):
        raise MeshkitError("writing ~/.ssh files failed on the node (disk full? read-only?)")
    return replies[-1].status == "ok"


def _rewrite(
    shell: NodeShell, fact: NodeFacts, phase: str, change: Change[T], then: Sequence[str] = ()
) -> tuple[T, int]:
    """Under flock on ~/.ssh: clean stale temps, re-read both files, ``change`` them (new texts,
    None for a file to keep; and what was done), write temps, compare once more right before the
    renames (changing again if a writer that ignores the lock got in between), then send
    ``then``. Returns what ``change`` did and how many stale temps went. The lock is the node
    shell's own descriptor: the node lets go by itself if we vanish (EOF) or after the phase's
    time, so a dropped link never leaves it held."""
    remote = shell.remote
    with remote.bounded(phase):
        hold = max(1, int(remote.remaining()) + 1)
        got = shell.ask(f"lock {hold}", LSTAT, STAT_SSH, "ls - .ssh", _cat(AUTHORIZED), _cat(KNOWN))
        if got[0].status != "ok":
            raise MeshkitError(
                "could not lock ~/.ssh (flock): is another meshkit run holding it, or is flock "
                "(util-linux) missing?"
            )
        try:
            stale = [n for n in _listing(got[3]) if mp.is_meshkit_temp(n)]
            files = got[4:6]
            _check_files(shell, remote.host.label, fact.home, _stats(got[1]), _stats(got[2]))
            for attempt in range(WRITE_ATTEMPTS):
                if attempt:
                    files = shell.ask(_cat(AUTHORIZED), _cat(KNOWN))
                now = (_text(files[0], AUTHORIZED), _text(files[1], KNOWN))
                new, done = change(now)
                if _put(shell, files, new, stale if not attempt else ()):
                    if then:
                        shell.ask(*then)
                    return done, len(stale)
            raise MeshkitError(
                f"~/.ssh files kept changing while meshkit wrote them ({WRITE_ATTEMPTS} tries); "
                "rerun when nothing else edits them"
            )
        finally:
            if remote.conn.transport is not None and remote.conn.transport.is_active():
                with contextlib.suppress(Exception):
                    shell.ask("unlock")


def install(shell: NodeShell, fact: NodeFacts, planned: NodePlan, wanted: mp.Entries) -> NodeReport:
    """Write ``planned`` (``_rewrite``), merged again if the files changed since inspect."""

    def change(now: Texts) -> tuple[Texts, NodePlan]:
        done = planned
        if now != (fact.authorized, fact.known):
            auth, known = wanted.merge(now[0] or "", now[1] or "")
            if known.conflicts:
                raise MeshkitError(
                    [c.describe(fact.host.label) for c in known.conflicts]
                    + ["known_hosts changed during mesh and now conflicts; nothing written"]
                )
            done = replace(planned, authorized=auth, known=known)
        auth, known = done.authorized, done.known
        return (auth.text if auth.changed else None, known.text if known.changed else None), done

    done, cleaned = _rewrite(shell, fact, "install", change)
    node = _node_report(fact, done, False, cleaned)
    if done is not planned:
        node.notes.append("files changed since inspect: merged again before writing")
    return node


def apply_unmesh(shell: NodeShell, planned: UnmeshPlan, fact: NodeFacts, mesh: str) -> UnmeshPlan:
    """Take this mesh's lines off what is there now (``_rewrite``), then its generated key."""

    def change(now: Texts) -> tuple[Texts, UnmeshPlan]:
        done = planned
        if now != (fact.authorized, fact.known):
            auth, a_n, known, k_n = mp.unmesh_texts(now[0], now[1], mesh)
            done = replace(
                planned, authorized=auth, authorized_removed=a_n, known=known, known_removed=k_n
            )
        auth = done.authorized if done.authorized_removed else None
        return (auth, done.known if done.known_removed else None), done

    key = planned.remove_key
    then = (f"rm - {key}", f"rm - {key}.pub") if key else ()
    return _rewrite(shell, fact, "unmesh", change, then)[0]


def verify(
    cluster: Cluster,
    hosts: Sequence[Host],
    own: dict[Host, str] | None = None,
    shells: dict[Host, NodeShell] | None = None,
) -> mp.VerifyResult:
    """The N x N check, run on the nodes over the controller's existing connections (over their
    node shells when given: no new shell on the source): one full login per ordered pair by the
    hostfile spelling; by each node's own hostname, its host-key check alone (no login)."""
    if own is None:
        own = dict(succeeded(cluster.each("names", own_hostname, hosts, quiet=True)))
    # Each node makes its logins VERIFY_BATCH at a time; each batch may take up to connect_timeout:
    # budget the batches on top of the usual command timeout.
    batches = -(-len(mp.targets(hosts, own)) // mp.VERIFY_BATCH)
    timeout = cluster.settings.command_timeout + cluster.settings.connect_timeout * batches
    rank = {h: i for i, h in enumerate(hosts)}

    def run(r: Remote) -> str:
        with r.bounded("verify", timeout):
            script = mp.verify_script(hosts, cluster.settings.connect_timeout, rank[r.host], own)
            shell = (shells or {}).get(r.host)
            if shell is None:
                return r.run(script, timeout=timeout)[1]
            data = script.encode()
            return shell.ask((f"sh {len(data)}", data))[0].body.decode(errors="replace")

    results = cluster.each("verify", run, hosts)
    out = mp.VerifyResult(list(hosts))
    for source in hosts:
        outcome = results.get(source)
        if outcome is not None and outcome.value is not None:
            out.failures += mp.parse_verify(source, hosts, outcome.value, own)
        else:
            why = cluster.failures.get(source) or (outcome and outcome.error) or "unreachable"
            cannot = f"controller cannot use {source.label}: {why}"
            out.failures += [mp.PairFailure(source, t, cannot) for t in hosts]
    return out


@dataclass
class NodeReport:
    """One node's outcome, with its plan (as written: merged again if the files changed)."""

    host: Host
    plan: NodePlan
    user_key: str  # kept | create | created | derive | derived
    result: str = "unchanged"  # changed | unchanged | failed (or "would change" in a dry run)
    error: str | None = None
    notes: list[str] = field(default_factory=list)
    cleaned: int = 0


@dataclass
class MeshReport:
    hosts: list[Host]
    mesh_id: str
    dry_run: bool
    nodes: list[NodeReport] = field(default_factory=list)
    left_out: dict[Host, str] = field(default_factory=dict)
    names: dict[Host, list[tuple[str, str]]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    verify: mp.VerifyResult | None = None
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

    def inspect(self, remote: Remote) -> NodeFacts:
        if remote.host in self.errors:
            raise self.errors[remote.host]
        return inspect(remote, self.shells[remote.host])


def _inspect_all(
    cluster: Cluster, shells: Shells, what: str, skip: bool = False
) -> tuple[dict[Host, NodeFacts], dict[Host, str]]:
    """Every node's facts and the nodes that failed (connect or inspect); with any failure and
    not ``skip``, stop before anything is written."""
    inspected = cluster.each("inspect", shells.inspect)
    failures = {**cluster.failures, **failed(inspected)}
    if failures and not skip:
        lines = [f"{what}: {len(failures)} node(s) failed, so no node was changed:"]
        lines += [f"  {h.label}: {err}" for h, err in failures.items()]
        lines.append("  fix them, or rerun with --skip-unreachable to leave them out")
        raise MeshAbort(lines)
    return succeeded(inspected), failures  # in the hostfile's order, as ``each`` keeps it


def _node_report(f: NodeFacts, p: NodePlan, dry_run: bool, cleaned: int = 0) -> NodeReport:
    verb = "create" if p.user_key == "generate" else p.user_key
    verb += "d" if not dry_run and verb != "kept" else ""
    result = ("would change" if dry_run else "changed") if p.changes else "unchanged"
    return NodeReport(f.host, p, verb, result, notes=list(f.notes), cleaned=cleaned)


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
        by_host, report.left_out = _inspect_all(cluster, shells, "mesh", skip_unreachable)
        facts = list(by_host.values())
        if not facts:
            raise MeshAbort("mesh: no node is reachable")
        report.names, report.notes = mp.drop_shared_addresses({f.host: f.names for f in facts})
        for f in facts:
            f.names = tuple(report.names[f.host])
        report.host_keys_by = {f.host: f.host_keys_by for f in facts}
        # Conflicts between names are known before any key is made: stop before writing. Keys
        # still to be made stand in as placeholders (shown by a dry run, never written).
        shown = [
            f if f.user.key else replace(f, user=replace(f.user, key=mp.placeholder_key(f.host)))
            for f in facts
        ]
        plans = mp.plan(shown, mesh_id)
        stop = mp.conflicts(shown, plans)
        if stop:
            raise MeshkitError(
                [*stop, f"mesh: conflicts; nothing {'would be' if dry_run else 'was'} written"]
            )
        if dry_run:
            report.nodes = [_node_report(f, plans[f.host], True) for f in facts]
            return report
        todo = {f.host: f.user for f in facts if f.user.action != "kept"}
        made = cluster.each(
            "keys", lambda r: make_user_key(r, shells.shells[r.host], todo[r.host]), list(todo)
        )
        bad = failed(made)
        if bad:
            raise MeshkitError(
                [f"  {h.label}: {e}" for h, e in bad.items()]
                + ["mesh: user keys failed; authorized_keys and known_hosts were not changed"]
            )
        for f in facts:
            f.user = succeeded(made).get(f.host, f.user)
        # With every key made, no conflict can be new: known_hosts conflicts are host keys' only.
        plans = mp.plan(facts, mesh_id)
        wanted = mp.entries(facts, mesh_id)
        written = cluster.each(
            "install",
            lambda r: install(shells.shells[r.host], by_host[r.host], plans[r.host], wanted),
            [f.host for f in facts if plans[f.host].changes],
        )
        for f in facts:
            outcome, plan = written.get(f.host), plans[f.host]
            node = outcome.value if outcome and outcome.value else _node_report(f, plan, False)
            if outcome is not None and outcome.error is not None:
                node.result, node.error = "failed", outcome.error
            report.nodes.append(node)
        if check and not report.failed:
            own = {f.host: f.hostname for f in facts}
            report.verify = verify(cluster, list(by_host), own, shells.shells)
    return report


def check(
    hosts: Sequence[Host], settings: Settings, progress: ProgressFn | None = None
) -> mp.VerifyResult:
    """``verify`` over connections of its own (``meshkit check``)."""
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
        facts, _ = _inspect_all(cluster, shells, "unmesh")
        changes = {h: mp.plan_unmesh(f, mesh_id, keep_keys) for h, f in facts.items()}

        def remove(r: Remote) -> UnmeshPlan:
            return apply_unmesh(shells.shells[r.host], changes[r.host], facts[r.host], mesh_id)

        todo = [h for h in hosts if changes[h].changes and not dry_run]
        done = cluster.each("remove", remove, todo)
        verb = "would change" if dry_run else "removed"
        for h in hosts:
            outcome = done.get(h)
            plan = outcome.value if outcome and outcome.value else changes[h]
            node = UnmeshNode(h, plan, verb if changes[h].changes else "unchanged")
            if outcome is not None and outcome.error is not None:
                node.result, node.error = "failed", outcome.error
            report.nodes.append(node)
    return report
