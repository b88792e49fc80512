"""``meshkit top``: every node, GPU and rank of the cluster live, one row per node, refreshed every
``--interval`` seconds; ``--once`` one snapshot (plain text off a terminal), ``--json`` one with
fixed keys, ``--format prometheus`` one in Prometheus' text format. rich draws the live view; it
is imported only here, so ``meshkit env`` never loads it."""

from __future__ import annotations

import json as jsonlib
import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from invoke.context import Context
from invoke.exceptions import Exit

from ...errors import UsageError
from ...terminal import visible
from ..common import conf, helps, reported, table, task
from ..printing import relay, say

if TYPE_CHECKING:
    from rich.console import Group
    from rich.text import Text

    from ...ops.top import NodeLine, Snapshot, Watch

SPARKS = "▁▂▃▄▅▆▇█"
SPARK_WIDTH = 30  # values shown: the last minute at the 2 s default
MIN_INTERVAL = 0.5
FORMATS = ("text", "json", "prometheus")
TOP_HELP = {
    "interval": "seconds between refreshes (default 2)",
    "gpus": "one row per GPU as well",
    "once": "print one snapshot and exit (plain text when stdout is not a terminal)",
    "json": "print one snapshot as JSON (keys in the README) and exit",
    "format": "text (default) or prometheus: one snapshot in Prometheus' text format, and exit",
}


def sizes(count: float | None, unit: str = "") -> str:
    """1.5G, 230M, 12K: bytes (or bytes/s) as a person reads them."""
    if count is None:
        return "-"
    for size, suffix in ((1 << 40, "T"), (1 << 30, "G"), (1 << 20, "M"), (1 << 10, "K")):
        if count >= size:
            return f"{count / size:.1f}{suffix}{unit}"
    return f"{count:.0f}{unit}"


def percent(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}%"


def spark(values: Sequence[float]) -> str:
    """A sparkline of percentages (0-100), the newest last."""
    shown = []
    for value in list(values)[-SPARK_WIDTH:]:
        level = int(max(0.0, min(100.0, value)) / 100.0 * (len(SPARKS) - 1) + 0.5)
        shown.append(SPARKS[level])
    return "".join(shown)


NODE_HEADERS = [
    "rank",
    "node",
    "cpu",
    "memory",
    "load",
    "rx/s",
    "tx/s",
    "gpus",
    "gpu util",
    "gpu mem",
    "power",
    "temp",
    "ranks (cpu)",
    "rss",
    "idle",
    "health",
    "last minute",
]


def node_cells(view: NodeLine) -> list[str]:
    """One node's row: its figures, or ``down`` and why."""
    from ...ops.odd_one_out import job_port

    sample = view.sample
    if sample is None:
        since = f" {view.down_for:.0f}s" if view.down_for else ""
        why = (view.error or "no answer").splitlines()[0][:90]
        return [str(view.node_rank), view.node, f"down{since}: {why}"] + [""] * 14
    port = job_port(sample)
    gpus = sample.gpus
    gpu_util = "-"
    gpu_memory = "-"
    power = "-"
    temperature = "-"
    if gpus:
        utilizations = [gpu.utilization for gpu in gpus if gpu.utilization is not None]
        if utilizations:
            gpu_util = percent(sum(utilizations) / len(utilizations))
        used = sum(gpu.memory_used or 0 for gpu in gpus)
        total = sum(gpu.memory_total or 0 for gpu in gpus)
        gpu_memory = f"{sizes(used)}/{sizes(total)}"
        watts = sum(gpu.power or 0.0 for gpu in gpus)
        limit = sum(gpu.power_limit or 0.0 for gpu in gpus)
        power = f"{watts:.0f}/{limit:.0f}W"
        temperatures = [gpu.temperature for gpu in gpus if gpu.temperature is not None]
        if temperatures:
            temperature = f"{max(temperatures):.0f}C"
    gpu_count = str(len(gpus)) if gpus else "none"
    if sample.gpu_error and not gpus:
        gpu_count = "?"
    ranks = " ".join(f"{rank.rank}:{percent(rank.cpu)}" for rank in sample.ranks)
    rss = sizes(sum(rank.rss for rank in sample.ranks)) if sample.ranks else ""
    idle = ""
    if sample.idle is not None:
        idle = f"{sample.idle:.0f}s" + (" stalled" if view.stalled else "")
    load = " ".join(f"{value:.1f}" for value in sample.load)
    return [
        str(view.node_rank),
        view.node,
        percent(sample.cpu),
        f"{sizes(sample.memory_used)}/{sizes(sample.memory_total)}",
        load,
        sizes(port.receive_rate if port else None, "B"),
        sizes(port.send_rate if port else None, "B"),
        gpu_count,
        gpu_util,
        gpu_memory,
        power,
        temperature,
        ranks or ("-" if sample.job_state is None else str(sample.job_state)),
        rss,
        idle,
        "-" if sample.health is None else str(sample.health.state),  # why: in the marks below
        spark(view.history),
    ]


