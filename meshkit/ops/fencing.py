"""A supervisor ending its own node's part of the job, and why: its node is in no membership of
a newer generation (``fence``: it was lost and replaced, or the job shrank without it), its side
of a partition has had no majority of the job's nodes for half of --replace-after (``alone``:
the other side may give its rank away then), or a later launch of the job started (``superseded``);
or the job was stopped and the stop did not reach every node (``carry_stop``: carried there).
Each ends only what runs on its own node, over a connection of its own: the rest of the job is
the membership's, which this node is no longer in, or cannot reach.
"""

from __future__ import annotations

import contextlib
import time

from ..errors import MeshkitError
from ..protocol import StopReply, StopRequest, Supervision, SupervisorState
from .pool import NodePool
from .relaunch import Loop
from .supervision import ask
from .supervision_policy import Majority

RECONNECT = 10.0  # seconds to connect to its own node


def end_here(loop: Loop) -> None:
    """End what this node runs of the job."""
    node = [loop.node]
    with contextlib.suppress(MeshkitError), loop.connect(node, RECONNECT) as own:
        ending = StopRequest(loop.job.id)
        own.call_all("stop", lambda host: ending, StopReply, node)


def fence(loop: Loop, record: Supervision) -> Supervision:
    """This node was lost and the job moved on without it (``record``, a newer generation):
    end what it still runs of the job here, keep the newer record here, and end; it is a spare
    now."""
    node = [loop.node]
    loop.say(
        f"generation {record.generation} does not include this node (it was lost and "
        "replaced): ending what it runs of the job here; it is a spare now"
    )
    with contextlib.suppress(MeshkitError), loop.connect(node, RECONNECT) as own:
        ask(own, loop.job, node, record=record, version=record.version)
        ending = StopRequest(loop.job.id)
        own.call_all("stop", lambda host: ending, StopReply, node)
    return record


def alone(loop: Loop, majority: Majority, nodes: int) -> None:
    """No majority of the job's ``nodes`` answers (a partition: this side is the smaller one,
    or too many nodes are down): the loop acts on nothing, and past half of --replace-after
    this node's part of the job ends (``Majority``), before the side that has a majority may
    give its rank to a spare: two memberships never run at once."""
    now = time.monotonic()
    if not majority.fence_now(now, loop.job.replace_after, bool(loop.quorum)):
        return
    alone_for = now - majority.seen_at
    loop.say(
        f"no majority of the job's {nodes} nodes answers for {alone_for:.0f}s "
        "(partitioned?): ending this node's part of the job; the nodes that have a majority "
        "may give its rank to a spare"
    )
    end_here(loop)


def superseded(loop: Loop, pool: NodePool) -> Supervision:
    """A node holds a copy of a later launch of this job (a ``train`` since): this
    supervisor's launch is over. Its node's part ends too, unless the new launch already holds
    this node (then what runs here is the new launch's)."""
    mine = ask(pool, loop.job, [loop.node]).get(loop.node)
    taken = mine is not None and mine.record is not None and mine.record.launch != loop.job.launch
    if not taken:
        end_here(loop)
    why = "the job was started anew (a later train): this supervisor's launch is over"
    loop.say(why)
    return Supervision(SupervisorState.GAVE_UP, 0, 0, why, launch=loop.job.launch)


def carry_stop(loop: Loop, pool: NodePool, stopped: Supervision) -> Supervision:
    """The job was stopped, and this supervisor survived it (cut off from ``stop``): the
    stop ends the whole job, so on the nodes whose copy does not say stopped yet (the stop
    did not reach them) leave the stop's record, then end the job there; relaunch
    nothing."""
    job = loop.job
    answers = ask(pool, job, loop.nodes())
    behind = [
        host
        for host, reply in answers.items()
        if reply.record is None or reply.record.supervisor != SupervisorState.STOPPED
    ]
    if not behind:
        loop.say("the job was stopped (meshkit stop); relaunching nothing")
        return stopped
    where = ", ".join(host.label for host in behind)
    loop.say(f"the job was stopped (meshkit stop) without reaching {where}: ending it there")
    ask(pool, job, behind, record=stopped, version=stopped.version)
    ending = StopRequest(job.id)
    pool.call_all("stop", lambda host: ending, StopReply, behind)
    return stopped
