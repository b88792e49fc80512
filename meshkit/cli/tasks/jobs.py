"""``train``, ``status``, ``logs``, ``stop`` and ``demo``: parse, call ``ops.jobs``, render."""

from __future__ import annotations

import functools
import json as jsonlib
import os
import sys
from collections.abc import Sequence

from invoke.context import Context
from invoke.exceptions import Exit

from ...errors import LaunchError, UsageError
from ...job import Job
from ...ops import jobs as ops
from ...ops import lookup
from ...ops.diagnose import Diagnosis, spans
from ...ops.pool import connect
from ..common import HELP, conf, helps, progress, reported, table, task

JOB_FLAGS = ("hostfile", "session", "workdir")


def _print_start(launch: ops.Launch) -> None:
    rows = [(r.node_rank, r.host, r.state, ", ".join(r.replaced), r.error) for r in launch.rows]
    print(table(["rank", "host", "state", "replaced", "error"], rows))


def render_status(rows: Sequence[ops.StatusRow], job: Job) -> str:
    out = [f"job {job.label} (tmux session {job.tmux_session})"]
    if rows and rows[0].supervised:
        r = rows[0]
        if r.supervisor is None:
            out.append(f"supervisor: none (restarts {job.restarts})")
        elif r.supervisor == "not responding":
            out.append(f"supervisor: not responding: {r.last_restart_reason}")
        else:
            lead = f" (leader: node {r.leader})" if r.leader is not None else ""
            last = f", last restart: {r.last_restart_reason}" if r.last_restart_reason else ""
            attempt = f"attempt {r.attempt} of {job.restarts + 1}, restarts left {r.restarts_left}"
            out.append(f"supervisor: {r.supervisor}{lead}, {attempt}{last}")
            out += [f"relaunch held by {r.held}"] if r.held else []
    cells = []
    for r in rows:
        quiet = f"yes ({r.idle_s:.0f}s quiet)" if r.stalled and r.idle_s else "no"
        when, last = (r.started or "")[:19], (r.last_line or "")[:70]
        cells.append((r.node_rank, r.host, r.state, r.exit_code, when, quiet, last))
    out.append(table(["rank", "host", "state", "exit", "started", "stalled", "last line"], cells))
    if rows and rows[0].diagnosis:
        out.append(f"diagnosis saved before the stall restart: {rows[0].diagnosis}")
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
    stall_after="no output from any rank for this long is a stall (90s, 30m, 1h; default config "
    "stall_after, 30m; off)",
    restart_on_stall="with --restarts: a stall restarts the job (its diagnosis is saved first)",
    sync="copy the workdir to every node (default: when some node does not see it)",
    spawn=HELP["spawn"] + " (a bare relaunch keeps it)",
    replace="end any other meshkit job running on the nodes (never done without this flag)",
    dry_run="run the preflight and show what would start; start nothing",
    doctor="also run the doctor's quick checks (interfaces, master port, node-to-node TCP, "
    "versions, workdir, clocks) in preflight; any failure starts nothing",
)


@task(help=TRAIN_HELP)
def train(
    c: Context,
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
) -> None:
    """Start CMD detached in tmux on every node, each with its rank variables; or relaunch the
    saved job.

    Preflight first (every node reachable, interpreter present, ranks 0..N-1 matching the hostfile,
    one master and port, no other meshkit job running): any failure starts nothing. After a reboot,
    `meshkit train` alone relaunches the saved job from any node and any directory.
    """
    flags = {k: v for k, v in locals().items() if k != "c"}  # each is an Options field
    from ...ops import train as op
    from .doctor import render

    with reported():
        if not 0 <= float(wait) <= 86400:
            raise UsageError(f"--wait {wait}: expected seconds between 0 and 86400")
        # a flag not given keeps the saved job's setting (there is no --no-restart-on-stall)
        given = {"restart_on_stall": restart_on_stall or None, "wait": float(wait)}
        options = lookup.Options(**{**flags, **given})
        job, hosts = op.plan(conf(), options)
        if cmd is None:
            print(f"relaunching saved job {job.label}: {job.cmd}")
        result = op.train(conf(), job, hosts, options, progress)
        if result.lacking:
            lacking = ", ".join(result.lacking)
            print(f"workdir {job.workdir} is not shared with {lacking}: syncing it")
        if result.doctor is not None:
            if not result.doctor.ok:
                print(render(result.doctor))
                lines = []
                for f in result.doctor.failures:
                    peer = f" -> {f.peer}" if f.peer else ""
                    lines.append(f"{f.node}{peer}: {f.check}: {f.detail}; fix: {f.fix}")
                raise LaunchError([*lines, "train --doctor: checks failed; nothing was started"])
            print(f"doctor: {len(result.doctor.checks)} quick checks passed")
        launch = result.launch
        assert launch is not None  # only None when the doctor failed, above
        for host, count in (launch.synced or {}).items():
            print(f"synced {count} changed files to {host}")
        if launch.note:
            print(launch.note)
        if launch.dry_run:
            spec, label = launch.job.node_job(), f"{launch.job.label} on {len(hosts)} nodes"
            print(f"would start {label} (tmux {spec.tmux_session}):")
            print("  " + " ".join(spec.argv))
            return
        _print_start(launch)
        if not launch.ok:
            why = "some nodes did not start (see above); `meshkit stop` ends the others"
            raise LaunchError(f"train: {why}")
        if result.supervisor is not None:
            sup = result.supervisor
            print(f"supervisors: tmux session {sup.tmux_session} on every node, logs {sup.log}")
        where = f"--hostfile {launch.job.hostfile} --session {launch.job.session}"
        print(f"\nstatus: meshkit status {where}   logs: meshkit logs {where}")


