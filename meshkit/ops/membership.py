"""A supervised job's membership, pure: which node holds each rank, and how it changes when
nodes are lost for good (``train --replace-after``). A lost node's rank goes to the first healthy
spare, every other node keeps its rank (``replaced``); with too few spares and ``--min-nodes``,
the spares there are still take ranks and the nodes left are renumbered contiguously in hostfile
order (``shrunk``). Each change is a new
generation: a lost node that comes back finds its node in none of the newer ones' memberships,
ends what it still runs of the job, and is a spare from then on (fencing). The loop that makes
a change is ``ops.supervise``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from ..errors import JobError
from ..hostfile import Host
from ..job import Job
from ..protocol import RestartReason, Supervision


@dataclass(frozen=True)
class Change:
    """A new membership: ``members`` in rank order, why (``reason``: replaced, or shrunk when
    some lost node's rank went to no spare: ``dropped``), the spares that took ranks
    (``added``) and one "LOST -> SPARE" line per replacement."""

    members: list[Host]
    reason: RestartReason
    lost: list[Host]
    added: list[Host] = field(default_factory=list)
    replaced: list[str] = field(default_factory=list)
    dropped: list[Host] = field(default_factory=list)  # lost nodes no spare took the rank of
    evicted: dict[Host, str] = field(default_factory=dict)  # nodes put out (they answer): why


def members_of(
    record: Supervision | None, launched: Sequence[Host], cluster: Sequence[Host]
) -> list[Host]:
    """Each rank's node under ``record``: its membership, or (none written yet) the nodes the job
    was launched on. A member the hostfile no longer lists is a ``JobError``."""
    if record is None or not record.members:
        return list(launched)
    return resolve(record.members, [*cluster, *launched])


def resolve(labels: Sequence[str], known: Sequence[Host], where: str = "") -> list[Host]:
    """The nodes ``labels`` name (as the hostfile spells them), in that order; a label none of
    ``known`` has is a ``JobError`` (``where``: the hostfile, to name first)."""
    by_label = {host.label: host for host in known}
    missing = [label for label in labels if label not in by_label]
    if missing:
        head = f"{where}: " if where else ""
        raise JobError(
            f"{head}the job's nodes {', '.join(missing)} are not in the hostfile any more; put "
            "them back, or start the job anew with --cmd"
        )
    return [by_label[label] for label in labels]


def can_change(job: Job, members: Sequence[Host], cluster: Sequence[Host]) -> bool:
    """Pure: whether the job's membership can change: --replace-after is on, and the hostfile has
    nodes outside the membership (spares, lost nodes back) or --min-nodes lets it shrink. Only
    then can two sides of a partition each make a membership of their own, so only then does
    acting take a majority of the job's nodes (a job that cannot change acts as before: a
    relaunch needs every member, and a stop on any member holds it)."""
    if job.replace_after is None:
        return False
    return any(host not in members for host in cluster) or job.min_nodes is not None


def spares_of(
    cluster: Sequence[Host], members: Sequence[Host], evicted: Sequence[str] = ()
) -> list[Host]:
    """The nodes that may take a lost node's rank, in hostfile order: every node of the hostfile
    that is not a member (its spare lines, and lost nodes that came back), but those evicted
    from the job (``evicted``: the record's "NODE: why" lines), until readmitted."""
    out = evicted_labels(evicted)
    return [host for host in cluster if host not in members and host.label not in out]


def evicted_labels(evicted: Sequence[str]) -> set[str]:
    """The nodes the record's ``evicted`` lines ("NODE: why") name."""
    return {line.split(": ", 1)[0] for line in evicted}


def evict(
    members: Sequence[Host],
    out: dict[Host, str],
    spares: Sequence[Host],
    cluster: Sequence[Host],
    min_nodes: int | None,
) -> Change | None:
    """Pure: the membership with the nodes ``out`` (each with why) put out of the job: as if
    lost (``plan``), their ranks to ``spares`` or the job shrunk, but they answer, so the change
    ends their part and keeps them out (``evicted``) instead of counting them lost. None when
    neither a spare nor a shrink can take their ranks."""
    change = plan(members, list(out), spares, cluster, min_nodes)
    if change is None:
        return None
    reason = change.reason
    if reason == RestartReason.REPLACED:
        reason = RestartReason.EVICTED
    return replace(change, reason=reason, evicted=dict(out))


def plan(
    members: Sequence[Host],
    lost: Sequence[Host],
    spares: Sequence[Host],
    cluster: Sequence[Host],
    min_nodes: int | None,
) -> Change | None:
    """The membership after losing ``lost``: each lost rank, in rank order, to the next of
    ``spares`` (healthy ones, in order), every other node keeping its rank. With fewer spares
    than lost nodes, the spares still take ranks and the job shrinks by the rest: the nodes
    then renumbered in hostfile order, when at least ``min_nodes`` are left and the nodes that
    survived are a majority of ``members``. None when neither can be (wait, then give up)."""
    if not lost:
        return None
    taking = list(spares[: len(lost)])
    new_members = []
    replaced: list[str] = []
    dropped: list[Host] = []
    for host in members:
        if host not in lost:
            new_members.append(host)
        elif len(replaced) < len(taking):
            spare = taking[len(replaced)]
            new_members.append(spare)
            replaced.append(f"{host.label} -> {spare.label}")
        else:
            dropped.append(host)
    if not dropped:
        return Change(new_members, RestartReason.REPLACED, list(lost), taking, replaced)
    survivors = len(members) - len(lost)
    if min_nodes is None or len(new_members) < min_nodes or not new_members:
        return None
    if 2 * survivors <= len(members):
        # only a majority of the members may shrink the job: a partition's minority, seeing the
        # rest as lost, must not go on beside it, spares or not (a plain replacement needs no
        # such rule: its claim is written on the spare too, whose compare-and-set lets one of
        # two claims win)
        return None
    order = {host: index for index, host in enumerate(cluster)}
    new_members.sort(key=lambda host: order.get(host, len(order)))
    return Change(new_members, RestartReason.SHRUNK, list(lost), taking, replaced, dropped)


def reason_of_change(change: Change) -> str:
    """The record's ``last_restart_reason`` for a change."""
    lost = ", ".join(host.label for host in change.lost)
    if change.evicted:
        why = "; ".join(f"{host.label}: {text}" for host, text in change.evicted.items())
        if change.reason == RestartReason.EVICTED:
            return f"evicted: {'; '.join(change.replaced)} ({why})"
        ranks = len(change.members)
        return f"evicted and shrunk: {why}; running on {ranks} nodes"
    if change.reason == RestartReason.REPLACED:
        return f"replaced: {'; '.join(change.replaced)} ({lost} lost)"
    ranks = len(change.members)
    if not change.replaced:
        return f"shrunk: {lost} lost and no healthy spare; running on the {ranks} nodes left"
    dropped = ", ".join(host.label for host in change.dropped)
    spared = "; ".join(change.replaced)
    return (
        f"shrunk: {spared}; no healthy spare for {dropped} ({lost} lost); running on {ranks} nodes"
    )
