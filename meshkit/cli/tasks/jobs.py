"""``train``, ``status``, ``logs``, ``stop`` and ``demo``: parse, call ``ops.jobs``, render."""

from __future__ import annotations

import json as jsonlib
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from invoke.context import Context
from invoke.exceptions import Exit

from ...errors import LaunchError
from ...health import HealthState, words
from ...job import Job
from ...ops import lookup
from ...ops.pool import NodePool, connect
from ...protocol import JobState, SupervisorShown
from ..common import HEALTH_WIDTH, HELP, conf, helps, progress, reported, shorten, table, task
from ..printing import relay, say

if TYPE_CHECKING:  # every command builds the task list; only these tasks load their ops
    from contextlib import AbstractContextManager

    from ...hostfile import Host
    from ...ops import jobs as ops
    from ...ops.diagnose import Diagnosis
    from ...ops.supervision_status import SupervisionStatus

JOB_FLAGS = ("hostfile", "session", "workdir")


def _print_start(launch: ops.Launch) -> None:
    cells = []
    for row in launch.rows:
        cells.append((row.node_rank, row.host, row.state, ", ".join(row.replaced), row.error))
    say(table(["rank", "host", "state", "replaced", "error"], cells))


def supervisor_lines(shown: SupervisionStatus, job: Job) -> list[str]:
    """What the supervision of a supervised job says (``supervisor_words``, then the restarts
    left, the last restart, what holds or waits, the membership)."""
    from ...ops.supervision_status import supervisor_words

    words = supervisor_words(shown)
    if words is None and shown.no_majority:
        return [no_majority_line(shown.no_majority)]
    if words is None:
        return [f"supervisor: none (restarts {job.restarts})"]
    # without a majority, that first: the rest is only this side's view
    lines = []
    if shown.no_majority:
        lines.append(no_majority_line(shown.no_majority))
    if shown.supervisor == SupervisorShown.NOT_RESPONDING:
        lines.append(f"supervisor: {words}: {shown.last_restart_reason}")
        return lines
    last = f", last restart: {shown.last_restart_reason}" if shown.last_restart_reason else ""
    lines.append(f"supervisor: {words}, restarts left {shown.restarts_left}{last}")
    if shown.held:
        lines.append(f"relaunch held by {shown.held}")
    if shown.waiting:
        lines.append(f"waiting for {shown.waiting}")
    lines += membership_lines(shown)
    return lines


def no_majority_line(answering: str) -> str:
    """Status's word when too few of the job's nodes answer to know its membership."""
    return (
        f"no majority of the job's nodes answers ({answering}): partitioned? what follows is "
        "this side's view, and this side launches nothing"
    )


def membership_lines(shown: SupervisionStatus) -> list[str]:
    """The membership beyond the rank table: its generation, the lost nodes and who replaced
    them, and the spares (healthy or not, and why)."""
    lines = []
    if shown.generation is not None and (shown.generation > 1 or shown.spares):
        lines.append(f"membership: generation {shown.generation}")
    for line in shown.replaced:
        lines.append(f"  replaced {line}")
    if shown.lost:
        lines.append(f"  lost: {', '.join(shown.lost)}")
    for line in shown.evicted:
        lines.append(f"  evicted {line} (train --readmit NODE lets it back)")
    for line in shown.unhealthy:
        lines.append(f"  runs on {line}: no healthy spare could take its rank")
    for spare in shown.spares:
        health = "healthy" if spare.healthy else f"not healthy: {spare.why}"
        if spare.running:
            lines.append(f"  not a member, {spare.node}: {spare.why}")
            continue
        lines.append(f"  spare {spare.node}: {health}")
    return lines


