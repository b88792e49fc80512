"""A rank's progress, told to meshkit: ``meshkit.progress.step()`` once per training step, and
optionally ``with meshkit.progress.compute():`` around the step's own computation (what excludes
waiting in collectives). meshkit then watches the job by its steps (a stall is no step, not no
output) and compares the nodes' compute time per step (a straggler).

Each call costs about a microsecond; at most about once a second (and at the first step) the rank
writes a small file into its node's state directory (``$MESHKIT_PROGRESS/rank<R>.json``, 0600,
through a new temporary of a name nobody can guess, as the rank hook writes). Outside a meshkit
job (no ``MESHKIT_PROGRESS`` or no ``RANK``) both do nothing. Works under torchrun and
``--spawn``: each rank writes its own file. Standard library only: it runs inside the user's
ranks.

The file holds the counts so far and a ring of checkpoints (one every ``CHECKPOINT_S``, the last
``RING`` of them), from which the node's agent computes rates over whatever window it is asked
about; and the checkpoint ``EARLY_S`` after the first step, the job's own pace in its first
minutes, to which a job without compute sections is compared.
"""

from __future__ import annotations

import contextlib
import json
import os
import time

WRITE_EVERY = 1.0  # seconds between two writes of the file, at most about one a second
CHECKPOINT_S = 5.0  # seconds between two checkpoints of the ring
RING = 61  # checkpoints kept: five minutes of them
EARLY_S = 120.0  # the first minutes: the pace a job without compute sections is compared to
NEW_FILE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW


class _Progress:
    """One rank's counts; ``path`` None: not in a meshkit job, nothing is kept or written."""

    def __init__(self, path: str | None, rank: int) -> None:
        self.path = path
        self.rank = rank
        self.steps = 0
        self.compute = 0.0  # seconds inside compute sections, in all
        self.sections = 0  # compute sections ended
        self.last = 0.0  # wall time of the last step
        self.next_write = 0.0  # monotonic time of the next write
        self.next_checkpoint = 0.0
        self.ring: list[list[float]] = []  # [wall time, steps, compute seconds]
        self.first: list[float] | None = None  # [wall time, steps] at the first step
        self.early: list[float] | None = None  # ... EARLY_S after it
        self.entered = 0.0  # perf_counter at the open compute section's start

    def step(self) -> None:
        self.steps += 1
        now = time.monotonic()
        if now < self.next_write:
            return
        self.last = time.time()
        self.next_write = now + WRITE_EVERY
        if self.first is None:
            self.first = [self.last, float(self.steps)]
        elif self.early is None and self.last - self.first[0] >= EARLY_S:
            self.early = [self.last, float(self.steps)]
        if now >= self.next_checkpoint:
            self.next_checkpoint = now + CHECKPOINT_S
            self.ring.append([self.last, float(self.steps), self.compute])
            del self.ring[:-RING]
        self.write()

    def write(self) -> None:
        """The file, replaced whole; a failure to write (a full disk, a removed directory) is
        the job's business, never an exception in its training loop."""
        assert self.path is not None
        data = {
            "rank": self.rank,
            "pid": os.getpid(),
            "step": self.steps,
            "time": self.last,
            "compute": self.compute,
            "sections": self.sections,
            "first": self.first,
            "early": self.early,
            "ring": self.ring,
        }
        temporary = f"{self.path}.{os.urandom(8).hex()}"
        try:
            descriptor = os.open(temporary, NEW_FILE, 0o600)
            with os.fdopen(descriptor, "w") as handle:
                json.dump(data, handle)
            os.replace(temporary, self.path)
        except OSError:
            with contextlib.suppress(OSError):
                os.unlink(temporary)


class _Compute:
    """``with compute():``: the time inside is the step's computation. One object, reused."""

    def __enter__(self) -> None:
        _state().entered = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        state = _state()
        state.compute += time.perf_counter() - state.entered
        state.sections += 1


_progress: _Progress | None = None
_compute = _Compute()


def _state() -> _Progress:
    """This process's counts, made at the first call from its environment."""
    global _progress
    if _progress is None:
        directory = os.environ.get("MESHKIT_PROGRESS", "")
        rank = os.environ.get("RANK", "")
        if directory and rank.isdigit():
            _progress = _Progress(os.path.join(directory, f"rank{rank}.json"), int(rank))
        else:
            _progress = _Progress(None, 0)
    return _progress


def step() -> None:
    """One training step done by this rank."""
    state = _progress if _progress is not None else _state()
    if state.path is not None:
        state.step()


def compute() -> _Compute:
    """The step's computation: ``with meshkit.progress.compute(): loss = ...``."""
    return _compute
