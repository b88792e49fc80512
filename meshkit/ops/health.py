"""Asking nodes for their health (``meshkit.health``; the node's readers are
``node/health.py``): the one request a job's node is asked with, by ``status``, ``top``, the
doctor and the supervisor alike."""

from __future__ import annotations

from .. import protocol as p
from ..hostfile import Host
from ..job import Job


def health_request(job: Job, host: Host) -> p.HealthRequest:
    """Read ``host``'s health for ``job``: its workdir's free space, its id (the node's
    baseline and its out-of-memory kills), the GPUs the host must have (its hostfile
    ``slots``; None: no expectation beyond what the node first saw) and the job's limits."""
    return p.HealthRequest(job.workdir, job.id, host.slots, job.health)