INFINIBAND_HEADERS = ["ib rx/s", "ib tx/s"]
INFINIBAND_AT = NODE_HEADERS.index("tx/s") + 1  # the InfiniBand columns follow the job's network


def infiniband_cells(view: NodeLine) -> list[str]:
    """A node's InfiniBand ports' rates, summed (its ports other than the job's interface)."""
    sample = view.sample
    if sample is None:
        return ["", ""]
    ports = [port for port in sample.ports if port.name != sample.interface]
    if not ports:
        return ["-", "-"]
    received = sum(port.receive_rate or 0.0 for port in ports)
    sent = sum(port.send_rate or 0.0 for port in ports)
    return [sizes(received, "B"), sizes(sent, "B")]


STEP_AT = NODE_HEADERS.index("idle")  # the steps column goes before the log's idle time


def step_cell(view: NodeLine) -> str:
    """A node's steps: its ranks' lowest step, slowest rate and oldest step's age."""
    from ...ops.progress_status import node_steps

    told = node_steps(view.sample.progress) if view.sample else None
    return "-" if told is None else told.words()


def node_table(snapshot: Snapshot) -> tuple[list[str], list[list[str]]]:
    """The headers and one row per node; a steps column only where some node's ranks tell their
    steps (``meshkit.progress``), InfiniBand columns only where some node has a port."""
    rows = [node_cells(view) for view in snapshot.nodes]
    headers = list(NODE_HEADERS)
    if any(view.sample and view.sample.progress for view in snapshot.nodes):
        headers.insert(STEP_AT, "step")
        for row, view in zip(rows, snapshot.nodes):
            row.insert(STEP_AT, step_cell(view) if view.up else "")
    with_infiniband = False
    for view in snapshot.nodes:
        if view.sample and any(port.name != view.sample.interface for port in view.sample.ports):
            with_infiniband = True
    if not with_infiniband:
        return headers, rows
    headers = [*headers[:INFINIBAND_AT], *INFINIBAND_HEADERS, *headers[INFINIBAND_AT:]]
    for row, view in zip(rows, snapshot.nodes):
        row[INFINIBAND_AT:INFINIBAND_AT] = infiniband_cells(view)
    return headers, rows


GPU_HEADERS = ["node", "gpu", "name", "util", "memory", "power", "temp"]


def gpu_rows(snapshot: Snapshot) -> list[list[str]]:
    rows = []
    for view in snapshot.nodes:
        for gpu in view.sample.gpus if view.sample else []:
            power = "-"
            if gpu.power is not None:
                limit = "?" if gpu.power_limit is None else f"{gpu.power_limit:.0f}"
                power = f"{gpu.power:.0f}/{limit}W"
            temperature = "-" if gpu.temperature is None else f"{gpu.temperature:.0f}C"
            memory = f"{sizes(gpu.memory_used)}/{sizes(gpu.memory_total)}"
            cells = [view.node, str(gpu.index), gpu.name, percent(gpu.utilization)]
            rows.append([*cells, memory, power, temperature])
    return rows


def header(snapshot: Snapshot) -> str:
    stamp = time.strftime("%H:%M:%S", time.localtime(snapshot.time))
    up = sum(1 for view in snapshot.nodes if view.up)
    line = f"meshkit top  {stamp}  {up}/{len(snapshot.nodes)} nodes up"
    if snapshot.job:
        line += f"  job {snapshot.job}"
        if snapshot.stalled:
            line += " (stalled)"
    if snapshot.supervisor:
        line += f"  supervisor: {snapshot.supervisor}"
    return line


def unhealthy(snapshot: Snapshot) -> set[str]:
    """The nodes that answered unhealthy (``meshkit.health``)."""
    found = set()
    for view in snapshot.nodes:
        health = view.sample.health if view.sample else None
        if health is not None and str(health.state) == "unhealthy":
            found.add(view.node)
    return found


def footer(snapshot: Snapshot) -> list[str]:
    """One line per unhealthy node and per odd one out, and the nodes whose GPUs could not be
    read."""
    sick = unhealthy(snapshot)
    lines = []
    for odd in snapshot.odd:
        if odd.kind == "node" and odd.node in sick:
            lines.append(odd.reason)  # "NODE is unhealthy: ..."
        else:
            lines.append(f"odd one out: {odd.reason}")
    for view in snapshot.nodes:
        if view.sample and view.sample.gpu_error:
            lines.append(f"{view.node}: GPUs not read: {view.sample.gpu_error}")
        if view.sample and view.sample.job_error:
            lines.append(f"{view.node}: job not read: {view.sample.job_error}")
    return lines


