"""A node's side of ``train --sync``: what a workdir holds here (size and mtime of each file, and
what else is there that sync must not write through), listed in pages; and writing the files the
launcher sends, chunk by chunk, each moved into place only when complete. Nothing is ever written
outside the workdir's real path: below it, no link is followed. Standard library only."""

from __future__ import annotations

import base64
import contextlib
import json
import os
import stat
from collections.abc import Iterator
from itertools import islice

from ..protocol import (
    MAX_LINE,
    Blocker,
    FileState,
    ManifestReply,
    ManifestRequest,
    PutFilesRequest,
    PutReply,
    PutRequest,
)
from .files import NEW_FILE, temporary_name

MAX_FILES = 100000  # a workdir larger than this is not a job's code: the launcher says so
# What one manifest page's entries may take once encoded. An entry past it ends the page, so a
# page is at most this plus one entry (a path of at most PATH_MAX characters): under MAX_LINE.
PAGE_BYTES = MAX_LINE // 2
ENTRY_FIELDS = 100  # bytes of an encoded entry besides its path: names, size, mtime, mode
BELOW = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW  # a directory, never through a link

# A manifest being paged: root -> the rest of its listing.
_listings: dict[str, Iterator[FileState | Blocker]] = {}


def walk(root: str, skip: set[str]) -> Iterator[tuple[str, os.stat_result]]:
    """Every entry under ``root`` that is not a directory, by its path relative to ``root``, with
    its ``lstat`` (excluded names left out; a link to a directory is an entry, never entered), in
    a stable order: what both ends of a sync compare."""
    for top, directories, names in os.walk(root):
        directories[:] = sorted(name for name in directories if name not in skip)
        base = os.path.relpath(top, root)
        entries = list(names)
        for name in directories:
            if os.path.islink(os.path.join(top, name)):
                entries.append(name)
        for name in sorted(entries):
            if name in skip:
                continue
            try:
                info = os.lstat(os.path.join(top, name))
            except OSError:
                continue
            if base == ".":
                yield name, info
            else:
                yield f"{base}/{name}", info


def describe(path: str, info: os.stat_result) -> str:
    """What stands at ``path`` instead of a regular file or a directory, for a message."""
    if stat.S_ISLNK(info.st_mode):
        try:
            target = os.readlink(path)
        except OSError:
            return "a symlink"
        return f"a symlink to {target[:200]}"
    if stat.S_ISDIR(info.st_mode):
        return "a directory"
    if stat.S_ISREG(info.st_mode):
        return "a file"
    if stat.S_ISFIFO(info.st_mode):
        return "a FIFO"
    if stat.S_ISSOCK(info.st_mode):
        return "a socket"
    return "a device file"


def refusal(path: str, what: str, name: str) -> str:
    """Why sync writes nothing at ``path`` (which is ``what`` on the node), and the fix: one
    wording for the node's refusal and the launcher's report."""
    return (
        f"{path} is {what} on the node; train --sync never writes through a link or over "
        f"anything but a file: make it a directory (or remove it), or exclude it (config "
        f"sync_exclude: [{name}])"
    )


def manifest(request: ManifestRequest) -> ManifestReply:
    """A page of the workdir's listing: ``page`` 0 starts it; each next page goes on from where
    the last one ended (``more``). Regular files are ``files``; anything else but a directory
    (a symlink, a FIFO) is a ``Blocker``."""
    if request.page == 0:
        if not os.path.isdir(request.root):
            _listings.pop(request.root, None)
            return ManifestReply(False, [])
        entries = islice(walk(request.root, set(request.exclude)), MAX_FILES)
        _listings[request.root] = _states(request.root, entries)
    listing = _listings.get(request.root)
    if listing is None:
        where = request.root[:200]
        raise ValueError(f"manifest: page {request.page} of {where!r} before its first page")
    files: list[FileState] = []
    blockers: list[Blocker] = []
    used = 0
    for entry in listing:
        if isinstance(entry, Blocker):
            blockers.append(entry)
            used += len(json.dumps(entry.what))
        else:
            files.append(entry)
        used += len(json.dumps(entry.path)) + ENTRY_FIELDS
        if used > PAGE_BYTES:
            return ManifestReply(True, files, blockers, more=True)
    del _listings[request.root]
    return ManifestReply(True, files, blockers)


def _states(
    root: str, entries: Iterator[tuple[str, os.stat_result]]
) -> Iterator[FileState | Blocker]:
    for relative, info in entries:
        if stat.S_ISREG(info.st_mode):
            yield FileState(relative, info.st_size, info.st_mtime, info.st_mode & 0o777)
        else:
            yield Blocker(relative, describe(os.path.join(root, relative), info))


