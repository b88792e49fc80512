"""The goodput benchmark's pure parts (issue 45): the seeded campaign of faults, how an event is
judged against the fault injected, the steps a fault lost, ETTR and the tables. Builds no
sandbox and runs nothing; ``goodput.py`` runs the campaign and ``tests/test_bench.py`` checks
these.
"""

from __future__ import annotations

import random
import re
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from meshkit.events import Event, EventKind

CRASH = "crash"  # kill -9 of a rank process on one node
POWEROFF = "poweroff"  # the node powered off (sandbox.poweroff)
XID = "xid"  # an XID 79 in the node's kernel log (sandbox.fault)
HANG = "hang"  # a rank process stopped (SIGSTOP)
SLOW = "slow"  # the node capped to a third of a CPU (sandbox.slow)
LEMON = "lemon"  # the node's rank killed at two attempts in a row
KINDS = (CRASH, POWEROFF, XID, HANG, SLOW, LEMON)

# The event that names each fault right: its kind (and the node, checked apart).
EXPECTED: dict[str, tuple[EventKind, ...]] = {
    CRASH: (EventKind.FAILED,),
    POWEROFF: (EventKind.LOST,),
    XID: (EventKind.HEALTH, EventKind.EVICTED),
    HANG: (EventKind.STALLED,),
    SLOW: (EventKind.STRAGGLER,),
    LEMON: (EventKind.EVICTED,),
}
# Any of these after a fault is the job noticing something, named right or not.
ALARMS = (
    EventKind.FAILED,
    EventKind.STALLED,
    EventKind.HEALTH,
    EventKind.LOST,
    EventKind.EVICTED,
    EventKind.STRAGGLER,
)
# In a fault-free run, each of these is a false alarm.
FALSE_ALARMS = (
    EventKind.FAILED,
    EventKind.STALLED,
    EventKind.LOST,
    EventKind.EVICTED,
    EventKind.STRAGGLER,
    EventKind.RESTARTED,
)

RESUMED = re.compile(r"resumed from step (\d+) ")  # the example's rank 0, at each start
FRESH = re.compile(r"no checkpoint at \S+: starting at step 0")


@dataclass(frozen=True)
class Fault:
    """One fault of the campaign: what and on which node (its index in the sandbox)."""

    kind: str
    node: int


def campaign(seed: int, kinds: Sequence[str], active: int) -> list[Fault]:
    """The faults in a fixed order for ``seed``: ``kinds`` shuffled, each on an active node
    other than node 0 (where the jobs are started from and torchrun's rendezvous runs)."""
    if active < 2:
        raise ValueError("a campaign needs at least 2 active nodes")
    chance = random.Random(seed)
    order = list(kinds)
    chance.shuffle(order)
    return [Fault(kind, chance.randrange(1, active)) for kind in order]


def names_node(event: Event, label: str) -> bool:
    """Whether the event names the node: as its own node or as the blame of a failure."""
    if event.node == label:
        return True
    return event.blame is not None and event.blame.node == label


@dataclass(frozen=True)
class Judgement:
    detected: float | None  # wall time of the event that noticed the fault (None: none did)
    named_right: bool  # that event is of the fault's kind and names its node


def judge(events: Sequence[Event], kind: str, label: str, since: float) -> Judgement:
    """The first event at or after ``since`` (the fault) of the fault's expected kind naming
    the node; else the first alarm of any kind (the fault noticed, but not named right)."""
    after = [event for event in events if event.time >= since]
    for event in after:
        if event.kind in EXPECTED[kind] and names_node(event, label):
            return Judgement(event.time, True)
    for event in after:
        if event.kind in ALARMS:
            return Judgement(event.time, False)
    return Judgement(None, False)


def false_alarms(events: Sequence[Event]) -> dict[str, int]:
    """How many events of each false-alarm kind a fault-free run had (only those seen)."""
    counts: dict[str, int] = {}
    for event in events:
        if event.kind in FALSE_ALARMS:
            counts[str(event.kind)] = counts.get(str(event.kind), 0) + 1
    return counts


def resumes(log: str) -> list[int]:
    """The step each start of the example resumed from, in order (0: no checkpoint yet)."""
    found = []
    for line in log.splitlines():
        resumed = RESUMED.search(line)
        if resumed:
            found.append(int(resumed.group(1)))
        elif FRESH.search(line):
            found.append(0)
    return found