@task(help=helps(*JOB_FLAGS, log="append output to this file", rank="this node's rank"))
def supervise(
    c: Context,
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
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)

    def say(message: str) -> None:
        now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        print(f"{now} {message}", flush=True)

    with reported():
        job, hosts = lookup.saved(conf(), hostfile, session, workdir)

        quiet = functools.partial(connect, conf(), job.hostfile, hosts, job.python, None)
        record = sup.run(quiet, job, hosts, int(rank), say)  # quiet: no progress lines per poll
    if record.supervisor != SupervisorState.DONE:
        raise Exit(code=1)


@task(help=helps(*JOB_FLAGS, "json"))
def status(
    c: Context,
    hostfile: str | None = None,
    session: str | None = None,
    workdir: str | None = None,
    json: bool = False,
) -> None:
    """Per node: rank, host, state (running / exited / absent), exit code, start time, last log
    line. Works from any node and any directory (the job is found through the hostfile)."""
    with reported():
        job, rows = lookup.on_saved(
            conf(), hostfile, session, workdir, ops.status_with_supervision, progress
        )
    print(jsonlib.dumps([r.as_json() for r in rows]) if json else render_status(rows, job))
    if any(r.error for r in rows):
        raise Exit(code=1)


@task(help=helps(*JOB_FLAGS, "json"))
def diagnose(
    c: Context,
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
    print(jsonlib.dumps(found.as_json()) if json else render_diagnosis(found, job))
    if not found.ok:
        raise Exit(code=1)


def render_diagnosis(d: Diagnosis, job: Job) -> str:
    """What a person reads at 3 a.m.: the state, one line per group (the outliers first, with
    their innermost frames), the ranks that could not be read, the first failure's traceback."""
    quiet = [n.idle_s for n in d.nodes if n.state == "running" and n.idle_s is not None]
    state = d.state + (f" (no output for {min(quiet):.0f}s)" if d.state == "stalled" else "")
    out = [f"job {job.label}: {state}"]
    for g in d.groups:
        odd = set(g.ranks) <= set(d.outliers)
        word = "rank" if len(g.ranks) == 1 else "ranks"
        out.append(f"{'OUTLIER ' if odd else ''}{word} {spans(g.ranks)} in {g.where}")
        out += [f"    {f}" for f in g.frames[-6:]] if odd else []
    out += [d.flight] if d.flight else []
    out += [f"rank {r.rank} on {r.node}: {r.error}" for r in d.ranks if r.error]
    out += [f"{n.host}: {n.error}" for n in d.nodes if n.error]
    f = d.first_failure
    if f is not None:
        who = "rank ?" if f.rank is None else f"rank {f.rank}"
        out.append(f"first failure: {who} on {f.node} (exit {f.exit_code}): {f.error}")
        out += [f"    {line}" for line in f.traceback]
    if not d.ranks and not f:
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
    c: Context,
    hostfile: str | None = None,
    session: str | None = None,
    workdir: str | None = None,
    node: int | None = None,
    lines: int = 20,
    follow: bool = False,
) -> None:
    """Each node's log, every line prefixed with the node's rank."""
    with reported():
        job, hosts = lookup.saved(conf(), hostfile, session, workdir)
        if node is not None and not 0 <= int(node) < len(hosts):
            raise UsageError(f"--node {node}: the job has ranks 0..{len(hosts) - 1}")
        if not 0 <= int(lines) <= 100000:
            raise UsageError(f"--lines {lines}: expected 0..100000")
        ranks = [int(node)] if node is not None else list(range(len(hosts)))
        failed = False
        with connect(conf(), job.hostfile, [hosts[r] for r in ranks], job.python, progress) as pool:
            for batch in ops.follow(pool, job, hosts, ranks, int(lines)):
                for chunk in batch:
                    for line in chunk.lines:
                        print(f"[{chunk.rank}] {line}")
                    if chunk.error:
                        failed = True
                        print(f"[{chunk.rank}] (no log: {chunk.error})", file=sys.stderr)
                sys.stdout.flush()
                if not follow:
                    break
    if failed:
        raise Exit(code=1)


