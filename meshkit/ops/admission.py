"""Which nodes a launch admits (``train``'s preflight): the job's nodes, but not an unhealthy one
(its health read first, ``health_round``) nor one evicted from the job before (the record
copies' ``evicted``, until ``train --readmit NODE``). A supervised job with --restarts gives such
a node's rank to a healthy spare from the start (``admit``); otherwise nothing starts, and the
message names the node, why, and the fix.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from ..errors import LaunchError, UsageError
from ..health import HealthState, NodeHealth
from ..hostfile import Host
from ..job import Job
from .membership import evicted_labels
from .pool import NodePool
from .supervision import ask


@dataclass(frozen=True)
class Admitted:
    """The membership a launch starts (``hosts``, rank order), the nodes kept out of the job
    (``evicted``: "NODE: why", the first record's), and each "NODE -> SPARE" swap made now."""

    hosts: list[Host]
    evicted: list[str] = field(default_factory=list)
    swapped: list[str] = field(default_factory=list)
    readmitted: str | None = None


def evicted_before(pool: NodePool, job: Job, hosts: Sequence[Host]) -> list[str]:
    """The nodes evicted from this job, as the copies of its latest launch say (an older
    launch's copy left on a node the latest did not reach may name a node readmitted since)."""
    records = [reply.record for reply in ask(pool, job, hosts).values() if reply.record]
    latest = max((record.launch for record in records), default="")
    lines: list[str] = []
    for record in records:
        if record.launch != latest:
            continue
        for line in record.evicted:
            if line not in lines:
                lines.append(line)
    return lines


def admit(
    job: Job,
    hosts: Sequence[Host],
    spares: Sequence[Host],
    health: dict[Host, NodeHealth | None],
    evicted: Sequence[str],
    readmit: str | None = None,
) -> Admitted:
    """Pure: the launch's membership. ``hosts`` in rank order less the unhealthy and the
    evicted (``readmit``: let that one back), each rank to the next healthy spare that is not
    evicted when the job is supervised with --restarts; otherwise a ``LaunchError`` naming
    each node, why, and the fix."""
    kept = list(evicted)
    if readmit is not None:
        if readmit not in evicted_labels(kept):
            named = ", ".join(sorted(evicted_labels(kept))) or "none"
            raise UsageError(f"--readmit {readmit}: not evicted from this job (evicted: {named})")
        kept = [line for line in kept if line.split(": ", 1)[0] != readmit]
    out = evicted_labels(kept)
    unfit: dict[Host, str] = {}
    for host in hosts:
        reading = health.get(host)
        if host.label in out:
            unfit[host] = "evicted from this job before (train --readmit NODE lets it back)"
        elif reading is not None and reading.state == HealthState.UNHEALTHY:
            unfit[host] = f"unhealthy: {'; '.join(reading.reasons)}"
    if not unfit:
        return Admitted(list(hosts), kept, readmitted=readmit)
    usable = [
        spare
        for spare in spares
        if spare.label not in out and fit(health.get(spare)) and spare not in hosts
    ]
    if not job.restarts or len(usable) < len(unfit):
        raise LaunchError(refusal(job, hosts, unfit, usable))
    members = []
    swapped = []
    for host in hosts:
        if host in unfit:
            spare = usable.pop(0)
            members.append(spare)
            swapped.append(f"{host.label} -> {spare.label}")
            if host.label not in out:
                kept.append(f"{host.label}: {unfit[host]}")
        else:
            members.append(host)
    return Admitted(members, kept, swapped, readmit)


def fit(reading: NodeHealth | None) -> bool:
    """A spare that may take a rank at launch: it answered, and is not unhealthy."""
    return reading is not None and reading.state != HealthState.UNHEALTHY


def refusal(
    job: Job, hosts: Sequence[Host], unfit: dict[Host, str], usable: Sequence[Host]
) -> list[str]:
    """Why nothing starts: each unfit node with why, then the fix."""
    lines = [f"node {hosts.index(host)} ({host.label}): {why}" for host, why in unfit.items()]
    if not job.restarts:
        fix = "a spare takes such a node's rank only under supervision (--restarts N and a "
        fix += "hostfile line marked spare)"
    else:
        fix = f"{len(usable)} healthy spare(s) for {len(unfit)} node(s): add spare lines"
    labels = ",".join(host.label for host in unfit)
    lines.append(f"train: nothing started; mend the node, or --exclude {labels}, or: {fix}")
    return lines