class _Partial:
    """A file being put: its directory (open, reached without following a link), its name
    there, and its temporary beside it (open for writing)."""

    def __init__(self, directory: int, name: str, temporary: str, file: int) -> None:
        self.directory = directory
        self.name = name
        self.temporary = temporary
        self.file = file

    def discard(self) -> None:
        """Close it and remove the temporary (what a failed or repeated try leaves)."""
        if self.file >= 0:
            with contextlib.suppress(OSError):
                os.close(self.file)
        with contextlib.suppress(OSError):
            os.unlink(self.temporary, dir_fd=self.directory)
        with contextlib.suppress(OSError):
            os.close(self.directory)


# A file being put (its full path) -> its partial, from its first chunk on.
_partials: dict[str, _Partial] = {}


def put(request: PutRequest) -> PutReply:
    """Write one chunk. ``root`` (the workdir; its parent directory when empty) is made if
    missing and taken where its path leads; below it, each directory is entered or made
    without following a link, and a link or anything else but a directory on the way (or
    anything but a file at the name itself) is refused: nothing is written through it."""
    root = _root(request)
    data = base64.b64decode(request.data.encode(), validate=True)
    if request.offset == 0:
        earlier = _partials.pop(request.path, None)
        if earlier is not None:  # what an earlier try of this file left
            earlier.discard()
        _partials[request.path] = _begin(root, request.path[len(root) + 1 :])
    partial = _partials.get(request.path)
    if partial is None:
        where = request.path[:200]
        raise ValueError(f"put: {where!r}: a chunk at {request.offset} before its first chunk")
    try:
        _write(partial.file, data, request.offset)
        if request.last:
            os.ftruncate(partial.file, request.offset + len(data))  # ends with a hole, maybe
            _finish(partial, request.mode, request.mtime)
    except BaseException:
        _partials.pop(request.path, None)
        partial.discard()
        raise
    if request.last:
        del _partials[request.path]
    return PutReply(len(data))


def put_files(request: PutFilesRequest) -> PutReply:
    """Each small file whole, in order, as ``put`` writes a file of one chunk."""
    written = 0
    for small in request.files:
        whole = PutRequest(small.path, small.data, 0, True, small.mode, small.mtime, request.root)
        written += put(whole).written
    return PutReply(written)


def _write(file: int, data: bytes, offset: int) -> None:
    """``data`` at ``offset``; a chunk of only zeros is left a hole (the temporary is new, so a
    hole reads as zeros): a sparse file stays sparse on the node."""
    if data == bytes(len(data)):  # a compare stops at the first non-zero byte; a count does not
        return
    view = memoryview(data)
    written = 0
    while written < len(data):
        written += os.pwrite(file, view[written:], offset + written)


def _root(request: PutRequest) -> str:
    """The request's root, checked: ``path`` is absolute, without '..', below it."""
    path = request.path
    parts = path.split("/")
    if not os.path.isabs(path) or ".." in parts:
        raise ValueError(f"put: {path[:200]!r} is not an absolute path without '..'")
    root = request.root.rstrip("/") or os.path.dirname(path)
    below = path[len(root) + 1 :]
    if not path.startswith(f"{root}/") or not below or "" in below.split("/"):
        raise ValueError(f"put: {path[:200]!r} is not a file path below {root[:200]!r}")
    return root


def _begin(root: str, relative: str) -> _Partial:
    """The file's directory, reached from ``root`` without following a link, and a new
    temporary there (``O_EXCL|O_NOFOLLOW``, a name nobody can guess: nothing planted is
    followed)."""
    os.makedirs(root, exist_ok=True)  # the workdir itself: wherever its path leads
    directory = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    parts = relative.split("/")
    where = root
    try:
        for part in parts[:-1]:
            where = f"{where}/{part}"
            with contextlib.suppress(FileExistsError):
                os.mkdir(part, dir_fd=directory)
            try:
                below = os.open(part, BELOW, dir_fd=directory)
            except OSError:  # a link (ELOOP) or not a directory (ENOTDIR)
                info = os.lstat(part, dir_fd=directory)
                raise ValueError(refusal(where, describe(where, info), part)) from None
            os.close(directory)
            directory = below
        name = parts[-1]
        with contextlib.suppress(FileNotFoundError):
            info = os.lstat(name, dir_fd=directory)
            if not stat.S_ISREG(info.st_mode):
                where = f"{where}/{name}"
                raise ValueError(refusal(where, describe(where, info), name))
        temporary = os.path.basename(temporary_name(name))
        file = os.open(temporary, NEW_FILE, 0o600, dir_fd=directory)
    except BaseException:
        os.close(directory)
        raise
    return _Partial(directory, name, temporary, file)


def _finish(partial: _Partial, mode: int, mtime: float) -> None:
    """Mode and mtime on the complete temporary, then renamed over the name in the same
    directory (a rename replaces a directory entry: it never writes through one)."""
    os.fchmod(partial.file, mode & 0o7777)
    os.utime(partial.file, (mtime, mtime))
    os.close(partial.file)
    partial.file = -1  # closed: a later discard must not close a number reused since
    os.replace(
        partial.temporary,
        partial.name,
        src_dir_fd=partial.directory,
        dst_dir_fd=partial.directory,
    )
    os.close(partial.directory)