def render_status(status: ops.JobStatus, job: Job) -> str:
    out = [f"job {job.label} (tmux session {job.tmux_session})"]
    shown = status.supervision
    if shown is not None:
        out += supervisor_lines(shown, job)
    from ...ops.progress_status import node_steps

    cells = []
    below = []  # why a node's row has no state: whole, below the table
    steps = any(row.progress for row in status.rows)  # a column only when ranks tell steps
    for row in status.rows:
        quiet = f"yes ({row.idle_s:.0f}s quiet)" if row.stalled and row.idle_s else "no"
        started = (row.started or "")[:19]
        last_line = (row.last_line or "")[:70]
        state: str = row.state
        if row.error and row.silent:
            # not asked, or no reply: whether the job runs there is unknown (never "absent")
            state = "unreachable"
            last_line = "(the node does not answer: see below)"
            if row.last_known:
                last_line = f"(last known: {row.last_known})"[:70]
            below.append(f"node {row.node_rank} ({row.host}) does not answer: {row.error}")
        elif row.error:
            state = "error"  # as --json says it
            last_line = "(the node's error: see below)"
            below.append(f"node {row.node_rank} ({row.host}) answered with an error: {row.error}")
        health = ""
        if row.health is not None:
            health = shorten(words(row.health), HEALTH_WIDTH)
            if row.health.state == HealthState.UNHEALTHY:
                reasons = "; ".join(row.health.reasons)
                below.append(f"node {row.node_rank} ({row.host}) is unhealthy: {reasons}")
        cell = [row.node_rank, row.host, state, row.exit_code, started, quiet, health]
        if steps:
            told = node_steps(row.progress)
            cell.append("-" if told is None else told.words())
        cells.append((*cell, last_line))
    header = ["rank", "host", "state", "exit", "started", "stalled", "health", "last line"]
    if steps:
        header.insert(-1, "step")
    out.append(table(header, cells))
    out += below
    out += [f"straggler {line}" for line in status.stragglers().lines]
    slower = status.slowdown()
    if slower is not None:
        out.append(f"slowdown: {slower.words()}")
    if shown is not None and shown.diagnosis:
        out.append(f"diagnosis saved before the stall restart: {shown.diagnosis}")
    return "\n".join(out)


NEW_JOB_FLAGS = ("hostfile", "session", "include", "exclude", "nproc_per_node", "master_port")
TRAIN_HELP = helps(
    *NEW_JOB_FLAGS,
    cmd="command to run on every node (bash; $NODE_RANK etc. expand there); without it, "
    "relaunch the saved job",
    workdir="directory on shared storage to run in (default: config, else the current "
    "directory); logs go to WORKDIR/.meshkit/SESSION/",
    wait="seconds to wait for unreachable (rebooting) nodes before giving up",
    restarts="supervise: relaunch the whole job (same ranks) up to N times when a node fails, "
    "stops answering or reboots (a supervisor runs in tmux on every node)",
    restart_on="only these exit codes restart (comma list; default any non-zero; torchrun "
    "exits 1 for any worker failure)",
    stall_after="no step (of ranks calling meshkit.progress.step), else no output, from any rank "
    "for this long is a stall (90s, 30m, 1h; default config step_stall_after 5m, stall_after 30m; "
    "off)",
    restart_on_stall="with --restarts: a stall restarts the job (its diagnosis is saved first)",
    replace_after="with --restarts: a node that does not answer this long is lost and a spare "
    "(a hostfile line marked spare) takes its rank (90s, 5m; default 300s; off: wait, then give "
    "up); given with --restarts 0, the job is supervised for lost nodes alone",
    min_nodes="with --restarts: with no healthy spare, go on without the lost nodes while at "
    "least this many are left (ranks renumbered)",
    sync="copy the workdir to every node (default: when some node does not see it)",
    spawn=HELP["spawn"] + " (a bare relaunch keeps it)",
    replace="end any other meshkit job running on the nodes (never done without this flag)",
    dry_run="run the preflight and show what would start; start nothing",
    doctor="also run the doctor's quick checks (interfaces, master port, node-to-node TCP, "
    "versions, workdir, clocks) in preflight; any failure starts nothing",
    evict="supervised: the health that puts a node out of the job, a spare taking its rank "
    "(unhealthy, the default; degraded: that too)",
    evict_after="supervised: failures of the job attributed to one node before it is evicted as "
    "a lemon (default 2; 0: never)",
    max_failed_starts="supervised: attempts in a row failing within config crash_window (5m) "
    "that end supervision (default 3; 0: never)",
    notify="supervised: run this command under bash for each event (--notify-on), the event as "
    "JSON on stdin (off: none)",
    notify_on="the event kinds --notify is told of (comma list; default failed, evicted, "
    "replaced, shrunk, gave_up, done)",
    readmit="let NODE, evicted from the saved job, be one of its nodes again (a bare train)",
    straggler_ratio="a node whose compute time per step (meshkit.progress.compute) is this much "
    "over the nodes' median for config straggler_window (1m) is a straggler (default 1.2)",
    evict_stragglers="supervised: a straggler is evicted as an unhealthy node is (a spare takes "
    "its rank)",
)


