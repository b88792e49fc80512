"""A node's side of ``meshkit diagnose``: the job's ranks here and their live Python stacks, and
the errors its ranks left. Standard library only (py-spy is a program, run as one).

The ranks are the Python processes in the job's keeper tree whose environment carries ``RANK``
(torchrun's workers, ``--spawn``'s ranks), the topmost of each rank (a data loader's workers carry
the same ``RANK``). The job's keeper reads their stacks (``answer``, in the keeper; ``ask``, here):
under Yama's ``ptrace_scope`` 1 only it, an ancestor of the ranks, and what it starts may. Their
errors are the files the rank hook (``node/hook``) wrote when a rank raised, newer than this
attempt's start.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from ..protocol import (
    PROGRESS_WINDOW,
    DiagnoseReply,
    DiagnoseRequest,
    JobState,
    RankError,
    RankStack,
)
from ..record import asdict, build
from . import files, jobs, procs

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

MAX_FRAMES = 100  # of the main thread, innermost kept
MAX_THREADS = 16  # other threads listed
MAX_ERRORS = 8  # the earliest error files (the first failure is among them)
MAX_TRACE = 40  # lines of a traceback
MAX_SECONDS = 60  # per rank, whatever the request says
MAX_STACK = 1 << 22  # bytes of one rank's stack as the keeper sends it
MAX_TEXT = 300  # characters kept of a frame, a traceback line or a reason
YAMA = "/proc/sys/kernel/yama/ptrace_scope"


def diagnose(request: DiagnoseRequest) -> DiagnoseReply:
    arrived = time.time()  # against the controller's clock: see DiagnoseReply.clock
    files.check_dir(files.job_dir(request.job_id))
    state, code = jobs.job_state(request.job_id)
    started = jobs.started_at(request.job_id)
    keeper = jobs.keeper_pid(request.job_id)
    found: dict[int, int] = {}
    if keeper and request.stacks:
        found = rank_processes(keeper)
    stacks: list[RankStack] = []
    problem = None
    if found and not py_spy():
        problem = f"py-spy is not installed: {sys.executable} -m pip install py-spy"
    elif found:
        sock = files.stacks_socket(files.job_dir(request.job_id))

        def ask_keeper(rank: int) -> RankStack:
            return ask(sock, rank, found[rank], request.seconds)

        with ThreadPoolExecutor(len(found)) as pool:
            stacks = list(pool.map(ask_keeper, found))
    errors = read_errors(files.errors_dir(request.home), started)
    tail: list[str] = []
    if state == JobState.EXITED and code and not errors:
        tail = log_traceback(request.log)  # no rank left an error file: the log may say
    idle = jobs.idle(request.log, started)
    progress = []
    if state == JobState.RUNNING:  # a job that tells its steps stalls by them
        from .progress import read_progress

        progress = read_progress(files.job_dir(request.job_id), started, PROGRESS_WINDOW)
    return DiagnoseReply(state, code, idle, stacks, errors, tail, problem, arrived, progress)


def rank_processes(keeper: int) -> dict[int, int]:
    """rank -> pid, by rank: the job's Python processes carrying ``RANK``, the topmost of each."""
    table = procs.parents()
    rank_of: dict[int, int] = {}  # pid -> rank
    for pid in procs.descendants(keeper, table):
        try:
            if "python" not in os.path.basename(os.readlink(f"/proc/{pid}/exe")):
                continue
            with open(f"/proc/{pid}/environ", "rb") as handle:
                environ = handle.read()
        except OSError:
            continue
        rank = b""
        for entry in environ.split(b"\0"):
            name, _, value = entry.partition(b"=")
            if name == b"RANK":
                rank = value  # the last one wins, as in Python's os.environ
        if rank.isdigit():
            rank_of[pid] = int(rank)
    topmost = []  # (rank, pid): a data loader's workers carry their rank's RANK too
    for pid, rank_number in rank_of.items():
        if rank_of.get(table.get(pid, 0)) != rank_number:
            topmost.append((rank_number, pid))
    return dict(sorted(topmost))


def py_spy() -> str | None:
    # the interpreter's own bin first: a venv's, which the agent's PATH may lack
    own_bin = os.path.dirname(sys.executable)
    path = f"{own_bin}{os.pathsep}{os.environ.get('PATH', os.defpath)}"
    return shutil.which("py-spy", path=path)


def ask(sock: str, rank: int, pid: int, seconds: float) -> RankStack:
    """One rank's stack, from the job's keeper listening on ``sock``."""
    try:
        with socket.socket(socket.AF_UNIX) as connection:
            # py-spy, then the flight recorder: each bounded by ``seconds``
            connection.settimeout(2 * seconds + 5)
            connection.connect(sock)
            connection.sendall(f"{rank} {pid} {int(seconds)}\n".encode())
            answer = json.loads(connection.makefile("rb").read(MAX_STACK))
            return build(RankStack, answer, "stack")
    except (OSError, ValueError) as exc:  # a timeout, no keeper, a reply cut short
        return RankStack(rank, pid, [], [], f"the job's keeper did not read it: {exc}")


def answer(connection: socket.socket) -> None:
    """In the keeper: the stack of the rank its question names (``RANK PID SECONDS``), if that
    process is in this keeper's tree."""
    with connection, contextlib.suppress(OSError, ValueError):  # ask says what it did not get
        connection.settimeout(5)
        question = connection.makefile("rb").readline(100).split()
        rank, pid, seconds = (int(word) for word in question)
        limit = min(max(seconds, 1), MAX_SECONDS)
        spy = py_spy()
        if pid not in procs.descendants(os.getpid()) or not spy:
            stack = RankStack(rank, pid, [], [], "not a process of this job, or no py-spy")
        else:
            stack = dump(spy, rank, pid, limit)
        connection.settimeout(limit)
        connection.sendall(json.dumps(asdict(stack)).encode())


