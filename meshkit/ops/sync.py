"""Clusters without shared storage: find out whether every node sees the launcher's workdir (a
marker file written here, looked for on every node through its agent), and copy the workdir to
the same path on the nodes that do not, through the agents already open (only files whose size or
modification time differ; never deleting anything there, never writing through a link there).
Each node's listing comes in pages and each file goes one chunk at a time, read from disk as it
is sent: memory is bounded whatever the files' number and sizes. ``plan`` is pure."""

from __future__ import annotations

import base64
import json
import os
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from stat import S_ISREG
from typing import BinaryIO

from .. import protocol
from ..errors import LaunchError
from ..hostfile import Host
from ..job import Job
from ..node.sync import MAX_FILES, refusal, walk
from ..outcome import Outcome
from .health import health_request
from .lookup import read_local
from .pool import NodePool, unanswered

ALWAYS_EXCLUDED = (".meshkit",)  # each node's logs and job state live there: never overwritten
DEFAULT_EXCLUDE = (".git", "__pycache__")
FILE_FIELDS = 100  # bytes of a small file's encoded entry besides its data and path
MTIME_SLACK = 0.002  # seconds: filesystems keep mtimes at different resolutions
# seconds for every page of a node's listing together (each page has its call's own deadline
# too): a node that sent a page now and then would otherwise hold train for as long as it liked
LISTING_SECONDS = 600.0


@dataclass(frozen=True)
class Facts:
    """One facts round (``protocol.FactsRequest``): each node's reply, and when each request left
    and its reply came back (this machine's clock, for the doctor's clock check)."""

    replies: dict[Host, Outcome[protocol.FactsReply]]
    timing: dict[Host, tuple[float, float]]
    marker: str

    def shared(self, host: Host) -> bool:
        """The one test of "does ``host`` see the workdir": it saw the marker."""
        outcome = self.replies.get(host)
        if outcome is None or outcome.value is None:
            return False
        return outcome.value.marker == "seen"


def facts_round(
    pool: NodePool,
    workdir: str,
    hosts: Sequence[Host],
    writer: Host | None,
    job: Job | None = None,
) -> Facts:
    """Versions, GPUs, clocks and the workdir of every node (with ``job``, each node's health
    for it too: the doctor's ``health`` check), with a marker in the workdir: written
    by ``writer``'s agent first (the doctor's: the master), or by this machine (``None``: the
    workdir here is what train would copy); every other node then looks for it. The marker is
    removed afterwards only when this machine wrote it; the doctor's ``DoneRequest`` removes the
    writer's."""
    token = secrets.token_hex(16)
    marker = f"{workdir.rstrip('/')}/.meshkit/.shared-{token[:16]}"
    local = Path(marker)
    if writer is None:
        try:
            local.parent.mkdir(parents=True, exist_ok=True)
            local.write_text(token)
        except OSError as exc:
            raise LaunchError(f"{workdir}: cannot write the shared-storage marker: {exc}") from None
    timing: dict[Host, tuple[float, float]] = {}
    replies: dict[Host, Outcome[protocol.FactsReply]] = {}
    sent: dict[Host, float] = {}
    others = [host for host in hosts if host != writer]
    # The writer's round first, so that its marker is there when the others look.
    rounds = [others]
    if writer is not None:
        rounds = [[writer], others]

    def request(host: Host) -> protocol.FactsRequest:
        sent[host] = time.time()
        health = None if job is None else health_request(job, host)
        return protocol.FactsRequest(workdir, marker, token, host == writer, health)

    try:
        for chosen in rounds:
            replies.update(pool.call_all("facts", request, protocol.FactsReply, chosen))
            back = time.time()
            for host in chosen:
                if host in sent:
                    timing[host] = (sent[host], back)
    finally:
        if writer is None:
            local.unlink(missing_ok=True)
    return Facts(replies, timing, marker)


def unshared(
    pool: NodePool, workdir: str, hosts: Sequence[Host], job: Job | None = None
) -> tuple[list[Host], Facts]:
    """The nodes that do not see this machine's ``workdir``, and the facts round that told
    (with ``job``, each node's health for it too); ``LaunchError`` when a node cannot be
    asked."""
    facts = facts_round(pool, workdir, hosts, None, job)
    # The first request to each node's agent: one that cannot answer (a missing interpreter,
    # say) stops the launch here, with the agent's own reason, as preflight would.
    # Only ``hosts``' failures: a supervisor's pool reaches lost nodes too.
    failures = pool.failures.items()
    problems = [
        f"{host.label}: cannot connect: {error}" for host, error in failures if host in hosts
    ]
    for host, outcome in facts.replies.items():
        if outcome.error:
            problems.append(f"{host.label}: {outcome.error}")
    if problems:
        raise LaunchError([*problems, "train: preflight failed; nothing was started"])
    lacking = [host for host in hosts if not facts.shared(host)]
    return lacking, facts


