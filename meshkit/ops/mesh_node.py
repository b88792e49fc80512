"""mesh's and unmesh's phases on one node, each over that node's one shell (``NodeShell``):
inspect (read only), make the user key, install the files, take a mesh's lines off.

Every change to ~/.ssh is made under the node's ~/.ssh flock: re-read, merged again if someone
changed the files since inspect, written as temporary files, renamed over the originals in one
node-side step that first compares them once more. Files that sshd's StrictModes would refuse are
refused, never repaired. Functions return records and print nothing; domain errors are raised.
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
from ..errors import KeyFormatError, MeshkitError, RemoteError, UnsafeFileError
from ..hostfile import Host
from ..keys import PublicKey
from ..meshplan import AUTHORIZED, KNOWN, USER_KEY_SLOTS, NodeFacts, NodePlan, UnmeshPlan, UserKey
from ..record import replace
from ..remote.connection import Remote
from ..remote.hostkeys import proven_host_keys
from ..remote.node_shell import MAX_READ, NodeShell, Request, ShellReply

WRITE_ATTEMPTS = 4  # re-merges when someone changes a file while we write; then give up
SSHD_CONFIG = "/etc/ssh/sshd_config"
INCLUDE_DEPTH = 4  # sshd_config Include levels followed (a loop of Includes ends there)
CONFIG_LIMIT = 256 << 10  # bytes read of an sshd_config (or a file it includes)
PUBLIC_KEY_LIMIT = 64 << 10  # bytes read of a public key file
PUBLIC_KEY_LINES = 4  # lines read of a public key file
TEXT_LINES = 10000  # lines read of a system text file
ERROR_SHOWN = 200  # characters of ssh-keygen's error shown
T = TypeVar("T")
Texts = tuple[str | None, str | None]  # authorized_keys and known_hosts (None: missing, or kept)
Change = Callable[[Texts], tuple[Texts, T]]  # the files as they are now -> what to write, and why


def _needed_text(reply: ShellReply, path: str, limit: int = MAX_READ) -> str | None:
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


def _optional_text(reply: ShellReply, limit: int) -> str:
    """A system file's text, or '' when it is missing, unreadable or larger than ``limit``."""
    if reply.status != "ok" or len(reply.body) > limit:
        return ""
    return reply.body.decode(errors="replace")


def _read_exact(path: str, limit: int = MAX_READ) -> str:
    """The request that reads a file exactly (base64 on the wire): the files mesh rewrites, and
    large ones. One byte over ``limit`` is read, so that a file too large shows."""
    return f"cat {limit + 1} {path}"


def _read_lines(path: str, lines: int = TEXT_LINES) -> str:
    """The request that reads a small text file with shell builtins (no process on the node), up
    to ``lines``."""
    return f"txt {lines} {path}"


def _listing(reply: ShellReply) -> list[str]:
    """A reply's lines (the names an ``ls`` found, say); none when the request failed."""
    if reply.status != "ok":
        return []
    return reply.body.decode(errors="replace").splitlines()


Stats = dict[str, tuple[int, int]]


def _stats(reply: ShellReply) -> Stats:
    """``stat`` answers by path: (st_mode, uid); a missing path is absent."""
    found = {}
    for line in _listing(reply):
        parts = line.split(" ", 2)
        if len(parts) == 3 and parts[0].isascii() and parts[1].isascii():
            mode, uid, path = parts
            with contextlib.suppress(ValueError):
                found[path] = (int(mode, 16), int(uid))
    return found


# lstat of home and the two files (and the key slots in inspect); stat of ~/.ssh, which may be a
# link (to a shared home): judge what it points at. Paths here have no spaces.
LSTAT = f"stat - . {AUTHORIZED} {KNOWN}"
STAT_SSH = "stat -L .ssh"
NOT_FOUND = (None, None)  # the (mode, uid) of a path that ``stat`` did not find


def _check_files(shell: NodeShell, label: str, home: str, lstats: Stats, ssh: Stats) -> None:
    """Refuse (never repair) a ~/.ssh that sshd's StrictModes would refuse, and symlinks."""
    home_stat = mp.FileStat.of(home, *lstats.get(".", NOT_FOUND))
    ssh_stat = mp.FileStat.of("~/.ssh", *ssh.get(".ssh", NOT_FOUND))
    found = [ssh_stat]
    if ssh_stat.kind == "dir":
        for path in (AUTHORIZED, KNOWN):
            mode, uid = lstats.get(path, NOT_FOUND)
            target = ""
            if mode is not None and stat.S_ISLNK(mode):
                link = shell.ask(f"link - {path}")[0]
                target = link.body.decode(errors="replace").strip()
            found.append(mp.FileStat.of("~/" + path, mode, uid, target))
    problems = mp.unsafe_files(label, home_stat, found)
    if problems:
        raise UnsafeFileError(problems)


