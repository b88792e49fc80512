"""Asking nodes for their health (``meshkit.health``; the node's readers are
``node/health.py``): the one request a job's node is asked with, by ``status``, ``top``, the
doctor and the supervisor alike."""

from __future__ import annotations

from collections.abc import Sequence

from .. import protocol as p
from ..health import NodeHealth
from ..hostfile import Host
from ..job import Job
from .pool import NodePool


def health_request(job: Job, host: Host) -> p.HealthRequest:
    """Read ``host``'s health for ``job``: its workdir's free space, its id (the node's
    baseline and its out-of-memory kills), the GPUs the host must have (its hostfile
    ``slots``; None: no expectation beyond what the node first saw) and the job's limits."""
    return p.HealthRequest(job.workdir, job.id, host.slots, job.health)


def health_round(pool: NodePool, job: Job, hosts: Sequence[Host]) -> dict[Host, NodeHealth | None]:
    """Every node's health (None: it could not be asked: the preflight says why)."""
    replies = pool.call_all("health", lambda host: health_request(job, host), p.HealthReply, hosts)
    found: dict[Host, NodeHealth | None] = {}
    for host in hosts:
        outcome = replies.get(host)
        found[host] = None if outcome is None or outcome.value is None else outcome.value.health
    return found