@task(help=TRAIN_HELP)
def train(
    context: Context,
    cmd: str | None = None,
    workdir: str | None = None,
    session: str | None = None,
    hostfile: str | None = None,
    nproc_per_node: str | None = None,
    master_port: str | None = None,
    wait: float = 0.0,
    replace: bool = False,
    dry_run: bool = False,
    doctor: bool = False,
    include: str | None = None,
    exclude: str | None = None,
    restarts: str | None = None,
    restart_on: str | None = None,
    sync: bool = False,
    spawn: bool = False,
    stall_after: str | None = None,
    restart_on_stall: bool = False,
    replace_after: str | None = None,
    min_nodes: str | None = None,
    evict: str | None = None,
    evict_after: str | None = None,
    max_failed_starts: str | None = None,
    notify: str | None = None,
    notify_on: str | None = None,
    readmit: str | None = None,
    straggler_ratio: str | None = None,
    evict_stragglers: bool = False,
) -> None:
    """Start CMD detached in tmux on every node, each with its rank variables; or relaunch the
    saved job.

    Preflight first (every node reachable, interpreter present, ranks 0..N-1 matching the hostfile,
    one master and port, no other meshkit job running): any failure starts nothing. After a reboot,
    `meshkit train` alone relaunches the saved job from any node and any directory.
    """
    from ...ops import train as op
    from .doctor import render

    with reported():
        options = lookup.Options(
            cmd=cmd,
            workdir=workdir,
            session=session,
            hostfile=hostfile,
            nproc_per_node=nproc_per_node,
            master_port=master_port,
            include=include,
            exclude=exclude,
            restarts=restarts,
            restart_on=restart_on,
            spawn=spawn,
            stall_after=stall_after,
            # not given keeps the saved job's setting (there is no --no-restart-on-stall)
            restart_on_stall=restart_on_stall or None,
            replace_after=replace_after,
            min_nodes=min_nodes,
            sync=sync,
            replace=replace,
            doctor=doctor,
            dry_run=dry_run,
            wait=float(wait),
            evict=evict,
            evict_after=evict_after,
            max_failed_starts=max_failed_starts,
            notify=notify,
            notify_on=notify_on,
            readmit=readmit,
            straggler_ratio=straggler_ratio,
            # not given keeps the saved job's setting (there is no --no-evict-stragglers)
            evict_stragglers=evict_stragglers or None,
        )
        lookup.check_options(options)
        job, hosts = op.plan(conf(), options)
        if cmd is None:
            say(f"relaunching saved job {job.label}: {job.cmd}")
        result = op.train(conf(), job, hosts, options, progress)
        if result.lacking:
            lacking = ", ".join(result.lacking)
            say(f"workdir {job.workdir} is not shared with {lacking}: syncing it")
        if result.doctor is not None:
            if not result.doctor.ok:
                say(render(result.doctor))
                lines = []
                for failure in result.doctor.failures:
                    peer = f" -> {failure.peer}" if failure.peer else ""
                    check = f"{failure.check}: {failure.detail}; fix: {failure.fix}"
                    lines.append(f"{failure.node}{peer}: {check}")
                raise LaunchError([*lines, "train --doctor: checks failed; nothing was started"])
            say(f"doctor: {len(result.doctor.checks)} quick checks passed")
        launch = result.launch
        assert launch is not None  # only None when the doctor failed, above
        for host, count in (launch.synced or {}).items():
            say(f"synced {count} changed files to {host}")
        if launch.note:
            say(launch.note)
        if launch.dry_run:
            spec = launch.job.node_job()
            label = f"{launch.job.label} on {len(hosts)} nodes"
            say(f"would start {label} (tmux {spec.tmux_session}):")
            say("  " + " ".join(spec.argv))
            return
        _print_start(launch)
        if not launch.ok:
            why = "some nodes did not start (see above); `meshkit stop` ends the others"
            raise LaunchError(f"train: {why}")
        if result.supervisor is not None:
            sup = result.supervisor
            say(f"supervisors: tmux session {sup.tmux_session} on every node, logs {sup.log}")
        where = f"--hostfile {launch.job.hostfile} --session {launch.job.session}"
        say(f"\nstatus: meshkit status {where}   logs: meshkit logs {where}")


