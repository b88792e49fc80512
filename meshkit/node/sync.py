"""A node's side of ``train --sync``: what files a workdir holds here (size, mtime) and writing
the ones the launcher sends, chunk by chunk, each moved into place only when complete. Standard
library only."""

from __future__ import annotations

import base64
import contextlib
import os
from collections.abc import Iterator
from itertools import islice
from pathlib import Path
from stat import S_ISREG

from ..protocol import FileState, ManifestReply, ManifestRequest, PutReply, PutRequest
from .files import NEW_FILE, temporary_name

MAX_FILES = 100000  # a workdir larger than this is not a job's code: the launcher says so

# A file being put -> its temporary, from its first chunk on.
_temporaries: dict[str, str] = {}


def walk(root: Path, skip: set[str]) -> Iterator[FileState]:
    """The regular files under ``root`` (symlinks and excluded names left out), in a stable order:
    what both ends of a sync compare."""
    for top, directories, names in os.walk(root):
        directories[:] = sorted(name for name in directories if name not in skip)
        for name in sorted(names):
            if name in skip:
                continue
            path = Path(top) / name
            try:
                info = path.lstat()
            except OSError:
                continue
            if S_ISREG(info.st_mode):  # not a symlink, whatever it points to
                relative = str(path.relative_to(root))
                yield FileState(relative, info.st_size, info.st_mtime, info.st_mode & 0o777)


def manifest(request: ManifestRequest) -> ManifestReply:
    root = Path(request.root)
    if not root.is_dir():
        return ManifestReply(False, [])
    found = list(islice(walk(root, set(request.exclude)), MAX_FILES))
    return ManifestReply(True, found, truncated=len(found) >= MAX_FILES)


def put(request: PutRequest) -> PutReply:
    path = Path(request.path)
    if not path.is_absolute() or ".." in path.parts:
        raise ValueError(f"put: {request.path[:200]!r} is not an absolute path without '..'")
    path.parent.mkdir(parents=True, exist_ok=True)
    data = base64.b64decode(request.data.encode(), validate=True)
    # One agent sends every chunk of a file; two controllers writing one file do not share it.
    # The first chunk makes a new temporary of a name nobody can guess (O_EXCL|O_NOFOLLOW:
    # nothing planted is followed); the next chunks find it by that name, never by following a
    # link.
    if request.offset == 0:
        earlier = _temporaries.pop(str(path), None)
        if earlier:  # what an earlier try of this file left
            with contextlib.suppress(OSError):
                os.unlink(earlier)
        temporary = temporary_name(str(path))
        _temporaries[str(path)] = temporary
        descriptor = os.open(temporary, NEW_FILE, 0o600)
    else:
        temporary = _temporaries.get(str(path), "")
        if not temporary:
            where = request.path[:200]
            raise ValueError(f"put: {where!r}: a chunk at {request.offset} before its first chunk")
        descriptor = os.open(temporary, os.O_WRONLY | os.O_NOFOLLOW)
    with os.fdopen(descriptor, "wb") as out:
        out.seek(request.offset)
        out.write(data)
    if request.last:
        os.chmod(temporary, request.mode & 0o7777)
        os.utime(temporary, (request.mtime, request.mtime))
        os.replace(temporary, path)
        del _temporaries[str(path)]
    return PutReply(len(data))
