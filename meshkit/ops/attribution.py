"""Which node a failure is to blame on, pure (``blame``): the cause record every failure of a
supervised job gets (``events.Blame``), and whether it counts against its node (``attributed``),
which makes a node failing again and again a lemon (``lemon``: --evict-after).

A failure is the node's own, and counts against it, when:
1. the node is unhealthy at the time (its health says why); or
2. its ranks failed first, by their error files (the rank hook's), and no other node's rank
   failed with an error of its own: an error that names a lost peer (a closed connection, a
   collective's timeout, a signal from the launcher) is the consequence, not the cause. When the
   same error of its own comes from several nodes, it is the program's, not a node's; or
3. without error files (a program that is not Python, or ended by a signal): it is the only
   node that exited non-zero, or no other node exited with the same code after running about
   as long (within ``GAP`` seconds: the nodes start their parts a few seconds apart, so a
   command failing at once everywhere runs about as long everywhere).
Otherwise the failure is named (the first-failing rank and node as far as the nodes tell) but
counted against no node: a command that fails at once everywhere is a crash loop, not a lemon.
"""

from __future__ import annotations

import re
import signal
from collections.abc import Sequence
from dataclasses import dataclass

from ..events import Blame
from ..health import HealthState, NodeHealth
from ..protocol import JobState
from .diagnose import Failure
from .supervision_policy import NodeView

GAP = 2.0  # seconds: parts that ran this much longer or shorter did not fail alike
# What a rank says when a peer is gone: the consequence of another node's failure.
PEER_ERROR = re.compile(
    r"closed by peer|reset by peer|broken pipe|connection refused|timed? ?out|"
    r"DistNetworkError|DistBackendError|DistStoreError|connectFullMesh|"
    r"NCCL.*(abort|remote)|heartbeat|watchdog|SignalException|SIGTERM|terminated|"
    r"rendezvous|peer",
    re.IGNORECASE,
)


@dataclass(frozen=True)
class Ended:
    """A node's part that exited non-zero: its rank, node, code, when (None: not known) and
    how long it ran (None: not known)."""

    node_rank: int
    node: str
    code: int
    at: float | None
    ran: float | None


def ended_parts(nodes: Sequence[NodeView], ended: dict[int, float]) -> list[Ended]:
    """The nodes' parts that exited non-zero, earliest first (unknown times last, by rank)."""
    found = []
    for view in nodes:
        if view.state != JobState.EXITED or view.exit_code in (0, None):
            continue
        at = ended.get(view.rank)
        ran = None
        if at is not None and view.started is not None:
            ran = at - view.started
        found.append(Ended(view.rank, view.host, view.exit_code or 0, at, ran))
    found.sort(key=lambda part: (part.at is None, part.at or 0.0, part.node_rank))
    return found


def signal_of(code: int | None) -> str | None:
    """ "SIGKILL" for an exit code past 128 that is a signal's (the shell's convention)."""
    if code is None or not 128 < code < 128 + 65:
        return None
    try:
        return signal.Signals(code - 128).name
    except ValueError:
        return None


def own_errors(errors: Sequence[Failure]) -> list[Failure]:
    """Those of the ranks' errors that are their own, not a lost peer's consequence."""
    return [error for error in errors if not PEER_ERROR.search(error.error)]


def blame(
    nodes: Sequence[NodeView],
    ended: dict[int, float],
    health: dict[int, NodeHealth | None],
    errors: Sequence[Failure],
) -> Blame:
    """Pure: the failure of one poll's ``nodes`` (each node's ``ended`` time and ``health`` by
    rank; ``errors``: the ranks' error files, earliest first, as ``diagnose`` reads them) as a
    cause record, and whether its node is to blame (the module's rules)."""
    by_label = {view.host: view for view in nodes}
    for view in nodes:
        found = health.get(view.rank)
        if found is not None and found.state == HealthState.UNHEALTHY:
            return Blame(
                node=view.host,
                node_rank=view.rank,
                exit_code=view.exit_code,
                signal=signal_of(view.exit_code),
                health=reasons_of(health, view),
                attributed=True,
            )
    parts = ended_parts(nodes, ended)
    own = own_errors(errors)
    if own:
        first = own[0]
        first_view = by_label.get(first.node)
        others = {error.node for error in own if error.node != first.node}
        return Blame(
            node=first.node,
            node_rank=None if first_view is None else first_view.rank,
            rank=first.rank,
            exit_code=None if first_view is None else first_view.exit_code,
            signal=None if first_view is None else signal_of(first_view.exit_code),
            error=first.error,
            health=reasons_of(health, first_view),
            attributed=not others,
        )
    if not parts:
        return Blame()
    first_part = parts[0]
    failed_view = by_label.get(first_part.node)
    error = errors[0].error if errors else None
    return Blame(
        node=first_part.node,
        node_rank=first_part.node_rank,
        rank=errors[0].rank if errors else None,
        exit_code=first_part.code,
        signal=signal_of(first_part.code),
        error=error,
        health=reasons_of(health, failed_view),
        attributed=alone(first_part, parts[1:]),
    )


def alone(first: Ended, others: Sequence[Ended]) -> bool:
    """Whether ``first`` failed on its own: no other part failed alike, with the same code
    after running about as long (within ``GAP``; not known: alike)."""
    for other in others:
        known = first.ran is not None and other.ran is not None
        apart = known and abs((other.ran or 0.0) - (first.ran or 0.0)) >= GAP
        if other.code == first.code and not apart:
            return False
    return True


def reasons_of(health: dict[int, NodeHealth | None], view: NodeView | None) -> list[str]:
    """What the node's health readers found near the failure: every finding, the ones that
    leave it ok too (an out-of-memory kill, an XID that is the application's own)."""
    if view is None:
        return []
    found = health.get(view.rank)
    if found is None:
        return []
    return [f"{finding.source}: {finding.what}" for finding in found.findings]


def lemon(blamed: Sequence[str], node: str, evict_after: int) -> bool:
    """Pure: whether ``node``, with the failures ``blamed`` on the job's nodes so far (this
    one included), is a lemon: --evict-after of them (0: never)."""
    return evict_after > 0 and list(blamed).count(node) >= evict_after


def blame_words(found: Blame) -> str:
    """One line for the record and the events: "node 1 (n1), rank 2: exited with code 3:
    RuntimeError: ... [node's fault]"."""
    if found.node is None:
        return "no node to blame (the nodes did not say)"
    where = f"node {found.node_rank} ({found.node})"
    if found.rank is not None:
        where += f", rank {found.rank}"
    parts = [where]
    if found.signal:
        parts.append(f"killed by {found.signal}")
    elif found.exit_code is not None:
        parts.append(f"exited with code {found.exit_code}")
    if found.error:
        parts.append(found.error[:200])
    if found.health:
        parts.append("health: " + "; ".join(found.health)[:300])
    text = ": ".join(parts)
    if found.attributed:
        return f"{text} [counted against {found.node}]"
    return text