@task(help=helps(*JOB_FLAGS, log="append output to this file", rank="this node's rank"))
def supervise(
    context: Context,
    hostfile: str | None = None,
    session: str | None = None,
    workdir: str | None = None,
    log: str | None = None,
    rank: int = 0,
) -> None:
    """(Started by `train --restarts`, in tmux on every node.) Watch the saved job and relaunch
    it on failure when this node's supervisor leads, as `train --restarts` describes."""
    import datetime

    from ...ops import supervise as sup
    from ...protocol import SupervisorState

    if log:
        descriptor = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(descriptor, 1)
        os.dup2(descriptor, 2)
        os.close(descriptor)

    def say(message: str) -> None:
        now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        print(f"{now} {message}", flush=True)

    with reported():
        job, hosts = lookup.saved(conf(), hostfile, session, workdir)
        cluster = lookup.cluster_hosts(job)

        def quiet(nodes: Sequence[Host], wait: float) -> AbstractContextManager[NodePool]:
            """A connection to ``nodes``, with no progress lines (one per poll would flood)."""
            return connect(conf(), job.hostfile, nodes, job.python, None, wait)

        record = sup.run(quiet, job, hosts, int(rank), say, cluster)
    if record.supervisor not in (SupervisorState.DONE, SupervisorState.STOPPED):
        raise Exit(code=1)


@task(help=helps(*JOB_FLAGS, "json"))
def status(
    context: Context,
    hostfile: str | None = None,
    session: str | None = None,
    workdir: str | None = None,
    json: bool = False,
) -> None:
    """Per node: rank, host, state (running / exited / absent), exit code, start time, last log
    line. Works from any node and any directory (the job is found through the hostfile)."""
    from ...ops import jobs as ops

    with reported():
        job, found = lookup.on_saved(
            conf(), hostfile, session, workdir, ops.job_status, progress, True
        )
    if json:
        print(jsonlib.dumps(found.as_json()))
    else:
        say(render_status(found, job))
    if any(row.error for row in found.rows):
        raise Exit(code=1)


@task(help=helps(*JOB_FLAGS, "json"))
def diagnose(
    context: Context,
    hostfile: str | None = None,
    session: str | None = None,
    workdir: str | None = None,
    json: bool = False,
) -> None:
    """Where every rank of the job is: its live Python stack (py-spy), ranks grouped by where they
    stand, the outliers first; for a failed job, the rank that failed first and its traceback."""
    from ...ops import diagnose as op

    with reported():
        job, found = lookup.on_saved(conf(), hostfile, session, workdir, op.diagnose, progress)
    if json:
        print(jsonlib.dumps(found.as_json()))
    else:
        say(render_diagnosis(found, job))
    if not found.ok:
        raise Exit(code=1)


