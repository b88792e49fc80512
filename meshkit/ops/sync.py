"""Clusters without shared storage: find out whether every node sees the launcher's workdir (a
marker file written here, looked for on every node through its agent), and copy the workdir to
the same path on the nodes that do not, through the agents already open (only files whose size or
modification time differ; never deleting anything there). ``plan`` is pure."""

from __future__ import annotations

import base64
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import islice
from pathlib import Path

from .. import protocol
from ..errors import LaunchError
from ..hostfile import Host
from ..job import Job
from ..node.sync import MAX_FILES, walk
from ..outcome import Outcome
from .lookup import read_local
from .pool import NodePool

ALWAYS_EXCLUDED = (".meshkit",)  # each node's logs and job state live there: never overwritten
DEFAULT_EXCLUDE = (".git", "__pycache__")
CHUNK = 512 * 1024  # raw bytes per put request (base64 keeps the line under protocol.MAX_LINE)
MTIME_SLACK = 0.002  # seconds: filesystems keep mtimes at different resolutions


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


def facts_round(pool: NodePool, workdir: str, hosts: Sequence[Host], writer: Host | None) -> Facts:
    """Versions, GPUs, clocks and the workdir of every node, with a marker in the workdir: written
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
        return protocol.FactsRequest(workdir, marker, token, host == writer)

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


def unshared(pool: NodePool, workdir: str, hosts: Sequence[Host]) -> tuple[list[Host], Facts]:
    """The nodes that do not see this machine's ``workdir``, and the facts round that told;
    ``LaunchError`` when a node cannot be asked."""
    facts = facts_round(pool, workdir, hosts, None)
    # The first request to each node's agent: one that cannot answer (a missing interpreter,
    # say) stops the launch here, with the agent's own reason, as preflight would.
    problems = [f"{host.label}: cannot connect: {error}" for host, error in pool.failures.items()]
    for host, outcome in facts.replies.items():
        if outcome.error:
            problems.append(f"{host.label}: {outcome.error}")
    if problems:
        raise LaunchError([*problems, "train: preflight failed; nothing was started"])
    lacking = [host for host in hosts if not facts.shared(host)]
    return lacking, facts


def local_files(root: str, exclude: Sequence[str]) -> list[protocol.FileState]:
    """The files under ``root`` (paths relative to it), as a node's manifest lists its own."""
    excluded = set(exclude) | set(ALWAYS_EXCLUDED)
    # One more than the limit is enough to tell that there are too many.
    found = list(islice(walk(Path(root), excluded), MAX_FILES + 1))
    if len(found) > MAX_FILES:
        raise LaunchError(
            f"{root}: more than {MAX_FILES} files to sync; exclude data directories with "
            "config sync_exclude"
        )
    return found


def plan(
    local: Sequence[protocol.FileState], remote: Sequence[protocol.FileState]
) -> list[protocol.FileState]:
    """Pure: the local files a node lacks or holds in another size or modification time."""
    there = {state.path: state for state in remote}
    return [state for state in local if not _same(state, there.get(state.path))]


def _same(state: protocol.FileState, other: protocol.FileState | None) -> bool:
    """Same size and modification time (within the filesystems' resolution)."""
    if other is None or other.size != state.size:
        return False
    return abs(other.mtime - state.mtime) <= MTIME_SLACK


def sync_workdir(
    pool: NodePool, job: Job, hosts: Sequence[Host], lacking: Sequence[Host] | None = None
) -> dict[str, int]:
    """Copy the workdir to every node that does not see it (``lacking``, when the caller has just
    asked), then the job's hostfile copy (which the nodes run with) to every node. Returns the
    files sent to each node that does not see it (by its label)."""
    text = read_local(job.hostfile)
    if not text:
        raise LaunchError(f"{job.hostfile}: cannot read the hostfile to store it with the job")
    if lacking is None:
        lacking, _ = unshared(pool, job.workdir, hosts)
    exclude = [*DEFAULT_EXCLUDE, *job.sync_exclude]
    local = local_files(job.workdir, exclude)
    listing = protocol.ManifestRequest(job.workdir, [*exclude, *ALWAYS_EXCLUDED])

    def manifest_request(host: Host) -> protocol.ManifestRequest:
        return listing

    manifests = pool.call_all("manifest", manifest_request, protocol.ManifestReply, lacking)
    problems = []
    for host, outcome in manifests.items():
        if outcome.error:
            problems.append(f"{host.label}: {outcome.error}")
    for host in lacking:
        if host not in manifests:
            problems.append(f"{host.label}: unreachable")
    if problems:
        raise LaunchError([*problems, "train: cannot sync the workdir; nothing was started"])
    # Each node's put requests, sent one at a time per node, to every node at once.
    queues: dict[Host, list[protocol.PutRequest]] = {}
    for host, outcome in manifests.items():
        assert outcome.value is not None
        queues[host] = []
        for state in plan(local, outcome.value.files):
            queues[host] += _puts(job.workdir, state)
    sent = {}
    for host, queue in queues.items():
        sent[host.label] = sum(1 for put in queue if put.last)  # one last chunk per file

    def next_put(host: Host) -> protocol.PutRequest:
        return queues[host][0]

    while any(queues.values()):
        busy = [host for host, queue in queues.items() if queue]
        done = pool.call_all("sync", next_put, protocol.PutReply, busy)
        failed = []
        for host, reply in done.items():
            if reply.error:
                failed.append(f"{host.label}: {reply.error}")
        if failed:
            raise LaunchError([*failed, "train: sync failed; nothing was started"])
        for host in done:
            queues[host].pop(0)
    for host in hosts:
        pool.write_file(host, str(job.home / "hostfile"), text)
    return sent


def _puts(root: str, state: protocol.FileState) -> list[protocol.PutRequest]:
    """A file as put requests, read now (a file changed since the listing is sent as it is). An
    empty file is one empty chunk."""
    target = str(Path(root) / state.path)
    data = Path(target).read_bytes()
    chunks = []
    for offset in range(0, len(data), CHUNK):
        chunks.append(base64.b64encode(data[offset : offset + CHUNK]).decode())
    if not chunks:
        chunks = [""]
    last = len(chunks) - 1
    puts = []
    for i, chunk in enumerate(chunks):
        offset = i * CHUNK
        puts.append(protocol.PutRequest(target, chunk, offset, i == last, state.mode, state.mtime))
    return puts