@dataclass
class Outcome:
    """One fault under one system: seconds from the fault (None: never within the segment)."""

    system: str
    kind: str
    node: int
    available: bool = True  # False: this machine or checkout cannot inject it
    detect_s: float | None = None
    running_again_s: float | None = None
    kept_running: bool = False  # the job never stopped stepping (nothing to recover)
    steps_lost: int | None = None
    named_right: bool = False
    steps_done: int = 0  # useful steps over the segment: the step at its end minus at its start
    wall_s: float = 0.0  # the segment's wall time
    step_s: float | None = None  # seconds per step before the fault (this system's pace)

    def as_json(self) -> dict[str, object]:
        return asdict(self)


def steps_lost(at_fault: int, resumed_after: int | None) -> int:
    """Steps done before the fault and done again: the step at the fault minus the step the
    next start resumed from (0: the job was never restarted)."""
    if resumed_after is None:
        return 0
    return max(0, at_fault - resumed_after)


def fault_free_step_s(outcomes: Sequence[Outcome]) -> float | None:
    """The system's step time without faults: the median of its paces before each fault."""
    paces = [outcome.step_s for outcome in outcomes if outcome.step_s is not None]
    return statistics.median(paces) if paces else None


def ettr(outcomes: Sequence[Outcome]) -> float | None:
    """Effective training time ratio: the steps done times the fault-free step time, over the
    wall time, summed over the segments that ran."""
    ran = [outcome for outcome in outcomes if outcome.available and outcome.wall_s > 0]
    step_s = fault_free_step_s(ran)
    wall = sum(outcome.wall_s for outcome in ran)
    if step_s is None or wall <= 0:
        return None
    return sum(outcome.steps_done for outcome in ran) * step_s / wall


def paced_ettr(outcomes: Sequence[Outcome]) -> float | None:
    """ETTR with each segment's steps at its own pace before its fault: on a machine whose load
    drifts during the run (other sessions' tests), a segment run under more load does fewer
    steps at a slower pace, which one median pace for all would count as time lost."""
    ran = []
    for outcome in outcomes:
        if outcome.available and outcome.wall_s > 0 and outcome.step_s is not None:
            ran.append(outcome)
    wall = sum(outcome.wall_s for outcome in ran)
    if wall <= 0:
        return None
    return sum(outcome.steps_done * (outcome.step_s or 0.0) for outcome in ran) / wall


def seconds(value: float | None) -> str:
    return "never" if value is None else f"{value:.1f}"


def cells(outcome: Outcome) -> list[str]:
    """The table's cells for one fault under one system."""
    if not outcome.available:
        return ["not available"] * 4
    again = "kept running" if outcome.kept_running else seconds(outcome.running_again_s)
    lost = "–" if outcome.steps_lost is None else str(outcome.steps_lost)
    return [seconds(outcome.detect_s), again, lost, "yes" if outcome.named_right else "no"]


def table(outcomes: Sequence[Outcome]) -> str:
    """Markdown: one row per fault and system, then one per system with its ETTR."""
    lines = [
        "| fault (node) | system | detect s | running again s | steps lost | named right |",
        "|---|---|---|---|---|---|",
    ]
    for outcome in outcomes:
        row = [f"{outcome.kind} (node {outcome.node})", outcome.system, *cells(outcome)]
        lines.append("| " + " | ".join(row) + " |")
    lines += [
        "",
        "| system | steps done | wall s | fault-free step s | ETTR | ETTR, paced by segment |",
        "|---|---|---|---|---|---|",
    ]
    for system in dict.fromkeys(outcome.system for outcome in outcomes):
        mine = [outcome for outcome in outcomes if outcome.system == system and outcome.available]
        step_s = fault_free_step_s(mine)
        ratio = ettr(mine)
        paced = paced_ettr(mine)
        row = [
            system,
            str(sum(outcome.steps_done for outcome in mine)),
            f"{sum(outcome.wall_s for outcome in mine):.0f}",
            "–" if step_s is None else f"{step_s:.3f}",
            "–" if ratio is None else f"{100 * ratio:.1f}%",
            "–" if paced is None else f"{100 * paced:.1f}%",
        ]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)
