"""Clusters without shared storage: find out whether every node sees the launcher's workdir (a
marker file written here, looked for on every node through its agent), and copy the workdir to
the same path on the nodes that do not, through the agents already open (only files whose size or
modification time differ; never deleting anything there). ``plan`` is pure."""

from __future__ import annotations

import base64
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ..errors import LaunchError
from ..hostfile import Host
from ..job import Job
from ..protocol import (
    FileState,
    LogsReply,
    LogsRequest,
    ManifestReply,
    ManifestRequest,
    PutReply,
    PutRequest,
)
from .jobs import NodePool, hostfile_text

ALWAYS_EXCLUDED = (".meshkit",)  # each node's logs and job state live there: never overwritten
DEFAULT_EXCLUDE = (".git", "__pycache__")
CHUNK = 512 * 1024  # raw bytes per put request (base64 keeps the line under protocol.MAX_LINE)
MAX_FILES = 100000
MTIME_SLACK = 0.002  # seconds: filesystems keep mtimes at different resolutions


def unshared(pool: NodePool, workdir: str, hosts: Sequence[Host]) -> list[Host]:
    """The nodes that do not see this machine's ``workdir`` (a marker written here is absent or
    different there); ``LaunchError`` when a node cannot be asked."""
    marker = Path(workdir) / ".meshkit" / f".shared-{secrets.token_hex(8)}"
    token = secrets.token_hex(16)
    try:
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text(token + "\n")
    except OSError as exc:
        raise LaunchError(f"{workdir}: cannot write the shared-storage marker: {exc}") from None
    try:
        seen = pool.call_all("shared?", lambda h: LogsRequest(str(marker), 1), LogsReply, hosts)
    finally:
        marker.unlink(missing_ok=True)
    # The first request to each node's agent: one that cannot answer (a missing interpreter,
    # say) stops the launch here, with the agent's own reason, as preflight would.
    problems = [f"{h.label}: cannot connect: {e}" for h, e in pool.failures.items()]
    problems += [f"{h.label}: {o.error}" for h, o in seen.items() if o.error]
    if problems:
        raise LaunchError([*problems, "train: preflight failed; nothing was started"])
    return [
        h
        for h in hosts
        if (o := seen.get(h)) is not None and o.value is not None and o.value.lines != [token]
    ]


@dataclass(frozen=True)
class LocalFile:
    path: str  # relative to the workdir
    size: int
    mtime: float
    mode: int


def local_files(root: str, exclude: Sequence[str]) -> list[LocalFile]:
    from ..node.sync import walk

    found: list[LocalFile] = []
    for state in walk(Path(root), set(exclude) | set(ALWAYS_EXCLUDED)):
        found.append(LocalFile(state.path, state.size, state.mtime, state.mode))
        if len(found) > MAX_FILES:
            raise LaunchError(
                f"{root}: more than {MAX_FILES} files to sync; exclude data directories with "
                "config sync_exclude"
            )
    return found


def plan(local: Sequence[LocalFile], remote: Sequence[FileState]) -> list[LocalFile]:
    """Pure: the local files a node lacks or holds in another size or modification time."""
    there = {f.path: f for f in remote}
    changed = []
    for f in local:
        r = there.get(f.path)
        if r is None or r.size != f.size or abs(r.mtime - f.mtime) > MTIME_SLACK:
            changed.append(f)
    return changed


@dataclass(frozen=True)
class SyncReport:
    nodes: dict[str, int]  # host label -> files sent (only nodes that do not share the workdir)
    shared: list[str]  # nodes that already see the workdir


def sync_workdir(pool: NodePool, job: Job, hosts: Sequence[Host]) -> SyncReport:
    """Copy the workdir to every node that does not see it, then the job's hostfile copy (which
    the nodes run with) to every node."""
    text = hostfile_text(job)
    if not text:
        raise LaunchError(f"{job.hostfile}: cannot read the hostfile to store it with the job")
    lacking = unshared(pool, job.workdir, hosts)
    exclude = [*DEFAULT_EXCLUDE, *job.sync_exclude]
    local = local_files(job.workdir, exclude)
    manifests = pool.call_all(
        "manifest",
        lambda h: ManifestRequest(job.workdir, [*exclude, *ALWAYS_EXCLUDED]),
        ManifestReply,
        lacking,
    )
    problems = [f"{h.label}: {o.error}" for h, o in manifests.items() if o.error]
    problems += [f"{h.label}: unreachable" for h in lacking if h not in manifests]
    if problems:
        raise LaunchError([*problems, "train: cannot sync the workdir; nothing was started"])
    queues: dict[Host, list[PutRequest]] = {}
    for h, outcome in manifests.items():
        assert outcome.value is not None
        queues[h] = [req for f in plan(local, outcome.value.files) for req in _puts(job.workdir, f)]
    sent = {h.label: sum(1 for r in q if r.last) for h, q in queues.items()}
    while any(queues.values()):
        done = pool.call_all(
            "sync",
            lambda h: queues[h][0] if queues.get(h) else None,
            PutReply,
            [h for h, q in queues.items() if q],
        )
        for h, put in done.items():
            if put.error:
                raise LaunchError(
                    [f"{h.label}: {put.error}", "train: sync failed; nothing was started"]
                )
            queues[h].pop(0)
    for h in hosts:
        pool.write_file(h, str(job.home / "hostfile"), text)
    return SyncReport(sent, [h.label for h in hosts if h not in lacking])


def _puts(root: str, f: LocalFile) -> list[PutRequest]:
    """A file as put requests, read now (a file changed since the listing is sent as it is)."""
    data = (Path(root) / f.path).read_bytes()
    target = str(Path(root) / f.path)
    chunks = [data[i : i + CHUNK] for i in range(0, len(data), CHUNK)] or [b""]
    return [
        PutRequest(
            target,
            base64.b64encode(chunk).decode(),
            i * CHUNK,
            i == len(chunks) - 1,
            f.mode,
            f.mtime,
        )
        for i, chunk in enumerate(chunks)
    ]
