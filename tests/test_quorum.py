"""The rules of the supervision copies (``meshkit.quorum``), case by case: what a node keeps
(``keeps``) and what a reader believes (``believe``). The same rules under random schedules:
``test_quorum_sim.py``."""

from __future__ import annotations

import json

import pytest

from meshkit.job import Job
from meshkit.node.supervise import accepts
from meshkit.ops.supervision import stop_record
from meshkit.protocol import Supervision, SupervisorState
from meshkit.quorum import believe, keeps, majority, new_launch
from meshkit.record import INT_RANGES, build, replace

OLD = "0000000000000001-00000000"
NOW = "0000000000000002-00000000"
LATER = "0000000000000003-00000000"
RUNNING = SupervisorState.RUNNING
STOPPED = SupervisorState.STOPPED


def copy(
    generation: int = 1,
    members: tuple[str, ...] = ("a", "b", "c"),
    version: int = 1,
    launch: str = NOW,
    state: SupervisorState = RUNNING,
) -> Supervision:
    return Supervision(
        state, 1, 3, version=version, generation=generation, members=list(members), launch=launch
    )


def test_majority_is_more_than_half() -> None:
    assert [majority(nodes) for nodes in (1, 2, 3, 4, 5, 6)] == [1, 2, 2, 3, 3, 4]


def test_a_new_launch_sorts_after_the_one_before_even_with_the_clock_back() -> None:
    first = new_launch("", now_ns=1000)
    assert new_launch(first, now_ns=10) > first
    assert new_launch(first, now_ns=2000) > first


KEEPS = [
    # (why, stored, written, version read by the writer, kept)
    ("no copy yet", None, copy(), 0, True),
    ("the next version over the one read", copy(version=1), copy(version=2), 1, True),
    ("a copy newer than the writer read", copy(version=3), copy(version=4), 2, False),
    ("a newer generation", copy(version=5), copy(2, ("a", "b", "d"), 2), 0, True),
    ("an older generation", copy(2, ("a", "b", "d")), copy(1, version=9), 9, False),
    (
        "another membership of one generation",
        copy(2, ("a", "b", "d")),
        copy(2, ("a", "b", "e")),
        1,
        False,
    ),
    ("a node twice in the membership", None, copy(members=("a", "a", "b")), 0, False),
    ("a stop over anything of its launch", copy(3, version=9), copy(state=STOPPED), 0, True),
    ("a stop over a stop", copy(state=STOPPED), copy(state=STOPPED, version=2), 0, True),
    ("nothing but a stop over a stop", copy(state=STOPPED), copy(2, ("a", "b", "d"), 5), 5, False),
    ("a newer launch over an old stop", copy(launch=OLD, state=STOPPED), copy(), 0, True),
    ("an older launch never", copy(), copy(launch=OLD, state=STOPPED), 0, False),
    ("a newer launch over a newer generation", copy(4, launch=OLD, version=9), copy(), 0, True),
]


@pytest.mark.parametrize(
    ("stored", "written", "version", "kept"),
    [case[1:] for case in KEEPS],
    ids=[case[0] for case in KEEPS],
)
def test_keeps(stored: Supervision | None, written: Supervision, version: int, kept: bool) -> None:
    assert keeps(stored, written, version) is kept


GEN2 = copy(2, ("a", "b", "d"), 4)
KNOWN = (1, ("a", "b", "c"))

BELIEVE = [
    # (why, copies answered, nodes, believed, settled)
    ("every node alike", [copy()] * 3, 3, copy(), True),
    (
        "the newest version of the membership",
        [copy(), copy(version=2), None],
        3,
        copy(version=2),
        True,
    ),
    ("a minority answered", [copy()], 3, copy(), False),
    ("one copy a generation ahead moves nothing", [GEN2, copy(), copy()], 3, copy(), True),
    ("a generation half the nodes carry", [GEN2, GEN2, copy()], 4, copy(), True),
    ("a new generation carried by a majority of all", [GEN2, GEN2, GEN2, copy()], 5, GEN2, True),
    ("a stop wins from one copy", [copy(state=STOPPED), GEN2, GEN2], 3, copy(state=STOPPED), True),
    ("another launch's copies count for nothing", [copy(launch=OLD)] * 3, 3, None, True),
    ("a claim no majority carries is shown, not acted on", [GEN2], 3, None, False),
    (
        "a node twice counts for nothing",
        [copy(members=("a", "a", "b"))] * 2 + [copy()],
        3,
        copy(),
        True,
    ),
    ("a rebooted node is no vote", [None, None, copy()], 3, copy(), True),
]


@pytest.mark.parametrize(
    ("copies", "nodes", "believed", "settled"),
    [case[1:] for case in BELIEVE],
    ids=[case[0] for case in BELIEVE],
)
def test_believe(
    copies: list[Supervision | None], nodes: int, believed: Supervision | None, settled: bool
) -> None:
    belief = believe(copies, nodes, NOW, KNOWN)
    assert (belief.record, belief.settled) == (believed, settled)


def test_believe_names_the_newer_launch_and_the_unproven_generations() -> None:
    belief = believe([copy(), copy(), GEN2, copy(launch=LATER)], 5, NOW, KNOWN)
    assert belief.newer
    assert belief.unproven == (2,)
    assert belief.record == copy()
    assert belief.quorum


def test_a_stop_beats_a_later_claim_of_its_launch() -> None:
    """Two majorities share a node: the one holding the stop refuses the claim."""
    stop = copy(state=STOPPED, version=2)
    claim = replace(GEN2, supervisor=SupervisorState.RELAUNCHING)
    assert not keeps(stop, claim, stop.version)


def test_a_copy_at_the_top_of_the_version_range_leaves_a_stop_writable() -> None:
    """A stop over a copy whose version is the highest a node accepts stays within the range
    (``supervision.next_version``), and the node keeps it."""
    top = INT_RANGES["Count"][1]
    copy = Supervision(SupervisorState.RUNNING, 1, 2, version=top)
    stop = stop_record(copy, Job("x", "/w", "s", "/h", "/p", 1, restarts=2))
    assert stop.version == top
    assert build(Supervision, json.loads(stop.to_json()), "stop") == stop
    assert accepts(copy.to_json(), stop, top)