def _authorized_keys_file(
    shell: NodeShell, path: str, text: str, depth: int
) -> tuple[str | None, str]:
    """sshd's first AuthorizedKeysFile (Include files followed in place, as sshd reads them):
    its value, and the file that set it."""
    for word, args in mp.sshd_directives(text):
        if word == "authorizedkeysfile":
            return args, path
        if word != "include" or depth >= INCLUDE_DEPTH:
            continue
        for pattern in args.split():
            full = pattern if pattern.startswith("/") else f"/etc/ssh/{pattern}"
            folder, _, glob = full.rpartition("/")
            listed = _listing(shell.ask(f"ls - {folder or '/'}")[0])
            names = sorted(fnmatch.filter(listed, glob))
            paths = [f"{folder}/{name}" for name in names]
            if not paths:
                continue
            replies = shell.ask(*(_read_lines(included) for included in paths))
            for included, reply in zip(paths, replies):
                included_text = _optional_text(reply, CONFIG_LIMIT)
                value, where = _authorized_keys_file(shell, included, included_text, depth + 1)
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
    SSHD_CONFIG: CONFIG_LIMIT,
}
EXACT = {"/proc/net/fib_trie"}  # large on a router-like host: read by head -c, not line by line


def _read_system_file(path: str, limit: int) -> str:
    if path in EXACT:
        return _read_exact(path, limit)
    return _read_lines(path)


# The standard host key files (others that /etc/ssh lists are read in a second round).
HOST_KEY_FILES = tuple(f"ssh_host_{kind}_key.pub" for kind in ("ecdsa", "ed25519", "rsa"))
# inspect's first round, sent as soon as the node's connection opens (``mesh.Shells``); ``inspect``
# reads the replies in this order.
INSPECT: tuple[Request, ...] = (
    "home",
    f"{LSTAT} {' '.join(USER_KEY_SLOTS)}",
    STAT_SSH,
    *(_read_lines(slot + ".pub", PUBLIC_KEY_LINES) for slot in USER_KEY_SLOTS),
    *(_read_system_file(path, limit) for path, limit in SYSTEM_FILES.items()),
    _read_exact(AUTHORIZED),
    _read_exact(KNOWN),
    "ls - .ssh",
    "ls - /etc/ssh",
    *(_read_lines(f"/etc/ssh/{name}", PUBLIC_KEY_LINES) for name in HOST_KEY_FILES),
)


def inspect(remote: Remote, shell: NodeShell) -> NodeFacts:
    """Read only, in one pipelined round over the node shell (two when sshd_config includes
    files or /etc/ssh holds other host key files): refuses unsafe files; finds the user key, the
    host keys sshd proves it serves, every name the node answers to (its hostnames and every
    usable address of its network namespace), the two files, stale temps. The first round was
    sent when the connection opened (``mesh.Shells``)."""
    label = remote.host.label
    with remote.bounded("inspect"):
        replies = iter(shell.receive(len(INSPECT)))  # in INSPECT's order
        home = next(replies).text
        lstats = _stats(next(replies))
        ssh_stats = _stats(next(replies))
        publics = [next(replies) for _ in USER_KEY_SLOTS]
        files = {path: _optional_text(next(replies), limit) for path, limit in SYSTEM_FILES.items()}
        authorized = next(replies)
        known = next(replies)
        in_ssh = next(replies)
        in_etc = next(replies)
        standard = {name: next(replies) for name in HOST_KEY_FILES}
        _check_files(shell, label, home, lstats, ssh_stats)
        # sshd must read ~/.ssh/authorized_keys, or the keys mesh installs are never used.
        value, where = _authorized_keys_file(shell, SSHD_CONFIG, files[SSHD_CONFIG], 0)
        problem = mp.authorized_keys_problem(label, value, where, home)
        if problem:
            raise RemoteError(problem)
        slots = []
        for path, public in zip(USER_KEY_SLOTS, publics):
            public_text = _needed_text(public, path + ".pub", PUBLIC_KEY_LIMIT)
            slots.append(mp.KeySlot(path, path in lstats, public_text))
        claimed, notes = _claimed_host_keys(shell, _listing(in_etc), standard)
        host_keys, unproven, how = proven_host_keys(remote, claimed)
        hostname = files["/proc/sys/kernel/hostname"].strip()
        connected_host, connected_port = remote.address
        connected = [(connected_host, "ssh_config HostName")]
        if remote.peer:
            connected.append((remote.peer, "connected address"))
        domain = files["/proc/sys/kernel/domainname"]
        own = mp.hostnames(hostname, files["/etc/hosts"], domain)
        addresses = mp.parse_fib_trie(files["/proc/net/fib_trie"])
        addresses += mp.parse_if_inet6(files["/proc/net/if_inet6"])
        names = mp.node_names(remote.host, connected_port, connected, own, addresses)
        stale = [name for name in _listing(in_ssh) if mp.is_meshkit_temp(name)]
        return NodeFacts(
            host=remote.host,
            user=mp.choose_user_key(slots, label),
            host_keys=tuple(host_keys),
            names=tuple(names),
            authorized=_needed_text(authorized, AUTHORIZED),
            known=_needed_text(known, KNOWN),
            hostname=hostname,
            stale=tuple(stale),
            notes=tuple(notes + unproven),
            home=home,
            host_keys_by=how,
        )


