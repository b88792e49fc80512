"""``train --notify CMD``: someone is told of the job's events. For each event of the kinds
chosen (``--notify-on``) the leading supervisor runs CMD under bash, the event's
``events --json`` object on its stdin. The caller never waits for it: events go into a bounded
queue that one worker thread empties, each command in its own process group, its stderr kept
bounded and the whole group killed at ``timeout``. A command that fails, hangs or cannot start
is reported through ``failed`` as a ``notify_failed`` event (never itself notified) and changes
nothing else."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import selectors
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Sequence

from ..events import Event, EventKind, new_id

QUEUE = 256  # events waiting at most; past it an event is dropped, and that is reported
TAIL = 4096  # bytes of the command's stderr kept (its last line is what a failure says)
CHUNK = 65536  # bytes written to the command's stdin at a time
SAID = 300  # characters of the stderr line a failure quotes
IDLE = 0.2  # seconds the worker waits for an event before it looks whether it is closed


class Notifier:
    """Runs ``cmd`` for each event told whose kind is in ``kinds``, at most ``timeout``
    seconds each, one at a time, in a worker thread; ``failed`` gets a ``notify_failed`` event
    saying why one failed (called from the worker thread)."""

    def __init__(
        self,
        cmd: str,
        kinds: Sequence[str],
        timeout: float,
        failed: Callable[[Event], None],
    ) -> None:
        self.cmd = cmd
        self.kinds = {str(kind) for kind in kinds}
        self.timeout = timeout
        self.failed = failed
        self._queue: queue.Queue[Event] = queue.Queue(QUEUE)
        self._closed = threading.Event()  # no more events are taken
        self._abandoned = threading.Event()  # close's wait is over: none more is run
        self._dropped = 0  # events the full queue could not take, reported by the worker
        self._lock = threading.Lock()
        self._process: subprocess.Popen[bytes] | None = None
        self._worker = threading.Thread(target=self._work, name="meshkit-notify", daemon=True)
        self._worker.start()

    def tell(self, event: Event) -> None:
        """Queue ``event`` for the command when its kind is one of ``kinds``; returns at once
        (a full queue drops it, and the worker reports how many were dropped)."""
        if event.kind == EventKind.NOTIFY_FAILED or str(event.kind) not in self.kinds:
            return
        if self._closed.is_set():
            return
        try:
            self._queue.put_nowait(event)
        except queue.Full:
            with self._lock:
                self._dropped += 1

    def close(self, wait: float) -> None:
        """Let the queued events run for at most ``wait`` seconds, then end: a command still
        running is killed (its group), events still queued are not run."""
        self._closed.set()
        self._worker.join(max(0.0, wait))
        if self._worker.is_alive():
            self._abandoned.set()  # what is still queued is not run
            with self._lock:
                process = self._process
            if process is not None:
                kill_group(process)
            self._worker.join(1.0)

    def _work(self) -> None:
        while True:
            try:
                event = self._queue.get(timeout=IDLE)
            except queue.Empty:
                if self._closed.is_set():
                    return
                continue
            if self._abandoned.is_set():
                return
            why = self.run(event)
            if why is not None:
                whose = event.node or "the job"
                self._report(event, f"--notify failed for the {event.kind} event of {whose}: {why}")
            with self._lock:
                dropped = self._dropped
                self._dropped = 0
            if dropped:
                what = f"{dropped} events were not notified"
                self._report(event, f"{what}: the --notify command is slower than they come")

    def _report(self, event: Event, text: str) -> None:
        failure = Event(
            id=new_id(),
            time=time.time(),
            kind=EventKind.NOTIFY_FAILED,
            text=text,
            launch=event.launch,
            generation=event.generation,
            attempt=event.attempt,
            by="notify",
        )
        # a report that fails (a node down, the caller's bug) must not end the notifications
        with contextlib.suppress(Exception):
            self.failed(failure)

    def run(self, event: Event) -> str | None:
        """Run the command once with ``event`` on its stdin: None when it exited 0, else why
        not (its exit code and the last line of its stderr, a timeout, a failed start)."""
        data = (json.dumps(event.as_json()) + "\n").encode()
        try:
            process = subprocess.Popen(
                ["bash", "-c", self.cmd],
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                start_new_session=True,  # its own process group: a timeout kills all of it
            )
        except OSError as exc:
            return f"could not start bash: {exc.strerror or exc}"
        with self._lock:
            self._process = process
        try:
            deadline = time.monotonic() + self.timeout
            tail = exchange(process, data, deadline)
            try:
                code = process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                kill_group(process)
                process.wait()
                return f"timed out after {self.timeout:g}s"
            if time.monotonic() >= deadline:  # it exited, what it left behind did not
                kill_group(process)
        finally:
            with self._lock:
                self._process = None
        if code == 0:
            return None
        return exited(code, last_line(tail))


def exchange(process: subprocess.Popen[bytes], data: bytes, deadline: float) -> bytes:
    """Write ``data`` to the command's stdin (then close it) while reading its stderr, until
    both are done or ``deadline``; the last ``TAIL`` bytes of stderr."""
    assert process.stdin is not None and process.stderr is not None
    stdin = process.stdin.fileno()
    stderr = process.stderr.fileno()
    os.set_blocking(stdin, False)
    tail = b""
    offset = 0
    with selectors.DefaultSelector() as selector:
        selector.register(stdin, selectors.EVENT_WRITE)
        selector.register(stderr, selectors.EVENT_READ)
        while selector.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                break
            for key, _ in selector.select(left):
                if key.fd == stdin:
                    try:
                        offset += os.write(stdin, data[offset : offset + CHUNK])
                    except BlockingIOError:
                        continue
                    except OSError:  # it closed its stdin unread: that is its business
                        offset = len(data)
                    if offset >= len(data):
                        selector.unregister(stdin)
                        process.stdin.close()
                    continue
                chunk = os.read(stderr, CHUNK)
                if not chunk:
                    selector.unregister(stderr)
                    continue
                tail = (tail + chunk)[-TAIL:]
    if not process.stdin.closed:
        process.stdin.close()
    process.stderr.close()
    return tail


def kill_group(process: subprocess.Popen[bytes]) -> None:
    """SIGKILL to the command's process group (it leads its own session)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)


def last_line(tail: bytes) -> str:
    """The last non-empty line of the command's stderr, for a message."""
    lines = [line.strip() for line in tail.decode(errors="replace").splitlines()]
    said = [line for line in lines if line]
    return said[-1][:SAID] if said else ""


def exited(code: int, line: str) -> str:
    """Why a command that exited ``code`` failed (a negative code: the signal that ended it)."""
    if code < 0:
        try:
            what = f"killed by {signal.Signals(-code).name}"
        except ValueError:
            what = f"killed by signal {-code}"
    else:
        what = f"exit {code}"
    return f"{what}: {line}" if line else what