@task(help=helps(*JOB_FLAGS))
def stop(
    c: Context, hostfile: str | None = None, session: str | None = None, workdir: str | None = None
) -> None:
    """End the job on every node: its tmux session and every process it started (torchrun, its
    workers, anything they detached), TERM then KILL; then check on each node that nothing of it
    is left."""
    with reported():
        stopped = lookup.on_saved(
            conf(), hostfile, session, workdir, ops.stop_with_supervisors, progress
        )[1]
    rows, left = stopped.rows, stopped.supervisor_left
    for problem in left:
        print(f"meshkit: {problem}", file=sys.stderr)
    cells = []
    for r in rows:
        ended = "?" if r.error else "ended" if r.found else "not running"
        remaining = f"{len(r.left)} LEFT: {r.left[:10]}" if r.left else "nothing left"
        verified = f"FAILED: {r.error}" if r.error else remaining
        cells.append((r.node_rank, r.host, ended, "?" if r.error else r.signalled, verified))
    print(table(["rank", "host", "job", "signalled", "verified"], cells))
    bad = [r.host for r in rows if not r.ok]
    if left:
        raise Exit("meshkit: the job's supervisor could not be ended (see above)", 1)
    if bad:
        raise Exit(f"meshkit: could not verify the job ended on: {', '.join(bad)}", 1)


@task(
    help={
        "nodes": "sandbox nodes (default 3)",
        "nproc_per_node": "processes per node (default 2)",
        "timeout": "seconds to wait for the job (default 300)",
    }
)
def demo(c: Context, nodes: int = 3, nproc_per_node: int = 2, timeout: float = 300.0) -> None:
    """sandbox.up -> mesh -> train the bundled example (torchrun, gloo, a real all_reduce) -> results.

    Needs root (the sandbox). Leaves the sandbox up to explore; `meshkit sandbox.down` removes it.
    """
    from pathlib import Path

    from ... import sandbox, templates
    from .mesh import mesh

    with reported():
        cfg = conf().sandbox
        print(f"== sandbox.up --nodes {nodes}")
        lay = sandbox.up(cfg.dir, cfg.subnet, int(nodes))
        print(table(["node", "address"], [(n.name, n.address) for n in lay.nodes]))
        print(f"\n== mesh --hostfile {lay.hostfile}")
        mesh(c, hostfile=str(lay.hostfile))
        workdir = lay.shared / "demo"
        workdir.mkdir(parents=True, exist_ok=True)
        templates.copy_to("example_train.py", workdir)
        cmd = "torchrun example_train.py"
        example = f"{cmd}, {nproc_per_node} per node, gloo"
        print(f"\n== train ({example}) in {workdir}")
        per_node = str(nproc_per_node)
        flags = lookup.Options(cmd, str(workdir), "demo", str(lay.hostfile), per_node)
        job, hosts = lookup.new_job(conf(), flags)
        with connect(conf(), job.hostfile, hosts, job.python, progress) as pool:
            launch = ops.launch(pool, job, hosts, replace=True)
            _print_start(launch)
            if not launch.ok:
                raise LaunchError("demo: the example did not start on every node")
            rows = ops.wait_done(pool, launch.job, hosts, float(timeout))
        print("\n== results (one line per rank, from each node's log)")
        results = []
        for rank in range(len(hosts)):
            text = Path(launch.job.log(rank)).read_text(errors="replace")
            results += [ln for ln in text.splitlines() if ln.startswith("meshkit-example")]
        for line in sorted(results, key=lambda ln: int(ln.split("rank=")[1].split()[0])):
            print(line)
        print("\n== status")
        print(render_status(rows, launch.job))
        expected = len(hosts) * int(nproc_per_node)
        correct = [ln for ln in results if "ok=True" in ln]
        if not len(correct) == len(results) == expected or any(r.exit_code != 0 for r in rows):
            why = "not every rank reported a correct all_reduce (see above)"
            raise Exit(f"meshkit: demo failed: {why}", 1)
        ranks = f"{len(results)} ranks on {len(hosts)} nodes"
        print(f"\ndemo ok: {ranks} agreed on the all_reduce sum.")
        watch = f"meshkit status --hostfile {lay.hostfile} --session demo"
        print(f"explore: ssh -F {lay.ssh_config} node1 | {watch} | meshkit sandbox.down")