def _claimed_host_keys(
    shell: NodeShell, listing: list[str], standard: dict[str, ShellReply]
) -> tuple[list[PublicKey], list[str]]:
    """The host keys /etc/ssh holds (the standard files already read, the others read now), and
    a note for each file that is no public key."""
    names = sorted(n for n in listing if n.startswith("ssh_host_") and n.endswith("_key.pub"))
    others = [name for name in names if name not in standard]
    asked: list[ShellReply] = []
    if others:
        asked = shell.ask(*(_read_lines(f"/etc/ssh/{name}", PUBLIC_KEY_LINES) for name in others))
    replies = {**standard, **dict(zip(others, asked))}
    found: list[PublicKey] = []
    notes: list[str] = []
    for name in names:
        text = _optional_text(replies[name], PUBLIC_KEY_LIMIT).strip()
        try:
            found.append(keys.parse_public_key(text, f"/etc/ssh/{name}"))
        except KeyFormatError as exc:
            notes.append(str(exc))
    return found, notes


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
        error = reply.body.decode(errors="replace").strip()[:ERROR_SHOWN]
        if not error:
            error = "could not lock ~/.ssh"
        cause = reply.text or "flock"
        if derive:
            raise KeyFormatError(
                f"deriving the public half of ~/{user.path} failed ({cause}): {error}"
                "; is the key protected by a passphrase? write its .pub yourself"
            )
        raise KeyFormatError(f"creating ~/{user.path} failed ({cause}): {error}")
    text = reply.body.decode(errors="replace").strip()
    line = text.splitlines()[0] if text else ""
    return replace(user, key=keys.parse_public_key(line, f"{label}: ~/{user.path}.pub"))


KEEP = "-"  # commit: leave this file as it is
REMOVE = "!"  # commit: remove this file (mesh emptied it)


