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

from ..protocol import DiagnoseReply, DiagnoseRequest, RankError, RankStack
from ..record import asdict, build
from . import jobs, procs
from .files import STACKS, read_text, state_root

MAX_FRAMES = 100  # of the main thread, innermost kept
MAX_THREADS = 16  # other threads listed
MAX_ERRORS = 8  # the earliest error files (the first failure is among them)
MAX_TRACE = 40  # lines of a traceback
MAX_SECONDS = 60  # per rank, whatever the request says
MAX_STACK = 1 << 22  # bytes of one rank's stack as the keeper sends it
YAMA = "/proc/sys/kernel/yama/ptrace_scope"


def diagnose(request: DiagnoseRequest) -> DiagnoseReply:
    state, code = jobs.job_state(request.job_id)
    started = jobs.started_at(request.job_id)
    keeper = jobs.keeper_pid(request.job_id)
    found = rank_processes(keeper) if keeper else {}
    stacks: list[RankStack] = []
    problem = None
    if found and not py_spy():
        problem = f"py-spy is not installed: {sys.executable} -m pip install py-spy"
    elif found:
        sock = f"{jobs.state_dir(request.job_id)}/{STACKS}"
        with ThreadPoolExecutor(len(found)) as pool:
            stacks = list(pool.map(lambda r: ask(sock, r, found[r], request.seconds), found))
    errors = read_errors(os.path.join(request.home, "errors"), started)
    tail = log_traceback(request.log) if state == "exited" and code and not errors else []
    idle = jobs.idle(request.log, started)
    return DiagnoseReply(state, code, idle, stacks, errors, tail, problem)


def rank_processes(keeper: int) -> dict[int, int]:
    """rank -> pid, by rank: the job's Python processes carrying ``RANK``, the topmost of each."""
    table = procs.parents()
    found: dict[int, int] = {}
    for pid in procs.descendants(keeper, table):
        try:
            if "python" not in os.path.basename(os.readlink(f"/proc/{pid}/exe")):
                continue
            with open(f"/proc/{pid}/environ", "rb") as handle:
                env = dict(v.partition(b"=")[::2] for v in handle.read().split(b"\0"))
        except OSError:
            continue
        rank = env.get(b"RANK", b"")
        if rank.isdigit():
            found[pid] = int(rank)
    return dict(sorted((r, p) for p, r in found.items() if found.get(table.get(p, 0)) != r))


def py_spy() -> str | None:
    # the interpreter's own bin first: a venv's, which the agent's PATH may lack
    path = f"{os.path.dirname(sys.executable)}{os.pathsep}{os.environ.get('PATH', os.defpath)}"
    return shutil.which("py-spy", path=path)


def ask(sock: str, rank: int, pid: int, seconds: float) -> RankStack:
    """One rank's stack, from the job's keeper listening on ``sock``."""
    try:
        with socket.socket(socket.AF_UNIX) as conn:
            conn.settimeout(2 * seconds + 5)  # py-spy, then the flight recorder: each bounded
            conn.connect(sock)
            conn.sendall(f"{rank} {pid} {int(seconds)}\n".encode())
            return build(RankStack, json.loads(conn.makefile("rb").read(MAX_STACK)), "stack")
    except (OSError, ValueError) as exc:  # a timeout, no keeper, a reply cut short
        return RankStack(rank, pid, [], [], f"the job's keeper did not read it: {exc}")


def answer(conn: socket.socket) -> None:
    """In the keeper: the stack of the rank its question names (``RANK PID SECONDS``), if that
    process is in this keeper's tree."""
    with conn, contextlib.suppress(OSError, ValueError):  # ask says what it did not get
        conn.settimeout(5)
        rank, pid, seconds = (int(w) for w in conn.makefile("rb").readline(100).split())
        limit, spy = min(max(seconds, 1), MAX_SECONDS), py_spy()
        if pid not in procs.descendants(os.getpid()) or not spy:
            stack = RankStack(rank, pid, [], [], "not a process of this job, or no py-spy")
        else:
            stack = dump(spy, rank, pid, limit)
        conn.settimeout(limit)
        conn.sendall(json.dumps(asdict(stack)).encode())


