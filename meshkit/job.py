"""A training job as meshkit saves and relaunches it. Pure: data and paths, no I/O."""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import PurePosixPath

from .errors import JobError

_SESSION = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}$")


def check_session(name: str) -> str:
    """tmux session names end up in paths and commands: keep them plain."""
    if not _SESSION.match(name):
        raise JobError(f"session name {name!r}: use letters, digits, '.', '_' or '-' (at most 64)")
    return name


@dataclass(frozen=True)
class Job:
    cmd: str
    workdir: str
    session: str
    hostfile: str
    python: str
    master_port: int
    nproc_per_node: int | None = None
    include: str | None = None
    exclude: str | None = None
    setup: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)

    @property
    def home(self) -> PurePosixPath:
        """Where the job keeps its file and logs: on shared storage, so every node sees them."""
        return PurePosixPath(self.workdir) / ".meshkit" / self.session

    @property
    def log_pattern(self) -> str:
        return str(self.home / "node{rank}.log")

    def log(self, rank: int) -> str:
        return self.log_pattern.format(rank=rank)

    @property
    def state_dir(self) -> str:
        """Per node and wiped by a reboot (each node's own /tmp): start time and exit code."""
        return f"/tmp/meshkit-{self.session}"

    def to_json(self) -> str:
        data = asdict(self)
        data["setup"] = list(self.setup)
        return json.dumps(data, indent=2, sort_keys=True) + "\n"


def job_file(workdir: str, session: str) -> PurePosixPath:
    return PurePosixPath(workdir) / ".meshkit" / session / "job.json"


def from_json(text: str, where: str) -> Job:
    try:
        data = json.loads(text)
        data["setup"] = tuple(data.get("setup") or ())
        return Job(**data)
    except (ValueError, TypeError) as exc:
        raise JobError(
            f"{where}: not a meshkit job file ({exc}); relaunch with --cmd to replace it"
        ) from None
