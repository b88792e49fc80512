"""Small state-file helpers shared by the agent's job ops and the keeper (standard library only,
and nothing else imported: the keeper starts on every node at every launch). Paths are strings
(``os.path``, not ``pathlib``, on the hot node paths: its import costs every interpreter ms)."""

from __future__ import annotations

import os

# In a job's state directory: its one record (protocol.NodeJob, which the keeper runs), and the
# socket on which the keeper answers the agent's questions for a rank's stack
SPEC, STACKS = "spec.json", "stacks.sock"


def state_root() -> str:
    """This user's meshkit state on this node: jobs, supervisors, the ranks' flight-recorder
    FIFOs. In /tmp on purpose: a reboot empties it, so a rebooted node reads the truth."""
    return f"/tmp/meshkit-{os.getuid()}"


def read_text(path: str | os.PathLike[str], limit: int = 65536) -> str | None:
    """At most ``limit`` bytes of ``path`` (None when it cannot be read)."""
    try:
        with open(path, "rb") as handle:
            return handle.read(limit).decode(errors="replace")
    except OSError:
        return None


def write_atomic(path: str | os.PathLike[str], data: str | bytes, mode: int = 0o600) -> None:
    path = os.fspath(path)
    head, name = os.path.split(path)
    tmp = os.path.join(head, f".{name}.{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "wb") as out:
        out.write(data.encode() if isinstance(data, str) else data)
    os.replace(tmp, path)
