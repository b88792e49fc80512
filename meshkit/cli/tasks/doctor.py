"""``doctor``: per node and per pair, can this cluster train? Parse, call ``ops.doctor``, render."""

from __future__ import annotations

import html
import json as jsonlib
import math
from typing import TYPE_CHECKING

from invoke.context import Context
from invoke.exceptions import Exit

from ...errors import UsageError
from ..common import conf, helps, progress, rate, reported, table, task

if TYPE_CHECKING:
    from ...ops.doctor import Bandwidth, Report

DOCTOR_HELP = helps(
    *("hostfile", "session", "workdir", "json", "include", "exclude", "master_port"),
    quick="leave out the slow parts: the N x N SSH check and the collective probe",
    timeout="seconds the collective probe may take to connect and all_reduce (default 30)",
    bandwidth="instead: every pair's throughput both ways on every shared network, in rounds of "
    "disjoint pairs, then one timed all_reduce (bus bandwidth)",
    min_ratio="with --bandwidth: a pair fails below this fraction of the median rate (default 0.5)",
    min_rate="with --bandwidth: a pair fails below this rate too (e.g. 10Gbit)",
    plot="with --bandwidth: write the pair matrix as a heatmap, FILE.png (extra 'plot') or .html",
)


def matrix(bw: Bandwidth, nodes: list[str]) -> str:
    """Rates from each row's node to each column's (Gbit/s; columns by hostfile index)."""
    rows = [
        [f"{i} {a}"] + ["-" if a == b else f"{bw.rates.get((a, b), 0) / 1e9:.3g}" for b in nodes]
        for i, a in enumerate(nodes)
    ]
    return table(["Gbit/s from \\ to", *map(str, range(len(nodes)))], rows)


def _cell(v: float, top: float) -> str:
    """One rate (Gbit/s): green at the fastest, red at none; NaN: none measured."""
    if v != v:
        return "<td>-</td>"
    return f'<td style="background:hsl({120 * v / top:.0f},70%,60%)">{v:.3g}</td>'


def heatmap(bw: Bandwidth, nodes: list[str], path: str) -> None:
    """The pair matrix as a heatmap: PNG through matplotlib (the extra 'plot'), or plain HTML."""
    grid = [[bw.rates.get((a, b), math.nan) / 1e9 for b in nodes] for a in nodes]
    if path.endswith(".html"):
        top = max(bw.rates.values(), default=1.0) / 1e9
        rows = "".join(
            f"<tr><th>{html.escape(a)}</th>" + "".join(_cell(v, top) for v in row) + "</tr>"
            for a, row in zip(nodes, grid)
        )
        with open(path, "w") as handle:
            handle.write(f"<!doctype html><title>meshkit bandwidth</title><table>{rows}</table>\n")
        return
    try:
        import matplotlib.pyplot as plt
    except ImportError:
        why = "PNG needs matplotlib: pip install 'meshkit[plot]' (or write .html)"
        raise UsageError(f"--plot {path}: {why}") from None
    plt.switch_backend("Agg")
    fig, ax = plt.subplots(figsize=(2.2 + 0.7 * len(nodes), 1.2 + 0.55 * len(nodes)))
    image = ax.imshow(grid, cmap="RdYlGn", vmin=0)
    ax.set_xticks(range(len(nodes)), [str(i) for i in range(len(nodes))])
    ax.set_yticks(range(len(nodes)), [f"{i} {n}" for i, n in enumerate(nodes)])
    for i, row in enumerate(grid):
        for j, v in enumerate(row):
            label = "" if v != v else f"{v:.3g}" if v >= 1 else f"{v * 1e3:.3g}M"
            ax.text(j, i, label, ha="center", va="center", fontsize=8)
    ax.set(xlabel="to", ylabel="from", title="Gbit/s (M: Mbit/s)")
    fig.colorbar(image)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def _number(text: str, flag: str, name: str) -> float:
    """``text`` (ASCII digits, at most one point) within the doctor's limit for ``name``."""
    from ...ops.doctor import within

    digits = text.replace(".", "", 1)
    number = float(text) if digits.isascii() and digits.isdigit() else math.nan
    return within(name, number, f"{flag} {text!r}")


def render(report: Report) -> str:
    rows = [
        (c.check, c.node, c.peer or "", "ok" if c.ok else "FAIL", c.detail[:90], c.fix[:80])
        for c in report.checks
    ]
    return table(["check", "node", "peer", "ok", "detail", "fix"], rows)


@task(help=DOCTOR_HELP)
def doctor(
    c: Context,
    hostfile: str | None = None,
    session: str | None = None,
    workdir: str | None = None,
    json: bool = False,
    include: str | None = None,
    exclude: str | None = None,
    master_port: str | None = None,
    quick: bool = False,
    timeout: str = "30",
    bandwidth: bool = False,
    min_ratio: str = "0.5",
    min_rate: str | None = None,
    plot: str | None = None,
) -> None:
    """Check that the cluster can train, per node and per pair: SSH N x N, rank discovery and the
    interface each node's backends will use, the master port (free on the master, reachable from
    every node), node-to-node TCP on those interfaces, versions, GPUs vs slots, the shared
    workdir, clocks, and a tiny all_reduce. Every check is bounded in time; exit 1 if any fails.
    With --bandwidth: the throughput of every pair instead, and the all_reduce's bus bandwidth."""
    from ...ops import doctor as ops
    from ...ops.lookup import saved_or_new

    with reported():
        wait = _number(timeout, "--timeout", "timeout")
        ratio = _number(min_ratio, "--min-ratio", "min_ratio")
        floor = rate(min_rate, "--min-rate") if min_rate else 0.0
        if plot and not plot.endswith((".png", ".html")):
            raise UsageError(f"--plot {plot!r}: expected a .png or .html file")
        if (min_rate or plot or min_ratio != "0.5") and not bandwidth:
            raise UsageError("--min-ratio, --min-rate and --plot go with --bandwidth")
        job, hosts, source = saved_or_new(
            conf(), hostfile, session, workdir, master_port, include, exclude
        )
        shown = None if json else progress
        report = ops.doctor(conf(), job, hosts, quick, wait, bandwidth, ratio, floor, shown)
        if plot and report.bandwidth is not None:
            heatmap(report.bandwidth, report.nodes, plot)
    if json:
        print(jsonlib.dumps(report.as_json()))
    else:
        print(f"doctor: {len(hosts)} nodes, {source}, master port {job.master_port}")
        print(render(report))
        bad, bw = report.failures, report.bandwidth
        if bw is not None:
            print(f"\n{matrix(bw, report.nodes)}\n")
            print(f"median (of the nodes' medians) {ops.rate_text(bw.median)}", end="")
            print(f"; all_reduce busbw {ops.rate_text(bw.busbw)}" if bw.busbw else "")
            for f in (f for f in bad if f.check == "bandwidth" and f.peer):
                print(f"slow pair: {f.node} <-> {f.peer}")
            for node in bw.slow_nodes:
                print(f"slow node: {node} (every one of its pairs)")
        print(f"\n{len(report.checks) - len(bad)}/{len(report.checks)} checks passed")
    if not report.ok:
        raise Exit(code=1)
