"""Every node at once: connections opened in parallel and reused by every phase, and a result per
host that keeps its exception (a surprise on one node never hides what happened on the others).

Progress goes to a callback (``ProgressFn``) that the CLI renders; nothing here prints.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Generic, TypeVar

import paramiko

from ..hostfile import Host
from .connection import Remote, Settings, ssh_config
from .describe import describe

K = TypeVar("K")
T = TypeVar("T")


@dataclass(frozen=True)
class Outcome(Generic[T]):
    """One host's result: its value, or the exception it raised with that exception described."""

    value: T | None = None
    exc: BaseException | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


def succeeded(results: dict[K, Outcome[T]]) -> dict[K, T]:
    """The items whose call returned, with their values."""
    return {k: o.value for k, o in results.items() if o.error is None}  # type: ignore[misc]


def failed(results: dict[K, Outcome[T]]) -> dict[K, str]:
    """The items whose call failed, with the readable reason."""
    return {k: o.error for k, o in results.items() if o.error is not None}


@dataclass(frozen=True)
class PhaseEvent:
    """A phase's progress: sent after each item, and once more with ``finished`` at the end."""

    phase: str
    done: int
    total: int
    failed: int
    elapsed: float
    finished: bool


ProgressFn = Callable[[PhaseEvent], None]


def fan_out(
    fn: Callable[[Host], T],
    hosts: Sequence[Host],
    settings: Settings,
    phase: str = "",
    progress: ProgressFn | None = None,
) -> dict[Host, Outcome[T]]:
    """``fn`` on every host at once (bounded pool); each host's result or its exception."""
    started, lock = time.monotonic(), threading.Lock()
    counts = {"done": 0, "failed": 0}

    def one(host: Host) -> Outcome[T]:
        outcome: Outcome[T]
        try:
            outcome = Outcome(fn(host))
        except Exception as exc:
            outcome = Outcome(exc=exc, error=describe(exc, host, settings))
        with lock:
            counts["done"] += 1
            counts["failed"] += not outcome.ok
            report(False)
        return outcome

    def report(finished: bool) -> None:
        if progress and phase:
            elapsed = time.monotonic() - started
            done, failed = counts["done"], counts["failed"]
            progress(PhaseEvent(phase, done, len(hosts), failed, elapsed, finished))

    if not hosts:
        return {}
    pool = ThreadPoolExecutor(max_workers=max(1, min(settings.parallel, len(hosts))))
    futures = [pool.submit(one, host) for host in hosts]
    try:
        # Waiting in short slices keeps the main thread able to take Ctrl-C at once; the
        # callers' `with Cluster` then closes every connection, which ends the blocked workers.
        while wait(futures, timeout=0.2).not_done:
            pass
    except BaseException:
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    pool.shutdown(wait=True)
    report(True)
    return {host: future.result() for host, future in zip(hosts, futures)}


class Cluster:
    """Connections to the reachable nodes, and why the others failed; closes everything on exit."""

    def __init__(
        self,
        hosts: Sequence[Host],
        settings: Settings,
        progress: ProgressFn | None = None,
        on_open: Callable[[Remote], None] | None = None,
    ) -> None:
        """``on_open`` runs in the connecting worker right after each node's connection opens
        (before the phase ends: what it starts overlaps the other nodes' connects); it must not
        raise, so a failure of what it starts is its own to keep."""
        self.hosts, self.settings, self.progress = list(hosts), settings, progress
        self.on_open = on_open
        self._config: paramiko.SSHConfig = ssh_config(settings.ssh_configs)
        self.remotes: dict[Host, Remote] = {}
        self.failures: dict[Host, str] = {}
        self._open(self.hosts, "connect")

    def _open(self, hosts: Sequence[Host], phase: str) -> None:
        def connect(host: Host) -> Remote:
            remote = Remote(host, self.settings, self._config).open()
            if self.on_open is not None:
                self.on_open(remote)
            return remote

        opened = fan_out(connect, hosts, self.settings, phase, self.progress)
        self.remotes.update(succeeded(opened))
        self.failures = {
            h: e for h, e in {**self.failures, **failed(opened)}.items() if h not in self.remotes
        }

    def wait_for(self, seconds: float, interval: float = 1.0) -> None:
        """Retry the nodes that failed to connect (rebooting, say) until they answer or time runs out."""
        deadline = time.monotonic() + seconds
        while self.failures and time.monotonic() < deadline:
            time.sleep(min(interval, max(0.0, deadline - time.monotonic())))
            self._open(list(self.failures), "reconnect")

    def each(
        self,
        phase: str,
        fn: Callable[[Remote], T],
        hosts: Sequence[Host] | None = None,
        quiet: bool = False,
    ) -> dict[Host, Outcome[T]]:
        """``fn`` over the open connection of every (or the given) reachable node, in parallel."""
        chosen = [h for h in (hosts if hosts is not None else self.hosts) if h in self.remotes]
        progress = None if quiet else self.progress
        return fan_out(lambda h: fn(self.remotes[h]), chosen, self.settings, phase, progress)

    def close(self) -> None:
        for remote in self.remotes.values():
            with contextlib.suppress(Exception):
                remote.close()

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