def plain(snapshot: Snapshot, per_gpu: bool) -> str:
    out = [header(snapshot)]
    headers, rows = node_table(snapshot)
    out.append(table(headers, rows))
    if per_gpu:
        rows = gpu_rows(snapshot)
        out.append(table(GPU_HEADERS, rows) if rows else "no GPUs")
    out += footer(snapshot)
    return "\n".join(out)


def shown(text: str, style: str = "") -> Text:
    """Text for rich as it is, never read as markup (a GPU named ``[/bold]`` is shown so, not
    obeyed), its control characters made visible."""
    from rich.text import Text

    return Text(visible(text), style=style)


def live_view(snapshot: Snapshot, per_gpu: bool) -> Group:
    """The snapshot as rich renderables: down nodes in red, odd ones in yellow. Every string
    goes in through ``shown``: rich reads a plain ``str`` cell as markup."""
    from rich.console import Group
    from rich.table import Table

    odd_nodes = {odd.node for odd in snapshot.odd}
    sick = unhealthy(snapshot)
    nodes = Table(box=None, header_style="bold", pad_edge=False)
    headers, rows = node_table(snapshot)
    for name in headers:
        nodes.add_column(name, no_wrap=True)
    for view, row in zip(snapshot.nodes, rows):
        style = ""
        if not view.up or view.node in sick:
            style = "red"
        elif view.node in odd_nodes:
            style = "yellow"
        nodes.add_row(*[shown(cell) for cell in row], style=style)
    parts: list[object] = [shown(header(snapshot), "bold"), nodes]
    if per_gpu:
        gpus = Table(box=None, header_style="bold", pad_edge=False)
        for name in GPU_HEADERS:
            gpus.add_column(name, no_wrap=True)
        for row in gpu_rows(snapshot):
            gpus.add_row(*[shown(cell) for cell in row])
        parts.append(gpus if gpus.row_count else shown("no GPUs"))
    for line in footer(snapshot):
        parts.append(shown(line, "yellow" if line.startswith("odd one out") else "red"))
    return Group(*parts)  # type: ignore[arg-type]


def watch_live(watch: Watch, per_gpu: bool) -> None:
    """Redraw in place until Ctrl-C (rich restores the terminal on the way out)."""
    from rich.live import Live

    with Live(auto_refresh=False, screen=False, transient=False) as live:
        while True:
            started = time.monotonic()
            live.update(live_view(watch.snapshot(), per_gpu), refresh=True)
            time.sleep(max(0.0, watch.interval - (time.monotonic() - started)))


def watch_plain(watch: Watch, per_gpu: bool) -> None:
    """Off a terminal: one plain snapshot after another (as ``top -b``), until Ctrl-C."""
    while True:
        started = time.monotonic()
        say(plain(watch.snapshot(), per_gpu) + "\n")
        sys.stdout.flush()
        time.sleep(max(0.0, watch.interval - (time.monotonic() - started)))


def interval_flag(text: str) -> float:
    try:
        seconds = float(text)
    except ValueError:
        seconds = 0.0
    if not seconds >= MIN_INTERVAL:
        raise UsageError(f"--interval {text!r}: expected seconds, at least {MIN_INTERVAL}")
    return seconds


@task(help=helps("hostfile", "session", "workdir", "include", "exclude", **TOP_HELP))
def top(
    context: Context,
    hostfile: str | None = None,
    session: str | None = None,
    workdir: str | None = None,
    include: str | None = None,
    exclude: str | None = None,
    interval: str = "2",
    gpus: bool = False,
    once: bool = False,
    json: bool = False,
    format: str = "text",
) -> None:
    """Every node live: CPU, memory, load, network, GPUs, the job's ranks; the odd one out marked.

    One row per node, refreshed every --interval seconds until Ctrl-C; a node that goes down is
    shown as down, with why, until it answers again. Nothing keeps running on the nodes after.
    """
    from ...ops import top as op
    from ...ops.pool import connect
    from ...ops.top_prometheus import prometheus

    with reported():
        seconds = interval_flag(interval)
        if format not in FORMATS:
            raise UsageError(f"--format {format!r}: expected one of {', '.join(FORMATS)}")
        watched = op.target(conf(), hostfile, session, workdir, include, exclude)
        with connect(conf(), watched.hostfile, watched.hosts, watched.python) as pool:
            if not (once or json or format != "text"):
                watch = op.Watch(pool, watched.hosts, watched.job, seconds)
                if sys.stdout.isatty():
                    watch_live(watch, gpus)
                watch_plain(watch, gpus)
            snapshot = op.snapshot(pool, watched.hosts, watched.job)
        if json or format == "json":
            print(jsonlib.dumps(snapshot.as_json()))
        elif format == "prometheus":
            relay(prometheus(snapshot), end="")  # labels quote nodes: visible on a terminal
        elif sys.stdout.isatty():
            from rich.console import Console

            Console().print(live_view(snapshot, gpus))
        else:
            say(plain(snapshot, gpus))
    if not all(view.up for view in snapshot.nodes):
        raise Exit(code=1)
