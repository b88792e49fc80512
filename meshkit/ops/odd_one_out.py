"""The odd one out, pure: a node, GPU or rank whose utilisation, power or CPU is far from the
median of its peers. Far is under ``LOW`` of the median while the group is busy (the GPU at 0%
while the others compute, the node whose network is idle), or busy while the group's median is
idle (the one rank spinning while the others wait); either way a minority of the group. Every
mark comes with a one-line reason. A straggler (``meshkit.stragglers``: a node whose compute
time per step is ``--straggler-ratio`` over the nodes' median) is an odd one too, with its ratio.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from ..protocol import PortRate, Straggler, TopReply
from ..stragglers import stragglers

Kind = Literal["node", "gpu", "rank"]
LOW = 0.5  # far below: under half the peers' median
BUSY_PERCENT = 50.0  # a GPU's utilisation or power (of its limit), a node's CPU
BUSY_RANK = 10.0  # percent of one core: a rank that computes (on a shared core it gets less)
BUSY_NETWORK = 1e6  # bytes/s received and sent on the job's interface
MIN_GROUP = 3  # fewer peers have no median to stand out from


@dataclass(frozen=True)
class Figure:
    """One value of one member of a group of peers."""

    kind: Kind
    node: str  # as the hostfile spells it
    what: str  # "rank 3 on node1", "GPU 2 on node1", "node1"
    value: float


@dataclass(frozen=True)
class Odd:
    kind: Kind
    node: str
    what: str
    reason: str  # one line: the figure, and the peers' median


@dataclass(frozen=True)
class Measure:
    """What a group's figures measure: how they read, and when they count as busy."""

    name: str  # "CPU", "GPU utilisation", "network"
    busy: float
    unit: str = "%"

    def show(self, value: float) -> str:
        if self.unit == "B/s":
            return f"{value / 1e6:.1f} MB/s"
        return f"{value:.0f}{self.unit}"


CPU = Measure("CPU", BUSY_PERCENT)
RANK_CPU = Measure("CPU", BUSY_RANK)
RANKS_CPU = Measure("its ranks' CPU", BUSY_RANK)
GPU_UTIL = Measure("GPU utilisation", BUSY_PERCENT)
GPU_POWER = Measure("power (of its limit)", BUSY_PERCENT)
NETWORK = Measure("network", BUSY_NETWORK, "B/s")


def job_port(sample: TopReply) -> PortRate | None:
    """The job's interface's counters and rates in a node's sample (None: not found there)."""
    for port in sample.ports:
        if port.name == sample.interface:
            return port
    return None


def far_from_peers(figures: Sequence[Figure], measure: Measure) -> list[Odd]:
    """Pure: the figures far from their group's median, when they are a minority of it (half a
    group busy and half idle has no odd one out)."""
    if len(figures) < MIN_GROUP:
        return []
    median = statistics.median(figure.value for figure in figures)
    found = []
    for figure in figures:
        shown = f"{figure.what}: {measure.name} {measure.show(figure.value)}"
        if median >= measure.busy and figure.value < LOW * median:
            reason = f"{shown} while the median is {measure.show(median)}"
        elif median < LOW * measure.busy and figure.value >= measure.busy:
            reason = f"{shown} while the others idle (median {measure.show(median)})"
        else:
            continue
        found.append(Odd(figure.kind, figure.node, figure.what, reason))
    if 2 * len(found) >= len(figures):
        return []
    return found


def mark(samples: Sequence[tuple[str, TopReply]]) -> list[Odd]:
    """Pure: the odd ones among the nodes that answered (``(node, its sample)``, by rank): ranks
    by CPU; GPUs by utilisation and by power; nodes by CPU, their ranks' CPU, network and GPU
    utilisation. A figure a node could not read (the first sample's rates) is left out."""
    ranks: list[Figure] = []
    gpu_util: list[Figure] = []
    gpu_power: list[Figure] = []
    node_cpu: list[Figure] = []
    node_ranks: list[Figure] = []
    node_network: list[Figure] = []
    node_gpus: list[Figure] = []
    for node, sample in samples:
        rank_total = 0.0
        for rank in sample.ranks:
            if rank.cpu is not None:
                ranks.append(Figure("rank", node, f"rank {rank.rank} on {node}", rank.cpu))
                rank_total += rank.cpu
        if sample.ranks:
            node_ranks.append(Figure("node", node, node, rank_total))
        for gpu in sample.gpus:
            what = f"GPU {gpu.index} on {node}"
            if gpu.utilization is not None:
                gpu_util.append(Figure("gpu", node, what, gpu.utilization))
            if gpu.power is not None and gpu.power_limit:
                share = 100.0 * gpu.power / gpu.power_limit
                gpu_power.append(Figure("gpu", node, what, share))
        utilizations = [gpu.utilization for gpu in sample.gpus if gpu.utilization is not None]
        if utilizations:
            node_gpus.append(Figure("node", node, node, statistics.mean(utilizations)))
        if sample.cpu is not None:
            node_cpu.append(Figure("node", node, node, sample.cpu))
        port = job_port(sample)
        if port is not None and port.receive_rate is not None and port.send_rate is not None:
            node_network.append(Figure("node", node, node, port.receive_rate + port.send_rate))
    found: list[Odd] = []
    found += far_from_peers(ranks, RANK_CPU)
    found += far_from_peers(gpu_util, GPU_UTIL)
    found += far_from_peers(gpu_power, GPU_POWER)
    found += far_from_peers(node_cpu, CPU)
    found += far_from_peers(node_ranks, RANKS_CPU)
    found += far_from_peers(node_network, NETWORK)
    found += far_from_peers(node_gpus, GPU_UTIL)
    return found


def straggler_marks(
    samples: Sequence[tuple[str, TopReply]], ratio: float
) -> tuple[list[Straggler], list[Odd]]:
    """Pure: the stragglers among the nodes that answered (their ranks' steps, over the
    window top asked for), and each marked as the odd one out with its ratio."""
    nodes = {node: sample.progress for node, sample in samples if sample.progress}
    found = stragglers(nodes, ratio)
    marks = [Odd("node", each.node, each.node, f"straggler {each.words()}") for each in found]
    return found, marks