def dump(spy: str, rank: int, pid: int, seconds: float) -> RankStack:
    """One rank's stack by ``py-spy dump`` (the rank is paused for the read), bounded in time,
    and what its flight recorder says (the rank hook's thread dumps it when asked)."""
    fifo = files.fifo(pid)
    asked = None
    try:
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))  # its reader sees EOF: dump
        asked = time.time()
    except OSError:
        pass  # no recorder thread (flight recorder off, or not started by meshkit run)
    argv = [spy, "dump", "--pid", str(pid), "--json"]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=seconds, check=False)
    except subprocess.TimeoutExpired:
        return RankStack(rank, pid, [], [], f"py-spy did not answer within {seconds:.0f}s")
    except OSError as exc:
        return RankStack(rank, pid, [], [], f"py-spy failed: {exc}")
    # its output, not its exit code: the keeper's own wait for orphans may reap py-spy first
    threads: object = None
    with contextlib.suppress(ValueError):
        threads = json.loads(done.stdout)
    if not isinstance(threads, list):
        said = done.stderr.strip().splitlines() or ["no output"]
        why = said[0][:MAX_TEXT]
        if "ermission" in why or "not permitted" in why:
            scope = files.read_text(YAMA, 8) or "absent"
            why += (
                f" (Yama ptrace_scope {scope.strip()}): run the job and meshkit as root, or "
                f"`sysctl kernel.yama.ptrace_scope=0`, or `setcap cap_sys_ptrace+ep {spy}`"
            )
        return RankStack(rank, pid, [], [], f"cannot read its stack: {why}")

    def main_thread_first(thread: dict[str, object]) -> bool:
        return thread.get("os_thread_id") != pid

    threads.sort(key=main_thread_first)
    stacks = [_frames(thread, MAX_FRAMES) for thread in threads] or [[]]
    seq = None
    collective = None
    if asked:
        seq, collective = flight(files.fifo_dump(fifo), asked, seconds)
    others = stacks[1 : MAX_THREADS + 1]
    return RankStack(rank, pid, stacks[0], others, None, seq, collective)


def flight(path: str, asked: float, seconds: float) -> tuple[int | None, str | None]:
    """``(sequence number, name)`` of the last collective in a flight-recorder dump written
    since ``asked``; ``(None, None)`` when none was written within ``seconds``."""
    entries = None
    while time.time() < asked + seconds:
        entries = _fresh_entries(path, asked)
        if entries is not None:
            break
        time.sleep(0.02)
    if entries is None:
        return None, None
    if not entries:
        return 0, None
    last = max(entries, key=lambda entry: entry.get("collective_seq_id", 0))
    name = f"{last.get('profiling_name')} ({last.get('state')})"
    return int(last.get("collective_seq_id", 0)), name


def _fresh_entries(path: str, asked: float) -> list[dict[str, Any]] | None:
    """The dump's entries if it was written since ``asked`` (None: not yet, or not
    readable)."""
    try:
        if os.stat(path).st_mtime < asked - 0.01:
            return None
        dumped = json.loads(files.read_text(path, 1 << 24) or "{}")
        entries: list[dict[str, Any]] = dumped.get("entries") or []
    except (OSError, ValueError):
        return None
    return entries


def _frames(thread: dict[str, list[dict[str, object]]], keep: int) -> list[str]:
    """py-spy lists innermost first; innermost last here: "function (file:line)"."""
    lines = []
    for frame in reversed(thread["frames"][:keep]):
        lines.append(f"{frame.get('name')} ({frame.get('filename')}:{frame.get('line')})")
    return [line[:MAX_TEXT] for line in lines]


def read_errors(directory: str, started: float | None) -> list[RankError]:
    """The errors ranks left in this attempt (files written since it started), earliest first."""
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    found = []
    for name in names:
        file_rank = files.error_file_rank(name)
        if file_rank is None:
            continue
        path = os.path.join(directory, name)
        try:
            if started is not None and os.stat(path).st_mtime < started - 1:
                continue  # an earlier attempt's
            found.append(_rank_error(path, file_rank))
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            continue
    found.sort(key=lambda error: error.time)
    return found[:MAX_ERRORS]


def _rank_error(path: str, file_rank: str) -> RankError:
    """One error file: torchelastic's shape, with the hook's own fields (its rank, its node
    and the time to the microsecond) where it wrote them."""
    data = json.loads(files.read_text(path, 1 << 18) or "")
    message = data["message"]
    ours = data.get("meshkit") or {}
    when = float(ours.get("time") or message["extraInfo"]["timestamp"])
    trace = str(message["extraInfo"].get("py_callstack") or "").splitlines()
    last = str(message["message"]).strip().splitlines() or ["?"]
    rank = int(ours.get("rank", file_rank))
    node = None
    if ours.get("node_rank") is not None:
        node = int(ours["node_rank"])
    kept_trace = [line[:MAX_TEXT] for line in trace[-MAX_TRACE:]]
    return RankError(rank, node, when, last[-1][:500], kept_trace)


def log_traceback(path: str) -> list[str]:
    """The log's last Python traceback, through its exception line (a rank killed before its
    hook could write, or a script run with ``python -I``)."""
    lines = jobs.tail(path, 65536)
    starts = [i for i, line in enumerate(lines) if line.startswith("Traceback (most recent")]
    if not starts:
        return []
    block = lines[starts[-1] :]
    # The traceback ends at its first unindented line after the header: the exception.
    end = len(block)
    for i, line in enumerate(block[1:], 1):
        if line[:1] not in (" ", "\t"):
            end = i + 1
            break
    return [line[:MAX_TEXT] for line in block[:end][-MAX_TRACE:]]
