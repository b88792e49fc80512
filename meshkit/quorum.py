"""The rules every copy of a supervision record follows, pure: which write a node keeps
(``keeps``), which copy the readers believe (``believe``), and what a majority of a job's nodes
is (``majority``). The node keeps its copy (``node.supervise``); supervisors, ``status``, ``top``
and ``stop`` read the copies (``ops.supervision``); the simulation in ``tests/test_quorum_sim.py``
drives these very functions through partitions, losses and restarts.

Why a majority. A job's nodes are its hostfile's, spares included (``nodes``); a node that is lost
counts against. Two sides of a partition can each see the other as lost, and each could give the
lost ranks to spares or shrink, into the same workdir and checkpoints. A change of membership (a
new ``generation``) is therefore made only once a majority of the job's nodes keeps its claim, and
a node keeps one membership per generation (``keeps``): two majorities share a node, so two
claims of one generation cannot both win. Readers believe a generation only when a majority of the
nodes carries it (``believe``), so one copy ahead, damaged or sent by a bad node, moves nothing.

Why a launch. Each ``train`` is a launch with its own id (``new_launch``): the copies and the stops
of another launch are not this one's. A node keeps a write of a newer launch over any copy of an
older one (a stale stop left on a spare by an earlier job ends nothing), and refuses the writes of
an older launch (a supervisor left behind by a partition cannot move the new job); readers ignore
other launches' copies, and a supervisor that sees a newer launch ends.

Within a launch a stop lands on every node it reaches and nothing but a stop replaces it: a stop
beats every later step of its launch, a relaunch included, since a relaunch too needs a majority to
keep its claim, and two majorities share a node holding the stop.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass

from .protocol import Supervision, SupervisorState

LAUNCH_DIGITS = 16  # a launch id: its time in hex nanoseconds, zero-padded, then a random part


def majority(nodes: int) -> int:
    """How many of ``nodes`` are a majority: more than half."""
    return nodes // 2 + 1


def new_launch(previous: str = "", now_ns: int | None = None) -> str:
    """A launch id later than ``previous`` (the saved job's, "" for none): the time in
    nanoseconds, fixed-width hex so that ids sort as strings, past ``previous`` even should the
    clock have stepped back, and a random part so that two launches never share one."""
    stamp = time.time_ns() if now_ns is None else now_ns
    before = launch_time(previous)
    if before is not None and stamp <= before:
        stamp = before + 1
    return f"{stamp:0{LAUNCH_DIGITS}x}-{os.urandom(4).hex()}"


def launch_time(launch: str) -> int | None:
    """The time part of a launch id (None: "" or not one)."""
    head = launch[:LAUNCH_DIGITS]
    if len(head) != LAUNCH_DIGITS:
        return None
    try:
        return int(head, 16)
    except ValueError:
        return None


def newer_launch(launch: str, than: str) -> bool:
    """Whether ``launch`` is a later launch than ``than`` (ids sort as strings; "" is the
    oldest: the copies of a meshkit that had no launch ids)."""
    return launch > than


def stopped(record: Supervision) -> bool:
    return record.supervisor == SupervisorState.STOPPED


def well_formed(record: Supervision) -> bool:
    """Whether a copy can be a membership at all: no node twice in it."""
    return len(set(record.members)) == len(record.members)


def keeps(stored: Supervision | None, record: Supervision, version: int) -> bool:
    """Whether a node whose copy is ``stored`` (None: none, or unreadable) keeps ``record``,
    written by one who read ``version``:

    - a copy of an older launch is replaced by anything of a newer one, and never replaces it;
    - within a launch, a stop always lands, and nothing but a stop replaces one;
    - a newer generation replaces an older one; an older one never replaces a newer one;
    - within a generation, only its own membership (one membership per generation per node: two
      claims of one generation cannot both have a majority), by compare-and-set: over a copy no
      newer than the writer read.
    """
    if not well_formed(record):
        return False
    if stored is None:
        return True
    if record.launch != stored.launch:
        return newer_launch(record.launch, stored.launch)
    if stopped(record):
        return True
    if stopped(stored):
        return False
    if record.generation != stored.generation:
        return record.generation > stored.generation
    if record.members != stored.members:
        return False
    return stored.version <= version


@dataclass(frozen=True)
class Belief:
    """What the copies say of a launch. ``record``: the copy believed (None: no copy of this
    launch answered); ``settled``: it may be acted on (a stop; or a majority of the job's nodes
    answered and ``record`` is what a majority carries, or the membership the reader already
    follows); otherwise ``record`` is only shown. ``answered``: how many of the job's ``nodes``
    answered; ``newer``: some node holds a copy of a later launch; ``unproven``: the
    generations past the one believed that some node claims and no majority carries."""

    record: Supervision | None
    settled: bool
    answered: int
    nodes: int
    newer: bool = False
    unproven: tuple[int, ...] = ()

    @property
    def quorum(self) -> bool:
        """Whether a majority of the job's nodes answered."""
        return self.answered >= majority(self.nodes)


Membership = tuple[int, tuple[str, ...]]  # a generation and its members, as a copy names them


def membership(record: Supervision) -> Membership:
    return (record.generation, tuple(record.members))


def believe(
    copies: Sequence[Supervision | None], nodes: int, launch: str, known: Membership
) -> Belief:
    """Pure: the copy believed of ``copies`` (one per node that answered; None: it has none, as a
    rebooted node or a spare never written), of the job's ``nodes`` (its hostfile's, spares
    included), by a reader of ``launch`` that follows the membership ``known``.

    - A stop of this launch wins from any one copy.
    - Else the newest generation whose membership a majority of the job's nodes carries: only
      so is a new membership ever adopted (one copy ahead, a bad node's, moves nothing).
    - Else the membership the reader already follows, when some node answered with it: a node
      that rebooted lost its copy (it lives in /tmp), which is no vote for anything else.
    Of the membership believed, the newest version. A copy of another launch, or with a node
    twice in its membership, counts for nothing. ``settled`` once a majority answered."""
    present = [copy for copy in copies if copy is not None]
    newer = any(newer_launch(copy.launch, launch) for copy in present)
    mine = [copy for copy in present if copy.launch == launch and well_formed(copy)]
    answered = len(copies)
    quorum = answered >= majority(nodes)
    stops = [copy for copy in mine if stopped(copy)]
    if stops:
        return Belief(max(stops, key=version_of), True, answered, nodes, newer)
    groups: dict[Membership, list[Supervision]] = {}
    for copy in mine:
        groups.setdefault(membership(copy), []).append(copy)
    carried = [key for key, group in groups.items() if len(group) >= majority(nodes)]
    if carried:
        best = max(carried)
    elif known in groups:
        best = known
    else:
        best = None
    if best is None:
        # nothing believable: with no copy of this launch at all, a majority saying so is a
        # fact (the copies were dropped); else the newest copy before the reader's generation,
        # shown, not acted on (a claim of that generation no majority took is no history)
        fallback = [copy for copy in mine if copy.generation < known[0]]
        shown = max(fallback, key=precedence, default=None)
        unproven = sorted({key[0] for key in groups if key[0] > known[0]})
        return Belief(shown, quorum and not mine, answered, nodes, newer, tuple(unproven))
    record = max(groups[best], key=version_of)
    unproven = sorted({key[0] for key in groups if key[0] > best[0]})
    return Belief(record, quorum, answered, nodes, newer, tuple(unproven))


def past_unproven(belief: Belief) -> int:
    """The generation a claim must go past (0: its own next one will do): the highest some
    node claims and no majority carries. Such a copy (a claim a partition's smaller side made,
    a damaged copy) holds its node to that generation's membership, so a claim of that
    generation or below would be refused there; one past it is kept."""
    return max(belief.unproven, default=0)


def version_of(record: Supervision) -> int:
    return record.version


def precedence(record: Supervision) -> tuple[int, int]:
    """Of copies the reader cannot settle between, the one shown: the newer generation, then
    the newer version."""
    return (record.generation, record.version)