def render_diagnosis(diagnosis: Diagnosis, job: Job) -> str:
    """What a person reads at 3 a.m.: the state, one line per group (the outliers first, with
    their innermost frames), the ranks that could not be read, the first failure's traceback."""
    from ...ops.diagnose import spans

    state: str = diagnosis.state
    if diagnosis.state == "stalled":
        quiet = []
        for node in diagnosis.nodes:
            if node.state == JobState.RUNNING and node.idle_s is not None:
                quiet.append(node.idle_s)
        state += f" (no output for {min(quiet):.0f}s)"
    out = [f"job {job.label}: {state}"]
    for group in diagnosis.groups:
        outlier = set(group.ranks) <= set(diagnosis.outliers)
        word = "rank" if len(group.ranks) == 1 else "ranks"
        mark = "OUTLIER " if outlier else ""
        out.append(f"{mark}{word} {spans(group.ranks)} in {group.where}")
        if outlier:
            out += [f"    {frame}" for frame in group.frames[-6:]]
    if diagnosis.flight:
        out.append(diagnosis.flight)
    for rank in diagnosis.ranks:
        if rank.error:
            out.append(f"rank {rank.rank} on {rank.node}: {rank.error}")
    for node in diagnosis.nodes:
        if node.error:
            out.append(f"{node.host}: {node.error}")
    failure = diagnosis.first_failure
    if failure is not None:
        who = "rank ?" if failure.rank is None else f"rank {failure.rank}"
        where = f"{who} on {failure.node} (exit {failure.exit_code})"
        out.append(f"first failure: {where}: {failure.error}")
        out += [f"    {line}" for line in failure.traceback]
    if not diagnosis.ranks and not failure:
        out.append("no rank is running (meshkit status, meshkit logs)")
    return "\n".join(out)


@task(
    help=helps(
        *JOB_FLAGS,
        node="only this rank",
        lines="how many last lines per node (default 20)",
        follow="keep printing new lines (Ctrl-C to stop)",
    )
)
def logs(
    context: Context,
    hostfile: str | None = None,
    session: str | None = None,
    workdir: str | None = None,
    node: int | None = None,
    lines: int = 20,
    follow: bool = False,
) -> None:
    """Each node's log, every line prefixed with the node's rank."""
    from ...ops import jobs as ops

    with reported():
        job, hosts = lookup.saved(conf(), hostfile, session, workdir)
        lookup.check_log_flags(node, lines, len(hosts))
        ranks = [int(node)] if node is not None else list(range(len(hosts)))
        failed = False
        chosen = [hosts[rank] for rank in ranks]
        with connect(conf(), job.hostfile, chosen, job.python, progress) as pool:
            for batch in ops.follow(pool, job, hosts, ranks, int(lines)):
                for chunk in batch:
                    for line in chunk.lines:
                        relay(f"[{chunk.rank}] {line}")
                    if chunk.error:
                        failed = True
                        say(f"[{chunk.rank}] (no log: {chunk.error})", sys.stderr)
                sys.stdout.flush()
                if not follow:
                    break
    if failed:
        raise Exit(code=1)


@task(help=helps(*JOB_FLAGS, "json"))
def stop(
    context: Context,
    hostfile: str | None = None,
    session: str | None = None,
    workdir: str | None = None,
    json: bool = False,
) -> None:
    """End the job on every node: its tmux session and every process it started (torchrun, its
    workers, anything they detached), TERM then KILL; then check on each node that nothing of it
    is left. A node it cannot reach is named, with what happens there."""
    from ...ops import jobs as ops

    with reported():
        stopped = lookup.on_saved(
            conf(), hostfile, session, workdir, ops.stop_with_supervisors, progress, True
        )[1]
    if json:
        print(jsonlib.dumps(stopped.as_json()))
    else:
        for problem in stopped.supervisor_left:
            say(f"meshkit: {problem}", sys.stderr)
        say(render_stop(stopped))
    bad = [row.host for row in stopped.rows if not row.ok]
    if stopped.supervisor_left:
        raise Exit("meshkit: the job's supervisor could not be ended (see above)", 1)
    if bad:
        raise Exit(f"meshkit: could not verify the job ended on: {', '.join(bad)}", 1)


