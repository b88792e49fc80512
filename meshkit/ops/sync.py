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

from .. import protocol as p
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
    """One facts round (``p.FactsRequest``): each node's reply, and when each request left and its
    reply came back (this machine's clock, for the doctor's clock check)."""

    replies: dict[Host, Outcome[p.FactsReply]]
    timing: dict[Host, tuple[float, float]]
    marker: str

    def shared(self, host: Host) -> bool:
        """The one test of "does ``host`` see the workdir": it saw the marker."""
        outcome = self.replies.get(host)
        return outcome is not None and outcome.value is not None and outcome.value.marker == "seen"


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
    replies: dict[Host, Outcome[p.FactsReply]] = {}
    sent: dict[Host, float] = {}
    others = [h for h in hosts if h != writer]

    def request(host: Host) -> p.FactsRequest:
        sent[host] = time.time()
        return p.FactsRequest(workdir, marker, token, host == writer)

    try:
        for chosen in ([writer], others) if writer is not None else (others,):
            replies.update(pool.call_all("facts", request, p.FactsReply, chosen))
            back = time.time()
            timing.update({h: (sent[h], back) for h in chosen if h in sent})
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
    problems = [f"{h.label}: cannot connect: {e}" for h, e in pool.failures.items()]
    problems += [f"{h.label}: {o.error}" for h, o in facts.replies.items() if o.error]
    if problems:
        raise LaunchError([*problems, "train: preflight failed; nothing was started"])
    return [h for h in hosts if not facts.shared(h)], facts


def local_files(root: str, exclude: Sequence[str]) -> list[p.FileState]:
    """The files under ``root`` (paths relative to it), as a node's manifest lists its own."""
    found = list(islice(walk(Path(root), set(exclude) | set(ALWAYS_EXCLUDED)), MAX_FILES + 1))
    if len(found) > MAX_FILES:
        raise LaunchError(
            f"{root}: more than {MAX_FILES} files to sync; exclude data directories with "
            "config sync_exclude"
        )
    return found


def plan(local: Sequence[p.FileState], remote: Sequence[p.FileState]) -> list[p.FileState]:
    """Pure: the local files a node lacks or holds in another size or modification time."""
    there = {f.path: f for f in remote}

    def same(f: p.FileState, r: p.FileState | None) -> bool:
        return r is not None and r.size == f.size and abs(r.mtime - f.mtime) <= MTIME_SLACK

    return [f for f in local if not same(f, there.get(f.path))]


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
    listing = p.ManifestRequest(job.workdir, [*exclude, *ALWAYS_EXCLUDED])
    manifests = pool.call_all("manifest", lambda h: listing, p.ManifestReply, lacking)
    problems = [f"{h.label}: {o.error}" for h, o in manifests.items() if o.error]
    problems += [f"{h.label}: unreachable" for h in lacking if h not in manifests]
    if problems:
        raise LaunchError([*problems, "train: cannot sync the workdir; nothing was started"])
    queues: dict[Host, list[p.PutRequest]] = {}
    for h, outcome in manifests.items():
        assert outcome.value is not None
        queues[h] = [req for f in plan(local, outcome.value.files) for req in _puts(job.workdir, f)]
    sent = {h.label: sum(1 for r in q if r.last) for h, q in queues.items()}
    while any(queues.values()):
        busy = [h for h, q in queues.items() if q]
        done = pool.call_all("sync", lambda h: queues[h][0], p.PutReply, busy)
        failed = [f"{h.label}: {put.error}" for h, put in done.items() if put.error]
        if failed:
            raise LaunchError([*failed, "train: sync failed; nothing was started"])
        for h in done:
            queues[h].pop(0)
    for h in hosts:
        pool.write_file(h, str(job.home / "hostfile"), text)
    return sent


def _puts(root: str, f: p.FileState) -> list[p.PutRequest]:
    """A file as put requests, read now (a file changed since the listing is sent as it is)."""
    target = str(Path(root) / f.path)
    data = Path(target).read_bytes()
    chunks = [base64.b64encode(data[i : i + CHUNK]).decode() for i in range(0, len(data), CHUNK)]
    last = max(0, len(chunks) - 1)
    return [
        p.PutRequest(target, chunk, i * CHUNK, i == last, f.mode, f.mtime)
        for i, chunk in enumerate(chunks or [""])
    ]