def local_files(root: str, exclude: Sequence[str]) -> list[protocol.FileState]:
    """The regular files under ``root`` (paths relative to it), as a node's manifest lists its
    own; a link here is not followed, and not copied."""
    excluded = set(exclude) | set(ALWAYS_EXCLUDED)
    found: list[protocol.FileState] = []
    for relative, info in walk(root, excluded):
        if not S_ISREG(info.st_mode):
            continue
        if len(found) == MAX_FILES:
            raise LaunchError(
                f"{root}: more than {MAX_FILES} files to sync; exclude data directories with "
                "config sync_exclude"
            )
        found.append(
            protocol.FileState(relative, info.st_size, info.st_mtime, info.st_mode & 0o777)
        )
    return found


@dataclass
class Manifest:
    """A node's listing of its copy of the workdir, all pages together."""

    exists: bool = False
    files: list[protocol.FileState] = field(default_factory=list)
    blockers: list[protocol.Blocker] = field(default_factory=list)


@dataclass(frozen=True)
class Plan:
    """What to send a node, and what stands in the way of the rest (by the blocking path)."""

    send: list[protocol.FileState]
    blocked: list[protocol.Blocker]


def plan(local: Sequence[protocol.FileState], there: Manifest) -> Plan:
    """Pure: the local files the node lacks or holds in another size or modification time,
    except those at or below something that is not a directory there (a link, a FIFO, a file
    where this machine has a directory) or where the node has a directory: nothing is sent
    through or over those, which are ``blocked``, each once."""
    files = {state.path: state for state in there.files}
    blockers = {blocker.path: blocker for blocker in there.blockers}
    directories = set()
    for path in [*files, *blockers]:
        parts = path.split("/")
        for depth in range(1, len(parts)):
            directories.add("/".join(parts[:depth]))
    send = []
    blocked: dict[str, protocol.Blocker] = {}
    for state in local:
        found = _in_the_way(state.path, files, blockers, directories)
        if found is not None:
            blocked.setdefault(found.path, found)
        elif not _same(state, files.get(state.path)):
            send.append(state)
    return Plan(send, list(blocked.values()))


def _in_the_way(
    path: str,
    files: dict[str, protocol.FileState],
    blockers: dict[str, protocol.Blocker],
    directories: set[str],
) -> protocol.Blocker | None:
    """What on the node stands at ``path`` or above it, where a file or a directory is wanted."""
    parts = path.split("/")
    for depth in range(1, len(parts) + 1):
        above = "/".join(parts[:depth])
        if above in blockers:
            return blockers[above]
        if depth < len(parts) and above in files:
            return protocol.Blocker(above, "a file")
    if path in directories:
        return protocol.Blocker(path, "a directory")
    return None


def _same(state: protocol.FileState, other: protocol.FileState | None) -> bool:
    """Same size and modification time (within the filesystems' resolution)."""
    if other is None or other.size != state.size:
        return False
    return abs(other.mtime - state.mtime) <= MTIME_SLACK


def manifests(
    pool: NodePool, root: str, exclude: list[str], hosts: Sequence[Host]
) -> dict[Host, Manifest]:
    """Every node's listing of ``root``, page after page, all nodes at once; ``LaunchError``
    when a node cannot list it."""
    found = {host: Manifest() for host in hosts}
    problems = []
    page = 0
    waiting = list(hosts)
    deadline = time.monotonic() + LISTING_SECONDS

    def manifest_request(host: Host) -> protocol.ManifestRequest:
        return protocol.ManifestRequest(root, exclude, page)

    while waiting:
        if time.monotonic() > deadline:
            late = f"its listing of {root} did not end within {LISTING_SECONDS:.0f}s"
            problems += [f"{host.label}: {late}" for host in waiting]
            break
        replies = pool.call_all("manifest", manifest_request, protocol.ManifestReply, waiting)
        more = []
        for host in waiting:
            outcome = replies.get(host)
            if outcome is None or outcome.value is None:
                problems.append(f"{host.label}: {unanswered(outcome, host, pool.failures)}")
                continue
            listing = found[host]
            reply = outcome.value
            listing.exists = reply.exists
            listing.files += reply.files
            listing.blockers += reply.blockers
            refused = _refused_page(reply, listing)
            if refused is not None:
                problems.append(f"{host.label}: {refused}")
            elif reply.more:
                more.append(host)
        waiting = more
        page += 1
    if problems:
        raise LaunchError([*problems, "train: cannot sync the workdir; nothing was started"])
    return found


def _refused_page(reply: protocol.ManifestReply, listing: Manifest) -> str | None:
    """Why a node's page is not taken (None: it is): an agent lists at most ``MAX_FILES``
    entries, and a page it says more follows holds some, so a listing ends after at most that
    many pages, whatever a node sends."""
    if len(listing.files) + len(listing.blockers) > MAX_FILES:
        return f"its listing holds more than {MAX_FILES} entries, which no agent sends"
    if reply.more and not reply.files and not reply.blockers:
        return "it sent an empty page of its listing and said more would follow"
    return None


