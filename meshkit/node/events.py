"""A job's history on this node (``meshkit.events``): the ``events`` op.

The history lives in the job's home (``WORKDIR/.meshkit/SESSION``), in ``events/``, one file
per node (``<hostname>.jsonl``, one JSON event a line): on shared storage every node writes its
own file, so no two nodes append to one file, and a read returns every file's events, merged by
id. Past ``ROTATE_BYTES`` a file becomes ``<name>.1`` (the one older file kept), so the history
is bounded. Node data is untrusted, the home may be shared: below the home no link is followed
(``O_NOFOLLOW`` on the directory and on each file), a damaged line is skipped, every read is
bounded in bytes and lines, and the reply fits ``protocol.MAX_LINE``. Standard library only.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import socket
import stat

from ..events import Event, merge
from ..protocol import MAX_LINE, EventsReply, EventsRequest
from ..record import asdict, build, replace

EVENTS_DIR = "events"  # in the job's home
SUFFIX = ".jsonl"
OLDER = ".1"  # the rotated file: <hostname>.jsonl.1
ROTATE_BYTES = 1 << 20  # a node's file past this becomes its .1
MAX_EVENT_BYTES = 64 << 10  # one event's line at most (a longer one is trimmed, then dropped)
TRIMMED_TEXT = 4096  # characters of an event's text kept when its line is too long
READ_BYTES = 2 * ROTATE_BYTES  # read of one file at most (its end: the newest events)
READ_LINES = 20000  # lines of one file at most
TOTAL_BYTES = 32 << 20  # read of all the files at most, for one request
MAX_FILES = 512  # files read at most (two a node: a cluster of 256 nodes on one share)
REPLY_BYTES = MAX_LINE // 2  # the reply's events at most, encoded: well under a line
BELOW = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW  # a directory, never through a link
APPEND = os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK
READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK  # a FIFO planted at a name never blocks
UNSAFE_NAME = re.compile(r"[^A-Za-z0-9._-]")


class UnsafeEvents(ValueError):
    """The events directory is not one this user alone can write (a link, another owner, a
    group- or world-writable mode): nothing is written to it or read from it."""


def events(request: EventsRequest) -> EventsReply:
    """The ``events`` op: add ``request.add`` to this node's file, then return the events at or
    after ``request.since`` (None: none) of every node's file, oldest first, at most
    ``request.limit`` and what fits in a reply (``more``: there were more)."""
    home = check_home(request.home)
    if request.add:
        append(home, request.add)
    if request.since is None:
        return EventsReply([])
    found = read(home, request.since)
    return page(found, request.limit)


def check_home(home: str) -> str:
    """The job's home as the request names it: an absolute path without '..'."""
    if not os.path.isabs(home) or ".." in home.split("/"):
        raise ValueError(f"events: {home[:200]!r} is not an absolute path without '..'")
    return home.rstrip("/") or "/"


def this_node() -> str:
    """This node's file name in ``events/``: its hostname, made a safe file name."""
    name = UNSAFE_NAME.sub("_", socket.gethostname())[:64].lstrip(".")
    return f"{name or 'node'}{SUFFIX}"


# ---- writing


def append(home: str, added: list[Event]) -> None:
    """Append ``added`` to this node's file, one line each, rotating it first when it is past
    ``ROTATE_BYTES``. The home itself is made if missing (wherever its path leads, as sync
    makes the workdir); ``events/`` below it is made 0700 and entered without following a
    link. One writer at a time (an exclusive lock on the file): the supervisor and a ``train``
    on one node never rotate the file at once."""
    lines = [line for line in (encoded(event) for event in added) if line]
    if not lines:
        return
    os.makedirs(home, exist_ok=True)
    directory = open_events_dir(home, make=True)
    try:
        name = this_node()
        file = open_locked(directory, name)
        try:
            data = "".join(lines).encode()
            size = os.fstat(file).st_size
            if size and os.pread(file, 1, size - 1) != b"\n":
                data = b"\n" + data  # a line left cut (a crash): the next ones start anew
            os.write(file, data)
        finally:
            os.close(file)
    finally:
        os.close(directory)


def encoded(event: Event) -> str:
    """``event``'s line; an event too long for one (a huge blame) loses its log lines and most
    of its text; one still too long is dropped ("")."""
    line = json.dumps(asdict(event), separators=(",", ":")) + "\n"
    if len(line.encode()) <= MAX_EVENT_BYTES:
        return line
    blame = event.blame
    if blame is not None:
        blame = replace(blame, log=[], health=blame.health[:20])
    smaller = replace(event, text=event.text[:TRIMMED_TEXT], blame=blame)
    line = json.dumps(asdict(smaller), separators=(",", ":")) + "\n"
    if len(line.encode()) <= MAX_EVENT_BYTES:
        return line
    return ""


