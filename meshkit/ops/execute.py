"""``meshkit exec`` and ``Cluster.exec``: one command on every node of the hostfile at once, each
with its node's ``meshkit env`` variables, over the one agent per node (op ``exec``); a result
per node. Also, pure: which ranks ``--node`` names, and the output grouped as ``clush -b``
groups it (identical outputs under one header naming their nodes)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..errors import UsageError
from ..hostfile import Host
from ..job import Job
from ..outcome import ProgressFn
from ..protocol import ExecReply, ExecRequest
from ..settings import Config, whole
from .lookup import Options, new_job
from .pool import NodePool, connect, unanswered

TIMEOUT_LIMIT_S = 86400.0
# What the controller adds to a node's --timeout before it gives up on the agent's answer: the
# node ends the command at its timeout and then answers at once.
ANSWER_GRACE_S = 15.0


@dataclass(frozen=True)
class NodeResult:
    """One node's run: its exit code (None when it has none: ``error`` says why: the node did
    not answer, the command timed out), and its output (head and tail, ``stdout_cut`` and
    ``stderr_cut`` bytes left out between them, said by a line in the text)."""

    node: str  # as the hostfile spells it
    rank: int
    exit_code: int | None
    stdout: str
    stderr: str
    error: str | None = None
    stdout_cut: int = 0
    stderr_cut: int = 0

    @property
    def cut(self) -> int:
        """Bytes left out of both streams."""
        return self.stdout_cut + self.stderr_cut

    @property
    def ok(self) -> bool:
        return self.error is None and self.exit_code == 0

    @property
    def why(self) -> str | None:
        """Why this node failed, in words (None: it did not)."""
        if self.error is not None:
            return self.error
        if self.exit_code != 0:
            return f"exit code {self.exit_code}"
        return None


@dataclass(frozen=True)
class OutputGroup:
    """Nodes whose standard output was the same, and that output."""

    results: list[NodeResult]
    stdout: str

    @property
    def nodes(self) -> str:
        """The nodes folded as clush and pdsh write them: ``node[0-3,5]``."""
        return fold([result.node for result in self.results])


def parse_ranks(text: str | None, count: int) -> list[int]:
    """``--node``: ``2``, ``0-3,5`` -> those ranks of ``count`` nodes, in order; None: all."""
    if text is None:
        return list(range(count))
    chosen: set[int] = set()
    for word in str(text).split(","):
        first, dash, last = word.strip().partition("-")
        if not whole(first) or (dash and not whole(last)):
            raise UsageError(f"--node {str(text)[:40]!r}: expected ranks such as 2 or 0-3,5")
        low = int(first)
        high = int(last) if dash else low
        if not 0 <= low <= high < count:
            raise UsageError(f"--node {str(text)[:40]!r}: the hostfile has ranks 0..{count - 1}")
        chosen.update(range(low, high + 1))
    return sorted(chosen)


def check_timeout(timeout: str | float) -> float:
    """``--timeout`` in seconds (the CLI's flag arrives as text)."""
    problem = UsageError(
        f"--timeout {str(timeout)[:40]!r}: expected seconds above 0, at most 86400"
    )
    try:
        seconds = float(timeout)
    except ValueError:
        raise problem from None
    if not 0 < seconds <= TIMEOUT_LIMIT_S:  # NaN too
        raise problem
    return seconds


def plan(
    conf: Config,
    cmd: str,
    hostfile: str | None,
    session: str | None,
    include: str | None,
    exclude: str | None,
) -> tuple[Job, list[Host]]:
    """The nodes and the variables' inputs, as ``train`` would read them from these flags over
    the configuration (the same port and master: ``meshkit env`` agrees)."""
    flags = Options(cmd=cmd, hostfile=hostfile, session=session, include=include, exclude=exclude)
    return new_job(conf, flags)


def request_for(job: Job, hosts: Sequence[Host], rank: int, timeout: float) -> ExecRequest:
    nproc_per_node = job.nproc_per_node or hosts[0].slots
    return ExecRequest(
        cmd=job.cmd,
        node_rank=rank,
        nnodes=len(hosts),
        master_addr=hosts[0].host,
        master_port=job.master_port,
        session=job.session,
        timeout=timeout,
        nproc_per_node=nproc_per_node,
    )


def run(
    pool: NodePool, job: Job, hosts: Sequence[Host], ranks: Sequence[int], timeout: float
) -> list[NodeResult]:
    """The command on the nodes of ``ranks`` at once; a result per node, in rank order (a node
    that did not answer has its reason)."""
    rank_of = {host: rank for rank, host in enumerate(hosts)}
    chosen = [hosts[rank] for rank in ranks]

    def request(host: Host) -> ExecRequest:
        return request_for(job, hosts, rank_of[host], timeout)

    outcomes = pool.call_all("exec", request, ExecReply, chosen, timeout + ANSWER_GRACE_S)
    results = []
    for host in chosen:
        rank = rank_of[host]
        outcome = outcomes.get(host)
        if outcome is None or outcome.value is None:
            why = unanswered(outcome, host, pool.failures)
            results.append(NodeResult(host.label, rank, None, "", "", why))
            continue
        reply = outcome.value
        results.append(
            NodeResult(
                host.label,
                rank,
                reply.exit_code,
                reply.stdout,
                reply.stderr,
                reply.error,
                reply.stdout_cut,
                reply.stderr_cut,
            )
        )
    return results


def execute(
    conf: Config,
    cmd: str,
    *,
    hostfile: str | None = None,
    session: str | None = None,
    include: str | None = None,
    exclude: str | None = None,
    nodes: str | None = None,
    timeout: str | float | None = None,
    progress: ProgressFn | None = None,
) -> list[NodeResult]:
    """``meshkit exec``: the flags checked, then one connection and agent per chosen node."""
    if timeout is None:
        timeout = conf.command_timeout
    seconds = check_timeout(timeout)
    job, hosts = plan(conf, cmd, hostfile, session, include, exclude)
    ranks = parse_ranks(nodes, len(hosts))
    chosen = [hosts[rank] for rank in ranks]
    with connect(conf, job.hostfile, chosen, job.python, progress) as pool:
        return run(pool, job, hosts, ranks, seconds)


def gather(results: Sequence[NodeResult]) -> list[OutputGroup]:
    """The nodes that printed something, grouped by identical standard output (``clush -b``),
    in the order of each group's first rank."""
    groups: dict[str, list[NodeResult]] = {}
    for result in results:
        if result.stdout:
            groups.setdefault(result.stdout, []).append(result)
    return [OutputGroup(members, stdout) for stdout, members in groups.items()]


def fold(names: Sequence[str]) -> str:
    """``node0,node1,node2,node5`` -> ``node[0-2,5]``, as python-hostlist folds them; names it
    cannot fold are listed as they are."""
    import hostlist

    try:
        folded: str = hostlist.collect_hostlist(list(names))
    except (hostlist.BadHostlist, ValueError):
        return ",".join(names)
    return folded