class Sender:
    """One node's copy: the files it lacks, each read one ``PUT_CHUNK`` at a time as its put
    request is made (never a whole file in memory), in order."""

    def __init__(self, root: str, files: Sequence[protocol.FileState]) -> None:
        self.root = root
        self.waiting = list(reversed(files))  # the next file last
        self.sent = 0  # files whose last chunk has been made
        self.file: BinaryIO | None = None
        self.path = ""
        self.offset = 0
        self.size = 0
        self.mode = 0
        self.mtime = 0.0

    def has_more(self) -> bool:
        """A file is open to send from (the next one opened if none is; one gone since the
        listing is skipped: nothing to copy)."""
        while self.file is None and self.waiting:
            state = self.waiting.pop()
            path = f"{self.root.rstrip('/')}/{state.path}"
            try:
                file = open(path, "rb")  # noqa: SIM115 (read across requests; ``close`` closes it)
            except FileNotFoundError:
                continue
            info = os.fstat(file.fileno())
            self.file = file
            self.path = path
            self.offset = 0
            self.size = info.st_size  # as it is now: a file changed since the listing goes as is
            self.mode = info.st_mode & 0o777
            self.mtime = info.st_mtime
        return self.file is not None

    def next_request(self) -> protocol.PutRequest | protocol.PutFilesRequest:
        """The open file's next chunk; or, where it is small, it whole with the small files
        after it (data and paths together within ``PUT_CHUNK``, so the line stays far below
        ``MAX_LINE``): one round trip for many small files."""
        if self.file is None or self.offset > 0 or self.size > protocol.PUT_CHUNK:
            return self.next_put()
        files: list[protocol.WholeFile] = []
        used = 0
        while self.file is not None and self.offset == 0:
            cost = self.size + len(json.dumps(self.path)) + FILE_FIELDS
            if files and used + cost > protocol.PUT_CHUNK:
                break
            put = self.next_put()
            files.append(protocol.WholeFile(put.path, put.data, put.mode, put.mtime))
            used += cost
            self.has_more()
        return protocol.PutFilesRequest(self.root, files)

    def next_put(self) -> protocol.PutRequest:
        """The open file's next chunk, read now (an empty file is one empty chunk)."""
        if self.file is None:
            raise ValueError("no file open: has_more() first")
        wanted = min(protocol.PUT_CHUNK, self.size - self.offset)
        data = self.file.read(wanted)
        last = len(data) < wanted or self.offset + len(data) >= self.size
        encoded = base64.b64encode(data).decode()
        put = protocol.PutRequest(
            self.path, encoded, self.offset, last, self.mode, self.mtime, self.root
        )
        self.offset += len(data)
        if last:
            self.close()
            self.sent += 1
        return put

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None


def send_all(pool: NodePool, senders: dict[Host, Sender]) -> list[str]:
    """Every node's files, one put request per node at a time, to every node at once. A node
    whose put fails gets no more; the others go on. Returns what failed, per node."""
    busy = dict(senders)
    problems: list[str] = []

    def next_request(host: Host) -> protocol.PutRequest | protocol.PutFilesRequest:
        return busy[host].next_request()

    try:
        while True:
            busy = {host: sender for host, sender in busy.items() if sender.has_more()}
            if not busy:
                return problems
            replies = pool.call_all("sync", next_request, protocol.PutReply, list(busy))
            for host in list(busy):
                outcome = replies.get(host)
                if outcome is None or outcome.error:
                    problems.append(f"{host.label}: {unanswered(outcome, host, pool.failures)}")
                    busy.pop(host).close()
    finally:
        for sender in senders.values():
            sender.close()


def sync_workdir(
    pool: NodePool, job: Job, hosts: Sequence[Host], lacking: Sequence[Host] | None = None
) -> dict[str, int]:
    """Copy the workdir to every node that does not see it (``lacking``, when the caller has just
    asked), then the job's hostfile copy (which the nodes run with) to every node. Returns the
    files sent to each node that does not see it (by its label). Something in the way on a node
    (a link where this machine has a directory or a file) is reported with its fix, after the
    rest has been copied everywhere: ``LaunchError``, since that node's copy is incomplete."""
    text = read_local(job.hostfile)
    if not text:
        raise LaunchError(f"{job.hostfile}: cannot read the hostfile to store it with the job")
    if lacking is None:
        lacking, _ = unshared(pool, job.workdir, hosts)
    exclude = [*DEFAULT_EXCLUDE, *job.sync_exclude]
    local = local_files(job.workdir, exclude)
    listings = manifests(pool, job.workdir, [*exclude, *ALWAYS_EXCLUDED], lacking)
    problems = []
    senders = {}
    for host, listing in listings.items():
        chosen = plan(local, listing)
        for blocker in chosen.blocked:
            where = f"{job.workdir.rstrip('/')}/{blocker.path}"
            name = blocker.path.rsplit("/", 1)[-1]
            problems.append(f"{host.label}: {refusal(where, blocker.what, name)}")
        senders[host] = Sender(job.workdir, chosen.send)
    problems += send_all(pool, senders)
    if problems:
        raise LaunchError(
            [*problems, "train: the workdir is not fully synced; nothing was started"]
        )
    for host in hosts:
        pool.write_file(host, str(job.home / "hostfile"), text)
    sent = {}
    for host, sender in senders.items():
        sent[host.label] = sender.sent
    return sent
