"""A node's ranks started by meshkit itself (``meshkit run --spawn``), as torchrun's agent starts
its workers, but without the agent: torchrun is an interpreter that imports torch (a second or
more of CPU) before it starts any rank, on every node at every launch. Here each rank is ``bash -c
SCRIPT`` with its own variables, in a process group of its own so that it can be ended with
whatever it started. One rank failing ends the node's others, as torchrun does, so that a job
never waits forever on a collective its peer left. Standard library only (no subprocess:
every node's start would pay its import)."""

from __future__ import annotations

import os
import time
from collections.abc import Sequence

from . import signals

TYPE_CHECKING = False
if TYPE_CHECKING:
    from types import FrameType

GRACE = 10.0  # seconds the other ranks get after a TERM before they are killed
FORWARDED = (signals.SIGTERM, signals.SIGINT, signals.SIGHUP)


class Ranks:
    """The node's rank processes: started together, signalled together, waited for together."""

    def __init__(self, script: str, envs: Sequence[dict[str, str]]) -> None:
        self.script = script
        self.envs = list(envs)
        self.running: dict[int, int] = {}  # pid (also its process group) -> local rank
        self.signalled: int | None = None  # the last signal this process was sent

    def signal_all(self, number: int) -> None:
        for pid in list(self.running):
            try:  # the rank and everything in its process group
                os.killpg(pid, number)
            except (ProcessLookupError, PermissionError):
                continue  # gone already

    def _forward(self, number: int, frame: FrameType | None) -> None:
        self.signalled = number
        self.signal_all(number)

    def run(self) -> int:
        """Start every rank, wait for all of them; the first failure's exit code (128+N for a
        signal), else 0. Signals this process gets (those it does not ignore: the keeper ignores
        HUP and INT for its job) are passed to every rank."""
        for number in FORWARDED:
            if signals.signal(number, self._forward) == signals.SIG_IGN:
                signals.signal(number, signals.SIG_IGN)  # ignored on purpose: stays ignored
        argv = ["bash", "-c", self.script]
        try:
            for local_rank, env in enumerate(self.envs):
                pid = os.posix_spawnp(
                    "bash", argv, env, setpgroup=0, setsigdef=signals.RESET_FOR_EXEC
                )
                self.running[pid] = local_rank
        except OSError:
            self.signal_all(signals.SIGKILL)
            self._reap(deadline=None)
            raise
        if self.signalled is not None:  # it came while the last ranks were starting
            self.signal_all(self.signalled)
        return self._reap(deadline=None)

    def _reap(self, deadline: float | None) -> int:
        code = 0
        while self.running:
            if deadline is None:
                pid, status = os.waitpid(-1, 0)  # retried after a forwarded signal (PEP 475)
            else:
                pid, status = os.waitpid(-1, os.WNOHANG)
                if pid == 0:
                    if time.monotonic() >= deadline:
                        self.signal_all(signals.SIGKILL)
                        deadline = None
                    else:
                        time.sleep(0.05)
                    continue
            if self.running.pop(pid, None) is None:
                continue  # not a rank (nothing else is this process's child)
            rank_code = signals.exit_code(status)
            if rank_code and not code:
                code = rank_code
                # The others would wait on it in their next collective until their timeout.
                self.signal_all(signals.SIGTERM)
                deadline = time.monotonic() + GRACE
        return code


def run_ranks(script: str, envs: Sequence[dict[str, str]]) -> int:
    return Ranks(script, envs).run()
