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
from ..printing import say

if TYPE_CHECKING:
    from ...ops.bandwidth import Bandwidth
    from ...ops.doctor import Report

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


def matrix(measured: Bandwidth, nodes: list[str]) -> str:
    """Rates from each row's node to each column's (Gbit/s; columns by hostfile index)."""
    rows = []
    for index, node in enumerate(nodes):
        cells = [f"{index} {node}"]
        for peer in nodes:
            if peer == node:
                cells.append("-")
            else:
                cells.append(f"{measured.rates.get((node, peer), 0) / 1e9:.3g}")
        rows.append(cells)
    columns = [str(index) for index in range(len(nodes))]
    return table(["Gbit/s from \\ to", *columns], rows)


def html_cell(gigabits: float, top: float) -> str:
    """One rate (Gbit/s): green at the fastest, red at none; NaN: none measured."""
    if math.isnan(gigabits):
        return "<td>-</td>"
    return f'<td style="background:hsl({120 * gigabits / top:.0f},70%,60%)">{gigabits:.3g}</td>'


def plot_label(gigabits: float) -> str:
    """One rate's text on the PNG: Gbit/s, or Mbit/s (an M) below 1; none where none measured."""
    if math.isnan(gigabits):
        return ""
    if gigabits >= 1:
        return f"{gigabits:.3g}"
    return f"{gigabits * 1e3:.3g}M"


def heatmap(measured: Bandwidth, nodes: list[str], path: str) -> None:
    """The pair matrix as a heatmap: PNG through matplotlib (the extra 'plot'), or plain HTML."""
    grid = []
    for node in nodes:
        grid.append([measured.rates.get((node, peer), math.nan) / 1e9 for peer in nodes])
    if path.endswith(".html"):
        top = max(measured.rates.values(), default=1.0) / 1e9
        rows = ""
        for node, row in zip(nodes, grid):
            cells = "".join(html_cell(gigabits, top) for gigabits in row)
            rows += f"<tr><th>{html.escape(node)}</th>{cells}</tr>"
        with open(path, "w") as handle:
            handle.write(f"<!doctype html><title>meshkit bandwidth</title><table>{rows}</table>\n")
        return
    try:
        import matplotlib.pyplot as plt
    except ImportError:
        why = "PNG needs matplotlib: pip install 'meshkit[plot]' (or write .html)"
        raise UsageError(f"--plot {path}: {why}") from None
    plt.switch_backend("Agg")
    size = (2.2 + 0.7 * len(nodes), 1.2 + 0.55 * len(nodes))
    figure, axes = plt.subplots(figsize=size)
    image = axes.imshow(grid, cmap="RdYlGn", vmin=0)
    axes.set_xticks(range(len(nodes)), [str(index) for index in range(len(nodes))])
    axes.set_yticks(range(len(nodes)), [f"{index} {node}" for index, node in enumerate(nodes)])
    for i, row in enumerate(grid):
        for j, gigabits in enumerate(row):
            axes.text(j, i, plot_label(gigabits), ha="center", va="center", fontsize=8)
    axes.set(xlabel="to", ylabel="from", title="Gbit/s (M: Mbit/s)")
    figure.colorbar(image)
    figure.tight_layout()
    figure.savefig(path, dpi=80)
    plt.close(figure)


def _number(text: str, flag: str, name: str) -> float:
    """``text`` (ASCII digits, at most one point) within the doctor's limit for ``name``."""
    from ...ops.doctor import within

    digits = text.replace(".", "", 1)
    # anything else (a sign, an exponent, "nan") is NaN, which no limit holds
    number = float(text) if digits.isascii() and digits.isdigit() else math.nan
    return within(name, number, f"{flag} {text!r}")


def render(report: Report) -> str:
    rows = []
    for check in report.checks:
        verdict = "ok" if check.ok else "FAIL"
        peer = check.peer or ""
        rows.append((check.check, check.node, peer, verdict, check.detail[:90], check.fix[:80]))
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
    from ...ops.bandwidth import rate_text
    from ...ops.lookup import saved_or_new

    with reported():
        wait = _number(timeout, "--timeout", "timeout")
        ratio = _number(min_ratio, "--min-ratio", "min_ratio")
        floor = rate(min_rate, "--min-rate") if min_rate else 0.0
        if plot and not plot.endswith((".png", ".html")):
            raise UsageError(f"--plot {plot!r}: expected a .png or .html file")
        bandwidth_flags = bool(min_rate) or bool(plot) or min_ratio != "0.5"
        if bandwidth_flags and not bandwidth:
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
        say(f"doctor: {len(hosts)} nodes, {source}, master port {job.master_port}")
        say(render(report))
        failures = report.failures
        measured = report.bandwidth
        if measured is not None:
            say(f"\n{matrix(measured, report.nodes)}\n")
            medians = f"median (of the nodes' medians) {rate_text(measured.median)}"
            if measured.busbw:
                medians += f"; all_reduce busbw {rate_text(measured.busbw)}"
            say(medians)
            for failure in failures:
                if failure.check == "bandwidth" and failure.peer:
                    say(f"slow pair: {failure.node} <-> {failure.peer}")
            for node in measured.slow_nodes:
                say(f"slow node: {node} (every one of its pairs)")
        say(f"\n{len(report.checks) - len(failures)}/{len(report.checks)} checks passed")
    if not report.ok:
        raise Exit(code=1)
