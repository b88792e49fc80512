"""A supervised job's claimed attempt, made (``finish``): what a restart, a replacement and a
takeover share once the attempt is claimed in the record. Stop the job everywhere, hold while the
health gate (the doctor's quick checks) fails, renew the claim right before the launch (a
supervisor that hung while another took the attempt over finds a newer copy then and launches
nothing), launch, write RUNNING, and start a supervisor wherever none is live. Also what it takes
from the supervisor's loop (``Loop``), which ``ops.replacement`` takes too.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Protocol

from ..errors import LaunchError, RemoteError
from ..events import Blame, EventKind
from ..hostfile import Host
from ..job import Job
from ..protocol import Supervision, SupervisorState
from ..record import replace
from . import jobs as ops
from .pool import NodePool
from .supervision import start_all, write
from .supervision_policy import Final, Outcome, Then, held_by
from .verdicts import Check

COME_BACK = 300.0  # seconds a relaunch waits for every node to answer, then for its checks

Connect = Callable[[Sequence[Host], float], AbstractContextManager[NodePool]]
Gate = Callable[[NodePool, Job, Sequence[Host]], list[Check]]  # the failed checks
Launcher = Callable[[NodePool, Job, int], ops.Launch]


def health(pool: NodePool, job: Job, hosts: Sequence[Host]) -> list[Check]:
    """The health gate: the doctor's quick checks on every node, the failed ones."""
    from .doctor import quick

    return quick(pool, job, hosts).failures


class Loop(Protocol):
    """What a relaunch and a replacement take from the supervisor's loop: its connections, its
    job and membership (this node's rank ``me``), its health gate and launcher, and its steps."""

    @property
    def connect(self) -> Connect: ...
    @property
    def job(self) -> Job: ...
    @property
    def hosts(self) -> Sequence[Host]: ...
    @property
    def me(self) -> int: ...
    @property
    def cluster(self) -> Sequence[Host]: ...
    @property
    def node(self) -> Host: ...
    @property
    def gate(self) -> Gate: ...
    @property
    def relaunch(self) -> Launcher | None: ...
    @property
    def interval(self) -> float: ...
    @property
    def quorum(self) -> Sequence[Host]:
        """The nodes a write must have a majority of (none: the membership cannot change,
        ``membership.can_change``)."""

    @property
    def above(self) -> int:
        """The highest generation some node claims and no majority carries (0: none): a claim
        goes past it, since a node keeps one membership per generation."""

    def say(self, message: str) -> None: ...

    def nodes(self) -> list[Host]:
        """Every node of the job: the members in rank order, then the rest of the hostfile."""

    def tell(
        self,
        kind: EventKind,
        text: str,
        node: str | None = None,
        rank: int | None = None,
        blame: Blame | None = None,
        attempt: int | None = None,
    ) -> None:
        """Record an event of the job (every node's history, and --notify); ``attempt``: the
        attempt it belongs to (None: the record's, as last seen)."""

    def moved(self) -> None:
        """The loop took a step (its heartbeat goes on)."""

    def follow(self, record: Supervision) -> bool:
        """Take ``record``'s membership as the loop's."""

    def gave_up(self, pool: NodePool, record: Supervision, why: str) -> Final:
        """Write GAVE UP, saying ``why``."""


def finish(loop: Loop, pool: NodePool, claimed: Supervision, checked: bool = False) -> Outcome:
    """Make the claimed attempt: stop the job everywhere, hold while the health gate fails
    (``checked``: it passed on every node just before the claim), launch, then a supervisor
    on every node again."""
    job = loop.job
    hosts = loop.hosts
    say = loop.say
    attempt = claimed.attempt
    last = attempt + claimed.restarts_left
    say(f"attempt {attempt}: relaunching (of {last}); stopping the job")
    ops.stop(pool, job, hosts)
    deadline = time.monotonic() + COME_BACK
    while not checked:
        failed = loop.gate(pool, job, hosts)
        if not failed:
            break
        held = held_by(failed[0])
        if time.monotonic() > deadline:
            why = f"the relaunch was held for {COME_BACK:.0f}s by {held}"
            return loop.gave_up(pool, claimed, why)
        if claimed.held != held:
            say(f"attempt {attempt}: held by {held}")
            renewed = write(
                pool, job, hosts, replace(claimed, held=held), loop.me, False, loop.quorum
            )
            if renewed is None:
                return Then.WATCH
            claimed = renewed
        loop.moved()
        time.sleep(loop.interval)
    # The claim renewed right before the launch: a supervisor that hung while another
    # took this attempt over finds a newer copy here and launches nothing.
    renewed = write(pool, job, hosts, replace(claimed, held=None), loop.me, False, loop.quorum)
    if renewed is None:
        say(f"attempt {attempt}: another supervisor took it over; following it")
        return Then.WATCH
    claimed = renewed
    failure = launch(loop, pool, claimed)
    if failure is not None:  # a failed attempt: the next poll sees the nodes absent
        say(f"attempt {attempt} did not start: {failure}")
    running = replace(claimed, supervisor=SupervisorState.RUNNING, held=None)
    if write(pool, job, hosts, running, loop.me, False, loop.quorum) is None:
        return Then.WATCH
    say(f"attempt {attempt} started")
    loop.tell(EventKind.ATTEMPT, f"attempt {attempt} started ({claimed.reason})", attempt=attempt)
    start_all(pool, job, hosts)  # where none is live: a rebooted node's comes back
    return Then.WATCH


def launch(loop: Loop, pool: NodePool, claimed: Supervision) -> str | None:
    """Launch the claimed attempt on every node; why it did not start (None: it did)."""
    attempt = claimed.attempt
    try:
        if loop.relaunch is not None:
            launched = loop.relaunch(pool, loop.job, attempt)
        else:
            launched = ops.launch(
                pool,
                loop.job,
                loop.hosts,
                attempt=attempt,
                reason=str(claimed.reason),
                replacement="; ".join(claimed.replaced),
                last=attempt + claimed.restarts_left,
            )
    except (LaunchError, RemoteError) as exc:
        return str(exc).replace("\n", "; ")
    if launched.ok:
        return None
    errors = [f"node {row.node_rank}: {row.error}" for row in launched.rows if row.error]
    return "; ".join(errors)
