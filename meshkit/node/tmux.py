"""The one tmux wrapper: start a detached session, end one, and tell whether a server may run.
Used on the nodes (a job's session, its supervisor's) and on the controller (the supervisor it
starts). Every call goes through ``command.run``, bounded by ``TIMEOUT``. Standard library only.
"""

from __future__ import annotations

import contextlib
import os

from . import command

TIMEOUT = 10.0


class TmuxError(Exception):
    """tmux refused or could not be started (its message)."""


def server_may_run() -> bool:
    """Whether this user's default tmux server may be up: something accepts on its socket. tmux
    leaves the socket file behind when its server exits, so the file alone says little; without
    a server there is no session to kill, and asking tmux would cost every node a process, twice
    at every launch. Anything but a refused connection counts as "may run"."""
    base = os.environ.get("TMUX_TMPDIR") or "/tmp"
    path = f"{base}/tmux-{os.getuid()}/default"
    if not os.path.exists(path):
        return False
    import socket

    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(TIMEOUT)
        try:
            probe.connect(path)  # tmux drops a client that closes before identifying itself
        except ConnectionRefusedError:
            return False
        except OSError:
            pass  # anything else: it may run
    return True


def kill_session(name: str) -> None:
    """End tmux session ``name`` (exactly that name) if it exists."""
    if server_may_run():
        with contextlib.suppress(OSError):  # TimeoutError included
            command.run(["tmux", "kill-session", "-t", f"={name}"], TIMEOUT)


def new_session(name: str, argv: list[str]) -> None:
    """Start ``argv`` detached in a new session ``name``. Nothing passes through a shell or
    tmux's format expansion (no ``-c``): the command changes directory itself."""
    # A client that reaches the last session's server as it shuts down is told "server exited
    # unexpectedly" and nothing started; the next try starts a server of its own.
    tmux = ["tmux", "new-session", "-d", "-s", name, "--", *argv]
    for _ in range(2):
        try:
            code, stderr = command.run(tmux, TIMEOUT)
        except OSError as exc:
            raise TmuxError(f"cannot run tmux: {exc}") from None
        if "server exited unexpectedly" not in stderr:
            break
    if code != 0:
        raise TmuxError(stderr.strip()[-300:] or f"tmux exited {code}")
