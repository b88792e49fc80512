"""A supervisor's events (``meshkit.events``): each one kept until it is written on the job's
nodes (``flush``, at the supervisor's next look: no connection of its own) and handed to
``train --notify``'s command (``ops.notify``) as it happens. What is not written yet stays, at
most ``PENDING`` events, for the next look."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ..events import Blame, Event, EventKind
from ..hostfile import Host
from ..job import Job
from .events import new_event, tell
from .notify import Notifier
from .pool import NodePool

PENDING = 1000  # events kept while no node takes them (the oldest go first)


class History:
    """The events a supervisor records for ``job``; ``attempt`` is the record's, as last seen."""

    def __init__(self, job: Job, say: Callable[[str], None]) -> None:
        self.pending: list[Event] = []
        self.attempt = 1
        self.say = say
        self.notifier: Notifier | None = None
        if job.notify:
            self.notifier = Notifier(job.notify, job.notify_on, job.notify_timeout, self.failed)

    def add(
        self,
        job: Job,
        kind: EventKind,
        text: str,
        node: str | None,
        rank: int | None,
        blame: Blame | None,
        by: str,
        attempt: int | None = None,
    ) -> None:
        """An event happened: kept for the nodes, told to --notify (``attempt``: its own, else
        the record's as last seen)."""
        number = self.attempt if attempt is None else attempt
        event = new_event(job, kind, text, node=node, rank=rank, attempt=number, blame=blame, by=by)
        self.keep(event)
        if self.notifier is not None:
            self.notifier.tell(event)

    def failed(self, event: Event) -> None:
        """--notify's command failed for an event: itself an event (never notified)."""
        self.say(event.text)
        self.keep(event)

    def keep(self, event: Event) -> None:
        self.pending.append(event)
        del self.pending[:-PENDING]

    def flush(self, pool: NodePool, job: Job, hosts: Sequence[Host]) -> None:
        """Write what is pending on ``hosts`` (the nodes that answer); kept should none take it."""
        if not self.pending or not hosts:
            return
        events = list(self.pending)
        kept = tell(pool, job, hosts, events)
        if kept:
            self.pending = [event for event in self.pending if event not in events]

    def close(self) -> None:
        """The supervision ends: --notify's last events get their time."""
        if self.notifier is not None:
            self.notifier.close(wait=self.notifier.timeout + 5.0)
