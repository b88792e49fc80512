"""Running a short command from the agent (tmux): the one place node ops start one and wait
for it. posix_spawn, not subprocess: that import (threading, selectors) would be paid by every
node's agent at every launch. What Popen would do is done here too: stdin and stdout on
/dev/null, stderr read back, SIGPIPE and SIGXFSZ at their defaults in the command, and no
other descriptor passed on (Python opens every one close-on-exec). Standard library only."""

from __future__ import annotations

import os
import select
import time

from .signals import RESET_FOR_EXEC, SIGKILL, exit_code

MAX_STDERR = 65536


def run(argv: list[str], timeout: float) -> tuple[int, str]:
    """``(exit status, the end of its stderr)``. ``TimeoutError`` once it has run ``timeout``
    seconds (it is killed); ``OSError`` when it cannot be started."""
    read_end, write_end = os.pipe()
    try:
        pid = os.posix_spawnp(
            argv[0],
            argv,
            os.environ,
            file_actions=[
                (os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
                (os.POSIX_SPAWN_OPEN, 1, os.devnull, os.O_WRONLY, 0),
                (os.POSIX_SPAWN_DUP2, write_end, 2),
            ],
            setsigdef=RESET_FOR_EXEC,
        )
    except OSError:
        os.close(read_end)
        raise
    finally:
        os.close(write_end)
    stderr = b""
    deadline = time.monotonic() + timeout
    try:
        while True:
            remaining = deadline - time.monotonic()
            readable: list[int] = []
            if remaining > 0:
                readable, _, _ = select.select([read_end], [], [], remaining)
            if not readable:
                os.kill(pid, SIGKILL)
                os.waitpid(pid, 0)
                raise TimeoutError(f"{argv[0]} did not finish within {timeout:.0f}s")
            chunk = os.read(read_end, 65536)
            if not chunk:
                break
            stderr = (stderr + chunk)[-MAX_STDERR:]
    finally:
        os.close(read_end)
    _, status = os.waitpid(pid, 0)
    return exit_code(status), stderr.decode(errors="replace")
