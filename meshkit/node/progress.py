"""The job's ranks' steps on this node, as they told them (``meshkit.progress``): each rank's
file in the job's progress directory, read bounded (a regular file of this user's, no link
followed, ``MAX_FILE`` bytes, ``MAX_RANKS`` files) and checked field by field; what does not fit
is left out, never an error of the status it rides on. The rates are taken over the asked window
from the file's checkpoints (``figures``, pure). Standard library only."""

from __future__ import annotations

import contextlib
import json
import math
import os
import stat
import time

from ..protocol import RankProgress
from . import files

MAX_FILE = 64 * 1024  # bytes of one rank's file (a full ring is about 3 KiB)
MAX_RANKS = 1024  # files read at most
READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
MIN_SPAN = 0.5  # of the window: a rate over less of it is too young to tell


def read_progress(
    directory: str, started: float | None, window: float, now: float | None = None
) -> list[RankProgress]:
    """Each rank's progress in the job's state ``directory``, by rank; a file last written
    before this attempt ``started`` is an earlier attempt's and is left out."""
    progress = files.progress_dir(directory)
    if files.unsafe(progress) is not None:
        return []
    try:
        names = sorted(os.listdir(progress))[:MAX_RANKS]
    except OSError:
        return []
    if now is None:
        now = time.time()
    found = []
    for name in names:
        rank = files.error_file_rank(name)
        if rank is None or not rank.isdigit():
            continue
        data = _read(f"{progress}/{name}")
        if data is None:
            continue
        told = figures(data, int(rank), window, now)
        if told is None:
            continue
        if started is not None and now - told.age < started:
            continue  # an earlier attempt's
        found.append(told)
    found.sort(key=lambda item: item.rank)
    return found


def _read(path: str) -> dict[str, object] | None:
    try:
        descriptor = os.open(path, READ)
    except OSError:
        return None
    with contextlib.closing(os.fdopen(descriptor, "rb")) as handle:
        info = os.fstat(descriptor)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid():
            return None
        try:
            data = json.loads(handle.read(MAX_FILE + 1)[:MAX_FILE])
        except (OSError, ValueError):
            return None
    return data if isinstance(data, dict) else None


def _number(value: object) -> float | None:
    """A finite, non-negative number, or None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if not math.isfinite(value) or value < 0:
        return None
    return float(value)


def _point(value: object, size: int) -> list[float] | None:
    """A checkpoint: ``size`` finite, non-negative numbers."""
    if not isinstance(value, list) or len(value) != size:
        return None
    numbers = [_number(item) for item in value]
    checked = [number for number in numbers if number is not None]
    return checked if len(checked) == size else None


def figures(data: dict[str, object], rank: int, window: float, now: float) -> RankProgress | None:
    """Pure: one rank's file made its record (None: the file does not fit). The rates run from
    the oldest checkpoint inside the window to the last step written."""
    steps = _number(data.get("step"))
    last = _number(data.get("time"))
    compute = _number(data.get("compute"))
    sections = _number(data.get("sections"))
    if steps is None or last is None or compute is None or sections is None:
        return None
    if steps > 2**53 or last > now + 60:
        return None
    ring = data.get("ring")
    points = []
    if isinstance(ring, list):
        for item in ring[:1000]:
            point = _point(item, 3)
            if point is not None:
                points.append(point)
    rate = None
    step_s = None
    compute_s = None
    inside = [point for point in points if point[0] >= last - window]
    if inside:
        since, then_steps, then_compute = inside[0]
        span = last - since
        done = steps - then_steps
        if span >= window * MIN_SPAN and done > 0:
            rate = done / span
            step_s = span / done
            if sections > 0:
                compute_s = max(0.0, compute - then_compute) / done
    early_step_s = None
    first = _point(data.get("first"), 2)
    early = _point(data.get("early"), 2)
    if first is not None and early is not None and early[1] > first[1] and early[0] > first[0]:
        early_step_s = (early[0] - first[0]) / (early[1] - first[1])
    age = max(0.0, now - last)
    return RankProgress(rank, int(steps), age, rate, step_s, compute_s, early_step_s)