def open_events_dir(home: str, make: bool) -> int:
    """``home/events`` opened (made 0700 first when ``make``), without following a link, and
    checked: a directory of this user's that no other user can write. Raises
    ``FileNotFoundError`` when it is absent (and not made)."""
    top = os.open(home, os.O_RDONLY | os.O_DIRECTORY)  # the home: wherever its path leads
    try:
        if make:
            with contextlib.suppress(FileExistsError):  # checked next, whoever made it
                os.mkdir(EVENTS_DIR, 0o700, dir_fd=top)
        try:
            directory = os.open(EVENTS_DIR, BELOW, dir_fd=top)
        except OSError as exc:
            if isinstance(exc, FileNotFoundError):
                raise
            where = os.path.join(home, EVENTS_DIR)
            raise UnsafeEvents(f"{where} is not a directory (a link?): {remove(where)}") from None
    finally:
        os.close(top)
    info = os.fstat(directory)
    mode = stat.S_IMODE(info.st_mode)
    if info.st_uid != os.getuid() or mode & 0o022:
        os.close(directory)
        where = os.path.join(home, EVENTS_DIR)
        owner = f"owned by uid {info.st_uid}, mode {mode:04o}"
        raise UnsafeEvents(f"{where} is {owner}: another user could write it: {remove(where)}")
    return directory


def remove(where: str) -> str:
    return f"remove it (rm -rf {where}) and meshkit makes its own; the history is never kept there"


def open_locked(directory: int, name: str) -> int:
    """This node's file in ``directory``, opened for appending and locked; past
    ``ROTATE_BYTES`` it is first renamed to its ``.1`` (replacing the older one) and a new one
    opened. A link or anything but a regular file at the name is refused."""
    while True:
        file = os.open(name, APPEND, 0o600, dir_fd=directory)
        try:
            info = os.fstat(file)
            if not stat.S_ISREG(info.st_mode):
                raise UnsafeEvents(f"events/{name} is not a regular file: {remove(name)}")
            fcntl.flock(file, fcntl.LOCK_EX)
            try:
                now = os.stat(name, dir_fd=directory, follow_symlinks=False)
            except FileNotFoundError:  # rotated away while this one waited for the lock
                os.close(file)
                continue
            if (now.st_dev, now.st_ino) != (info.st_dev, info.st_ino):
                os.close(file)  # rotated meanwhile: open the new one
                continue
            if os.fstat(file).st_size < ROTATE_BYTES:
                return file
            os.replace(name, f"{name}{OLDER}", src_dir_fd=directory, dst_dir_fd=directory)
            os.close(file)
        except BaseException:
            with contextlib.suppress(OSError):
                os.close(file)
            raise


# ---- reading


def read(home: str, since: float) -> list[Event]:
    """Every node's events at or after ``since`` in ``home``, each once, oldest first."""
    try:
        directory = open_events_dir(home, make=False)
    except (FileNotFoundError, NotADirectoryError):
        return []
    try:
        names = sorted(name for name in os.listdir(directory) if is_events_file(name))
        copies = []
        budget = TOTAL_BYTES
        for name in names[:MAX_FILES]:
            if budget <= 0:
                break
            data = read_file(directory, name, min(READ_BYTES, budget))
            budget -= len(data)
            copies.append(parse(data, since))
    finally:
        os.close(directory)
    return merge(copies)


def is_events_file(name: str) -> bool:
    if name.startswith("."):
        return False
    return name.endswith(SUFFIX) or name.endswith(f"{SUFFIX}{OLDER}")


def read_file(directory: int, name: str, limit: int) -> bytes:
    """The last ``limit`` bytes of a regular file in ``directory`` (b"": a link, not a regular
    file, or gone); a first line cut by the limit is left out."""
    try:
        file = os.open(name, READ, dir_fd=directory)
    except OSError:
        return b""
    try:
        info = os.fstat(file)
        if not stat.S_ISREG(info.st_mode):
            return b""
        start = max(0, info.st_size - limit)
        data = os.pread(file, limit, start)
    finally:
        os.close(file)
    if start > 0:
        data = data.partition(b"\n")[2]
    return data


def parse(data: bytes, since: float) -> list[Event]:
    """The events of ``data``'s lines at or after ``since``; a damaged line (not JSON, not an
    event) is skipped, as is what follows the first ``READ_LINES`` lines."""
    found = []
    for line in data.splitlines()[-READ_LINES:]:
        try:
            fields = json.loads(line)
        except ValueError:  # UnicodeDecodeError and JSONDecodeError alike
            continue
        if not isinstance(fields, dict):
            continue
        when = fields.get("time")
        if not isinstance(when, (int, float)) or when < since:
            continue
        try:
            found.append(build(Event, fields, "event"))
        except (ValueError, TypeError):  # record.Invalid is a ValueError
            continue
    return found


def page(found: list[Event], limit: int) -> EventsReply:
    """The first ``limit`` of ``found`` that fit ``REPLY_BYTES`` once encoded."""
    kept: list[Event] = []
    used = 0
    for event in found[:limit]:
        used += len(json.dumps(asdict(event))) + 2
        if used > REPLY_BYTES:
            break
        kept.append(event)
    return EventsReply(kept, more=len(kept) < len(found))
