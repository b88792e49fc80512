"""A job's history on this node (``meshkit.events``). (Foundation stub: the store lands with
issue 44's events part.)"""

from __future__ import annotations

from ..protocol import EventsReply, EventsRequest


def events(request: EventsRequest) -> EventsReply:
    """The ``events`` op: add ``request.add``, then return the events since ``request.since``."""
    return EventsReply([])