def _put(shell: NodeShell, now: Sequence[ShellReply], new: Texts, clean: Sequence[str]) -> bool:
    """Remove ``clean``; write the files of ``new`` that differ from ``now`` as temps; then, in
    one node-side step, compare both files with what ``now`` read and rename the temps over them
    (or remove a file that mesh emptied): False (nothing renamed, temps gone) when someone
    changed them meanwhile."""
    requests: list[Request] = [f"rm - .ssh/{name}" for name in clean]
    moves = []
    for path, old, text in zip((AUTHORIZED, KNOWN), now, new):
        current = old.body.decode(errors="replace") if old.status == "ok" else ""
        if text is None or text == current:
            moves.append(KEEP)
        elif not text.strip():
            # It held only what mesh added.
            moves.append(REMOVE if old.status != "none" else KEEP)
        else:
            folder, _, name = path.rpartition("/")
            temporary = f"{folder}/.{name}.meshkit-{uuid.uuid4().hex[:12]}"
            moves.append(temporary)
            data = text.encode()
            requests.append((f"put {len(data)} {temporary}", data))
    if moves == [KEEP, KEEP]:
        if requests:
            shell.ask(*requests)
        return True
    digests = []
    for reply in now:
        digests.append("none" if reply.status == "none" else hashlib.sha256(reply.body).hexdigest())
    commit = f"commit {' '.join(digests)}"
    replies = shell.ask(*requests, (commit, f"{' '.join(moves)}\n".encode()))
    *written, committed = replies
    if any(reply.status != "ok" for reply in written) or committed.status not in ("ok", "changed"):
        raise MeshkitError("writing ~/.ssh files failed on the node (disk full? read-only?)")
    return committed.status == "ok"


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
        got = shell.ask(
            f"lock {hold}",
            LSTAT,
            STAT_SSH,
            "ls - .ssh",
            _read_exact(AUTHORIZED),
            _read_exact(KNOWN),
        )
        locked, lstats, ssh_stats, in_ssh, *files = got
        if locked.status != "ok":
            raise MeshkitError(
                "could not lock ~/.ssh (flock): is another meshkit run holding it, or is flock "
                "(util-linux) missing?"
            )
        try:
            stale = [name for name in _listing(in_ssh) if mp.is_meshkit_temp(name)]
            _check_files(shell, remote.host.label, fact.home, _stats(lstats), _stats(ssh_stats))
            for attempt in range(WRITE_ATTEMPTS):
                if attempt:
                    files = shell.ask(_read_exact(AUTHORIZED), _read_exact(KNOWN))
                now = (_needed_text(files[0], AUTHORIZED), _needed_text(files[1], KNOWN))
                new, done = change(now)
                clean = stale if not attempt else ()
                if _put(shell, files, new, clean):
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


# What a node's user key needs (NodePlan.user_key), as planned and as done.
USER_KEY_PLANNED = {"generate": "create", "derive": "derive", "kept": "kept"}
USER_KEY_DONE = {"generate": "created", "derive": "derived", "kept": "kept"}


def node_report(facts: NodeFacts, plan: NodePlan, dry_run: bool, cleaned: int = 0) -> NodeReport:
    """A node's report before (``dry_run``) or after its files were written as ``plan`` says."""
    wording = USER_KEY_PLANNED if dry_run else USER_KEY_DONE
    user_key = wording[plan.user_key]
    if not plan.changes:
        result = "unchanged"
    elif dry_run:
        result = "would change"
    else:
        result = "changed"
    return NodeReport(facts.host, plan, user_key, result, notes=list(facts.notes), cleaned=cleaned)


def install(shell: NodeShell, fact: NodeFacts, planned: NodePlan, wanted: mp.Entries) -> NodeReport:
    """Write ``planned`` (``_rewrite``), merged again if the files changed since inspect."""

    def change(now: Texts) -> tuple[Texts, NodePlan]:
        done = planned
        if now != (fact.authorized, fact.known):
            authorized_now, known_now = now
            authorized, known = wanted.merge(authorized_now or "", known_now or "")
            if known.conflicts:
                raise MeshkitError(
                    [conflict.describe(fact.host.label) for conflict in known.conflicts]
                    + ["known_hosts changed during mesh and now conflicts; nothing written"]
                )
            done = replace(planned, authorized=authorized, known=known)
        authorized_text = done.authorized.text if done.authorized.changed else None
        known_text = done.known.text if done.known.changed else None
        return (authorized_text, known_text), done

    done, cleaned = _rewrite(shell, fact, "install", change)
    node = node_report(fact, done, False, cleaned)
    if done is not planned:
        node.notes.append("files changed since inspect: merged again before writing")
    return node


def apply_unmesh(shell: NodeShell, planned: UnmeshPlan, fact: NodeFacts, mesh: str) -> UnmeshPlan:
    """Take this mesh's lines off what is there now (``_rewrite``), then its generated key."""

    def change(now: Texts) -> tuple[Texts, UnmeshPlan]:
        done = planned
        if now != (fact.authorized, fact.known):
            authorized_now, known_now = now
            unmeshed = mp.unmesh_texts(authorized_now, known_now, mesh)
            authorized, authorized_removed, known, known_removed = unmeshed
            done = replace(
                planned,
                authorized=authorized,
                authorized_removed=authorized_removed,
                known=known,
                known_removed=known_removed,
            )
        authorized_text = done.authorized if done.authorized_removed else None
        known_text = done.known if done.known_removed else None
        return (authorized_text, known_text), done

    key = planned.remove_key
    then = (f"rm - {key}", f"rm - {key}.pub") if key else ()
    done, _ = _rewrite(shell, fact, "unmesh", change, then)
    return done
