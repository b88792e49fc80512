"""One N's measurements (``Row``: every sample, the cluster it ran on and that cluster's floor,
the shells it started) and the sweep's options."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from meshkit import sandbox

from . import stats
from .cluster import Checked
from .harness import StepFailed


@dataclass
class Row:
    """Everything measured at one N. Every sample is taken on a cluster (``on``): its id goes
    beside the sample (``cluster``), and the cluster's own floor is the one its ratio uses."""

    nodes: int
    raw: dict[str, list[float | None]] = field(default_factory=dict)
    cluster: dict[str, list[str]] = field(default_factory=dict)  # op/tool -> each sample's cluster
    floors: dict[str, float | None] = field(default_factory=dict)  # cluster -> its floor
    skipped: dict[str, str] = field(default_factory=dict)
    failures: dict[str, list[str]] = field(default_factory=dict)
    end_state: dict[str, list[str]] = field(default_factory=dict)
    pairs_checked: dict[str, list[list[int]]] = field(default_factory=dict)  # [pairs, of]
    logins: dict[str, list[list[int]]] = field(default_factory=dict)
    shells: dict[str, list[list[int]]] = field(default_factory=dict)  # per sample, per node
    shell_commands: dict[str, list[str]] = field(default_factory=dict)  # node0's, first sample
    lay: sandbox.Layout | None = None
    current: str = ""

    def on(self, lay: sandbox.Layout, cluster: str) -> None:
        """The samples that follow are taken on ``lay``, named ``cluster`` (unique in the row)."""
        self.lay = lay
        self.current = cluster

    def sample(
        self,
        op: str,
        tool: str,
        fn: Callable[[], object],
        verify: Callable[[], str | Checked] | None = None,
        after: Callable[[], object] | None = None,
    ) -> None:
        """Time fn, counting the shells it started on every node; then (untimed) after, then
        verify: the end state. A sample whose step failed or whose end state was not reached has
        no time, only a failure line."""
        k = stats.key(op, tool)
        counting = self.lay is not None and self.lay.bashrc == "conda"
        if counting:
            assert self.lay is not None
            sandbox.reset_shells(self.lay)
        start = time.perf_counter()
        try:
            try:
                fn()
            finally:
                seconds: float | None = round(time.perf_counter() - start, 4)
                if counting:
                    self.count_shells(k)
            if after is not None:
                after()
            if verify is not None:
                checked = verify()
                if isinstance(checked, Checked):
                    self.pairs_checked.setdefault(k, []).append([checked.pairs, checked.of])
                    checked = checked.scope
                self.end_state.setdefault(k, []).append(checked)
        except StepFailed as exc:
            took = time.perf_counter() - start
            seconds = None
            self.failures.setdefault(k, []).append(f"after {took:.2f}s: {exc}")
            print(f"  N={self.nodes} {k}: FAILED {exc}", file=sys.stderr)
        self.add(k, seconds)
        if k == stats.FLOOR:
            self.floors[self.current] = seconds
        if seconds is not None:
            print(f"  N={self.nodes} {k}: {seconds:.2f}s", file=sys.stderr)

    def add(self, k: str, seconds: float | None) -> None:
        """One sample of ``k`` on the current cluster."""
        self.raw.setdefault(k, []).append(seconds)
        self.cluster.setdefault(k, []).append(self.current)

    def count_shells(self, k: str) -> None:
        assert self.lay is not None
        started = sandbox.shells(self.lay)
        self.shells.setdefault(k, []).append([len(x) for x in started])
        if k not in self.shell_commands:
            self.shell_commands[k] = [c[:160] for c in started[0][:40]]

    def skip(self, op: str, tool: str, why: str) -> None:
        self.skipped[stats.key(op, tool)] = why

    def as_json(self) -> dict[str, object]:
        medians, ratios = stats.summarize(self.raw, self.cluster, self.floors)
        return {
            "nodes": self.nodes,
            "median_s": medians,
            "ratio_to_floor": ratios,
            "shells_per_node": stats.shells_summary(self.shells),
            "raw_s": self.raw,
            "cluster": self.cluster,
            "floor_of_cluster_s": self.floors,
            "skipped": self.skipped,
            "failures": self.failures,
            "end_state": self.end_state,
            "pairs_checked": self.pairs_checked,
            "controller_logins_per_node": self.logins,
            "shells_raw": self.shells,
            "shell_commands_node0": self.shell_commands,
        }


@dataclass
class Options:
    peers_max: int
    n2_max: int
    bins: dict[str, Path]  # installed peers: name -> venv bin dir
    unavailable: dict[str, str]  # peer -> why it is not measured
    seed_max: int = 16  # the seed's N + N² sequential logins take minutes beyond this
    launch_max: int = 16  # 2 torch processes per node all share this machine's cores and memory
    launch_only: bool = False  # per repeat: one cluster, the floor and the launches only
    spawn: bool = False  # also meshkit train --spawn: no torchrun (a fourth launch)
    without: frozenset[str] = frozenset()  # op/tool keys left out (--without)


WITHOUT = ("mesh/bash_controlmaster", "mesh/seed", "round/pdsh", "round/clush", "doctor/meshkit")


def count_floor_shells(row: Row, lay: sandbox.Layout) -> None:
    """The floor starts one shell per node: if the nodes' bashrc counts shells, it must have
    counted exactly that, or every shell count of the run is wrong."""
    got = row.shells.get(stats.FLOOR, [[]])[-1]
    if lay.bashrc == "conda" and got != [1] * lay.count:
        raise StepFailed(f"the floor's shells per node were {got}, want 1 on each node")
