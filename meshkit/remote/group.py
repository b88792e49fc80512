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
from typing import TypeVar

import paramiko

from ..hostfile import Host
from ..outcome import Outcome, PhaseEvent, ProgressFn, failed, succeeded
from .connection import Remote, Settings, ssh_config
from .describe import describe

T = TypeVar("T")


def fan_out(
    fn: Callable[[Host], T],
    hosts: Sequence[Host],
    settings: Settings,
    phase: str = "",
    progress: ProgressFn | None = None,
) -> dict[Host, Outcome[T]]:
    """``fn`` on every host at once (bounded pool); each host's result or its exception."""
    started = time.monotonic()
    lock = threading.Lock()
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
            event = PhaseEvent(
                phase, counts["done"], len(hosts), counts["failed"], elapsed, finished
            )
            progress(event)

    if not hosts:
        return {}
    pool = ThreadPoolExecutor(max_workers=max(1, min(settings.parallel, len(hosts))))
    futures = [pool.submit(one, host) for host in hosts]
    try:
        # Waiting in short slices keeps the main thread able to take Ctrl-C at once; the
        # callers' `with SshGroup` then closes every connection, which ends the blocked workers.
        while wait(futures, timeout=0.2).not_done:
            pass
    except BaseException:
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    pool.shutdown(wait=True)
    report(True)
    return {host: future.result() for host, future in zip(hosts, futures)}


class SshGroup:
    """The SSH connections to every reachable node (fabric's word: a group), and why the others
    failed; closes everything on exit."""

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
        self.hosts = list(hosts)
        self.settings = settings
        self.progress = progress
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
        failures = {**self.failures, **failed(opened)}
        self.failures = {
            host: error for host, error in failures.items() if host not in self.remotes
        }

    def wait_for(self, seconds: float, interval: float = 1.0) -> None:
        """Retry the nodes that failed to connect (rebooting, say) until they answer or the
        ``seconds`` run out."""
        deadline = time.monotonic() + seconds
        while self.failures and time.monotonic() < deadline:
            time.sleep(min(interval, max(0.0, deadline - time.monotonic())))
            self._open(list(self.failures), "reconnect")

    def reopen(self, host: Host) -> Remote:
        """Open ``host``'s connection again (a node that went down and came back), closing the
        old one; on failure the node is among ``failures`` with why, and the error is raised."""
        old = self.remotes.pop(host, None)
        if old is not None:
            with contextlib.suppress(Exception):
                old.close()
        try:
            remote = Remote(host, self.settings, self._config).open()
        except Exception as exc:
            self.failures[host] = describe(exc, host, self.settings)
            raise
        self.remotes[host] = remote
        self.failures.pop(host, None)
        return remote

    def each(
        self,
        phase: str,
        fn: Callable[[Remote], T],
        hosts: Sequence[Host] | None = None,
        quiet: bool = False,
    ) -> dict[Host, Outcome[T]]:
        """``fn`` over the open connection of every (or the given) reachable node, in parallel."""
        wanted = self.hosts if hosts is None else hosts
        chosen = [host for host in wanted if host in self.remotes]
        progress = None if quiet else self.progress

        def on_node(host: Host) -> T:
            return fn(self.remotes[host])

        return fan_out(on_node, chosen, self.settings, phase, progress)

    def close(self) -> None:
        for remote in self.remotes.values():
            with contextlib.suppress(Exception):
                remote.close()

    def __enter__(self) -> SshGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