def render_stop(stopped: ops.Stopped) -> str:
    cells = []
    for row in stopped.rows:
        if row.error:
            ended = "?"
            signalled: int | str = "?"
            verified = f"FAILED: {row.error}"
        else:
            ended = "ended" if row.found else "not running"
            signalled = row.signalled
            verified = f"{len(row.left)} LEFT: {row.left[:10]}" if row.left else "nothing left"
        cells.append((row.node_rank, row.host, ended, signalled, verified))
    out = [table(["rank", "host", "job", "signalled", "verified"], cells)]
    for node in stopped.unreached:
        out.append(f"node {node.node_rank} ({node.host}) could not be asked: {node.then}")
    return "\n".join(out)


def rank_of(result_line: str) -> int:
    """The global rank an example's result line names (``... rank=3 ...``)."""
    after = result_line.split("rank=")[1]
    return int(after.split()[0])


@task(
    help={
        "nodes": "sandbox nodes (default 3)",
        "nproc_per_node": "processes per node (default 2)",
        "timeout": "seconds to wait for the job (default 300)",
    }
)
def demo(context: Context, nodes: int = 3, nproc_per_node: int = 2, timeout: float = 300.0) -> None:
    """sandbox.up -> mesh -> train the bundled example (torchrun, gloo, an all_reduce) -> results.

    Needs root (the sandbox). Leaves the sandbox up to explore; `meshkit sandbox.down` removes it.
    """
    from pathlib import Path

    from ... import sandbox, templates
    from ...ops import jobs as ops
    from .mesh import mesh

    with reported():
        settings = conf().sandbox
        say(f"== sandbox.up --nodes {nodes}")
        layout = sandbox.up(settings.dir, settings.subnet, int(nodes))
        addresses = [(node.name, node.address) for node in layout.nodes]
        say(table(["node", "address"], addresses))
        say(f"\n== mesh --hostfile {layout.hostfile}")
        mesh(context, hostfile=str(layout.hostfile))
        workdir = layout.shared / "demo"
        workdir.mkdir(parents=True, exist_ok=True)
        templates.copy_to("example_train.py", workdir)
        cmd = "torchrun example_train.py"
        example = f"{cmd}, {nproc_per_node} per node, gloo"
        say(f"\n== train ({example}) in {workdir}")
        flags = lookup.Options(
            cmd=cmd,
            workdir=str(workdir),
            session="demo",
            hostfile=str(layout.hostfile),
            nproc_per_node=str(nproc_per_node),
        )
        job, hosts = lookup.new_job(conf(), flags)
        with connect(conf(), job.hostfile, hosts, job.python, progress) as pool:
            launch = ops.launch(pool, job, hosts, replace=True)
            _print_start(launch)
            if not launch.ok:
                raise LaunchError("demo: the example did not start on every node")
            rows = ops.wait_done(pool, launch.job, hosts, float(timeout))
        say("\n== results (one line per rank, from each node's log)")
        results = []
        for rank in range(len(hosts)):
            text = Path(launch.job.log(rank)).read_text(errors="replace")
            results += [line for line in text.splitlines() if line.startswith("meshkit-example")]
        for line in sorted(results, key=rank_of):
            say(line)
        say("\n== status")
        say(render_status(ops.JobStatus(rows), launch.job))
        expected = len(hosts) * int(nproc_per_node)
        correct = [line for line in results if "ok=True" in line]
        every_rank_correct = len(correct) == len(results) == expected
        every_node_exited_0 = all(row.exit_code == 0 for row in rows)
        if not every_rank_correct or not every_node_exited_0:
            why = "not every rank reported a correct all_reduce (see above)"
            raise Exit(f"meshkit: demo failed: {why}", 1)
        ranks = f"{len(results)} ranks on {len(hosts)} nodes"
        say(f"\ndemo ok: {ranks} agreed on the all_reduce sum.")
        watch = f"meshkit status --hostfile {layout.hostfile} --session demo"
        say(f"explore: ssh -F {layout.ssh_config} node1 | {watch} | meshkit sandbox.down")