def dump(spy: str, rank: int, pid: int, seconds: float) -> RankStack:
    """One rank's stack by ``py-spy dump`` (the rank is paused for the read), bounded in time,
    and what its flight recorder says (the rank hook's thread dumps it when asked)."""
    fifo = f"{state_root()}/fr-{pid}"
    try:
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))  # its reader sees EOF: dump
        asked = time.time()
    except OSError:
        asked = None  # no recorder thread (flight recorder off, or not started by meshkit run)
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
        why = (done.stderr.strip().splitlines() or ["no output"])[0][:300]
        if "ermission" in why or "not permitted" in why:
            scope = read_text(YAMA, 8) or "absent"
            why += (
                f" (Yama ptrace_scope {scope.strip()}): run the job and meshkit as root, or "
                f"`sysctl kernel.yama.ptrace_scope=0`, or `setcap cap_sys_ptrace+ep {spy}`"
            )
        return RankStack(rank, pid, [], [], f"cannot read its stack: {why}")
    threads.sort(key=lambda t: t.get("os_thread_id") != pid)  # the main thread first
    frames = [_frames(t, MAX_FRAMES) for t in threads] or [[]]
    seq, collective = flight(f"{fifo}.json", asked, seconds) if asked else (None, None)
    return RankStack(rank, pid, frames[0], frames[1 : MAX_THREADS + 1], None, seq, collective)


def flight(path: str, asked: float, seconds: float) -> tuple[int | None, str | None]:
    """The last collective in a flight-recorder dump written since ``asked``."""
    while time.time() < asked + seconds:
        try:
            if os.stat(path).st_mtime >= asked - 0.01:
                entries = json.loads(read_text(path, 1 << 24) or "{}").get("entries") or []
                break
        except (OSError, ValueError):
            pass
        time.sleep(0.02)
    else:
        return None, None
    if not entries:
        return 0, None
    last = max(entries, key=lambda e: e.get("collective_seq_id", 0))
    name = f"{last.get('profiling_name')} ({last.get('state')})"
    return int(last.get("collective_seq_id", 0)), name


def _frames(thread: dict[str, list[dict[str, object]]], keep: int) -> list[str]:
    """py-spy lists innermost first; innermost last here: "function (file:line)"."""
    out = [f"{f.get('name')} ({f.get('filename')}:{f.get('line')})" for f in thread["frames"]]
    return [line[:300] for line in reversed(out[:keep])]


def read_errors(directory: str, started: float | None) -> list[RankError]:
    """The errors ranks left in this attempt (files written since it started), earliest first."""
    found = []
    try:
        names = [n for n in os.listdir(directory) if n.startswith("rank") and n.endswith(".json")]
    except OSError:
        return []
    for name in names:
        path = os.path.join(directory, name)
        try:
            if started is not None and os.stat(path).st_mtime < started - 1:
                continue  # an earlier attempt's
            data = json.loads(read_text(path, 1 << 18) or "")
            message = data["message"]
            ours = data.get("meshkit") or {}
            when = float(ours.get("time") or message["extraInfo"]["timestamp"])
            trace = str(message["extraInfo"].get("py_callstack") or "").splitlines()
            last = str(message["message"]).strip().splitlines() or ["?"]
            rank = int(ours.get("rank", name[4:-5]))
            node = None if ours.get("node_rank") is None else int(ours["node_rank"])
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            continue
        found.append(
            RankError(rank, node, when, last[-1][:500], [t[:300] for t in trace[-MAX_TRACE:]])
        )
    return sorted(found, key=lambda e: e.time)[:MAX_ERRORS]


def log_traceback(path: str) -> list[str]:
    """The log's last Python traceback, through its exception line (a rank killed before its
    hook could write, or a script run with ``python -I``)."""
    lines = jobs.tail(path, 65536)
    starts = [i for i, line in enumerate(lines) if line.startswith("Traceback (most recent")]
    if not starts:
        return []
    block = lines[starts[-1] :]
    end = next((i for i, line in enumerate(block[1:], 1) if line[:1] not in (" ", "\t")), None)
    return [t[:300] for t in block[: None if end is None else end + 1][-MAX_TRACE:]]
