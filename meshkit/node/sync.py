"""A node's side of ``train --sync``: what files a workdir holds here (size, mtime) and writing
the ones the launcher sends, chunk by chunk, each moved into place only when complete. Standard
library only."""

from __future__ import annotations

import base64
import os
from collections.abc import Iterator
from itertools import islice
from pathlib import Path
from stat import S_ISREG

from ..protocol import FileState, ManifestReply, ManifestRequest, PutReply, PutRequest

MAX_FILES = 100000  # a workdir larger than this is not a job's code: the launcher says so


def walk(root: Path, skip: set[str]) -> Iterator[FileState]:
    """The regular files under ``root`` (symlinks and excluded names left out), in a stable order:
    what both ends of a sync compare."""
    for top, dirs, names in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in skip)
        for name in sorted(names):
            if name in skip:
                continue
            path = Path(top) / name
            try:
                st = path.lstat()
            except OSError:
                continue
            if S_ISREG(st.st_mode):  # not a symlink, whatever it points to
                rel = str(path.relative_to(root))
                yield FileState(rel, st.st_size, st.st_mtime, st.st_mode & 0o777)


def manifest(request: ManifestRequest) -> ManifestReply:
    root = Path(request.root)
    if not root.is_dir():
        return ManifestReply(False, [])
    files = list(islice(walk(root, set(request.exclude)), MAX_FILES))
    return ManifestReply(True, files, truncated=len(files) >= MAX_FILES)


def put(request: PutRequest) -> PutReply:
    path = Path(request.path)
    if not path.is_absolute() or ".." in path.parts:
        raise ValueError(f"put: {request.path[:200]!r} is not an absolute path without '..'")
    path.parent.mkdir(parents=True, exist_ok=True)
    # One agent sends every chunk of a file; two controllers writing one file do not share it.
    tmp = path.with_name(f".{path.name}.meshkit-{os.getpid()}")
    data = base64.b64decode(request.data.encode(), validate=True)
    flags = os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if request.offset == 0 else 0)
    with os.fdopen(os.open(tmp, flags, 0o600), "wb") as out:
        out.seek(request.offset)
        out.write(data)
    if request.last:
        os.chmod(tmp, request.mode & 0o7777)
        os.utime(tmp, (request.mtime, request.mtime))
        os.replace(tmp, path)
    return PutReply(len(data))
