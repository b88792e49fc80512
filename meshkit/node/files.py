"""Small state-file helpers shared by the agent's job ops and the keeper (standard library only,
and nothing else imported: the keeper starts on every node at every launch)."""

from __future__ import annotations

import os
from pathlib import Path


def read_text(path: Path, limit: int = 65536) -> str | None:
    """At most ``limit`` bytes of ``path`` (None when it cannot be read)."""
    try:
        with path.open("rb") as handle:
            return handle.read(limit).decode(errors="replace")
    except OSError:
        return None


def write_atomic(path: Path, text: str, mode: int = 0o600) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "w") as out:
        out.write(text)
    os.replace(tmp, path)
