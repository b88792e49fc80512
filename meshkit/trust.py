"""Which files meshkit trusts, by OpenSSH's rule (``secure_permissions`` in its misc.c, what
ssh applies to ``~/.ssh/config``): a file is trusted only when it is owned by this user or by
root and no one else (group or other) can write it. What such a file says is obeyed as the
operator, often root: a ``ProxyCommand`` or ``Match exec`` in an ssh_config, the node-side
``python`` of a meshkit.yaml, the hosts of a hostfile. So a configuration file another local
user owns or can write is refused, by name and with the fix, and nothing is done.

Standard library only (``os``, ``stat``): ``meshkit env`` reads its configuration through
this on every node at every start, and the node side checks the GPU driver's files with it.
"""

from __future__ import annotations

import os
import stat

from .errors import UntrustedFileError

GROUP_OR_OTHER_WRITE = 0o022
OPEN_FLAGS = os.O_RDONLY | os.O_NONBLOCK  # a FIFO planted at the name must not block the read
ROOT = 0


def trusted_owners() -> tuple[int, ...]:
    """The owners a file meshkit obeys may have: this user and root."""
    return (os.getuid(), ROOT)


def distrust(info: os.stat_result, owners: tuple[int, ...]) -> str | None:
    """Why a file (or directory) with this status is not to be trusted, in words (None: it is):
    its owner is none of ``owners``, or group or others can write it."""
    if info.st_uid not in owners:
        allowed = " or ".join(f"uid {owner}" for owner in dict.fromkeys(owners))
        return f"owned by uid {info.st_uid}, not by {allowed}"
    mode = stat.S_IMODE(info.st_mode)
    if mode & GROUP_OR_OTHER_WRITE:
        return f"mode {mode:04o}: group or others can write it"
    return None


def fix_for(path: str, info: os.stat_result) -> str:
    """What to do about an untrusted ``path``: make it this user's and not writable by others,
    if it is to be trusted at all."""
    if info.st_uid not in trusted_owners():
        return (
            f"if its content is yours to trust, take it over (chown {os.getuid()} {path}; "
            f"chmod go-w {path}), else remove it"
        )
    return f"chmod go-w {path}"


def refusal(path: str, info: os.stat_result, what: str) -> UntrustedFileError:
    """The error for an untrusted ``path``: which file, what was found, the fix."""
    problem = distrust(info, trusted_owners())
    return UntrustedFileError(
        f"{path}: {what} {problem}; meshkit obeys only a file of yours or root's that no one "
        f"else can write, as OpenSSH does: {fix_for(path, info)}"
    )


def read_config(path: str, limit: int, what: str) -> bytes | None:
    """A configuration file's bytes, read as ``read_trusted`` reads them; None when there is
    none, or the name is a directory (a level of configuration that is not a file: skipped)."""
    if os.path.isdir(path):
        return None
    return read_trusted(path, limit, what)


def read_trusted(path: str, limit: int, what: str, check: bool = True) -> bytes | None:
    """``path``'s bytes (at most ``limit``; more is an ``UntrustedFileError`` too), when it is
    a regular file owned by this user or root and not writable by group or others. None when
    there is no such path; an ``OSError`` when it cannot be read. The check is made on the
    file opened (``fstat`` of its descriptor), so the file checked is the file read, whatever
    is renamed meanwhile; a symlink is followed and its target checked, as OpenSSH does for
    its configuration. ``what``: how the message names the file ("configuration file",
    "ssh_config", "hostfile"). ``check`` False: any owner and mode (the hostfile of a user
    who is not root), still a regular file within ``limit``."""
    try:
        descriptor = os.open(path, OPEN_FLAGS)
    except FileNotFoundError:
        return None
    named = os.path.abspath(path)  # the fix works from any directory
    try:
        info = os.fstat(descriptor)
        if not stat.S_ISREG(info.st_mode):
            raise UntrustedFileError(f"{named}: {what} is not a regular file: name a file")
        if check and distrust(info, trusted_owners()) is not None:
            raise refusal(named, info, what)
        if info.st_size > limit:
            raise UntrustedFileError(f"{named}: {what} larger than {limit} bytes; is it one?")
        chunks = []
        size = 0
        while size <= limit:
            chunk = os.read(descriptor, limit + 1 - size)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        if size > limit:
            raise UntrustedFileError(f"{named}: {what} larger than {limit} bytes; is it one?")
        return b"".join(chunks)
    finally:
        os.close(descriptor)
