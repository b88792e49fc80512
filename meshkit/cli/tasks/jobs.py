"""``train``, ``status``, ``logs``, ``stop`` and ``demo``: jobs in tmux on every node."""

from __future__ import annotations

import datetime
import json as jsonlib
import os
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

from invoke.context import Context
from invoke.exceptions import Exit
from invoke.tasks import task

from ... import job as jobs
from ... import tmux
from ...errors import JobError, LaunchError, MeshkitError
from ...hostfile import Host
from ...job import Job
from ..common import helps, int_option, option, progress, reported, table
from .mesh import ssh_settings

PORT_SCAN = 20  # ports tried after the derived one when it is busy on the master


def _saved(workdir: str, session: str) -> Job:
    path = jobs.job_file(workdir, session)
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        raise JobError(f"no saved job at {path}; start one with: meshkit train --cmd CMD") from None
    return jobs.from_json(text, str(path))


def _workdir(c: Context, flag: str | None) -> str:
    return os.path.abspath(option(c, "workdir", flag) or os.getcwd())


def _load_job(c: Context, workdir: str | None, session: str | None) -> Job:
    return _saved(_workdir(c, workdir), jobs.check_session(option(c, "session", session)))


def _new_job(
    c: Context,
    cmd: str,
    workdir: str | None,
    session: str | None,
    hostfile: str | None,
    nproc_per_node: str | None,
    include: str | None,
    exclude: str | None,
) -> tuple[Job, list[Host]]:
    """A job from flags and config, with the hosts it runs on (read once, also for the port)."""
    from ...config import settings
    from ...discovery import read_hosts
    from ...topology import derive_master_port

    conf = settings(c.config)
    name = jobs.check_session(option(c, "session", session))
    path = os.path.abspath(option(c, "hostfile", hostfile))
    chosen = (option(c, "include", include), option(c, "exclude", exclude))
    hosts = read_hosts(path, *chosen)
    job = Job(
        cmd=cmd,
        workdir=_workdir(c, workdir),
        session=name,
        hostfile=path,
        python=str(conf.python or sys.executable),
        master_port=int_option(c, "master_port", None) or derive_master_port(hosts, name),
        nproc_per_node=int_option(c, "nproc_per_node", nproc_per_node, allow_auto=True),
        include=chosen[0],
        exclude=chosen[1],
        setup=tuple(str(line) for line in conf.setup or ()),
        env={str(k): str(v) for k, v in dict(conf.env or {}).items()},
    )
    return job, hosts


def _hosts_of(job: Job) -> list[Host]:
    from ...discovery import read_hosts

    return read_hosts(job.hostfile, job.include, job.exclude)


def preflight(
    cluster: Any, agents: dict[Host, Any], job: Job, hosts: Sequence[Host]
) -> tuple[list[str], dict[str, Any]]:
    """Read-only checks on every node, each through a node agent opened here (one exec per node
    for the whole launch): the interpreter and workdir exist, and `meshkit env` there gives exactly
    its hostfile rank and the same master and node count as everyone else. The master also probes
    the master port (and the next few). Returns the problems and that probe."""
    from ...errors import AgentGone
    from ...remote import Agent, failed, succeeded

    argv = tmux.meshkit_argv(job, "env", "--json")
    ports = [p for p in range(job.master_port, job.master_port + PORT_SCAN + 1) if p <= 65535]

    def check(r: Any) -> tuple[dict[str, Any], dict[str, Any] | None]:
        agents[r.host] = agent = Agent(r, job.python)
        try:
            env = agent.call("env", cwd=job.workdir, argv=argv)
            probe = (
                agent.call("port-free", session=job.session, ports=ports)
                if r.host == hosts[0]
                else None
            )
        except AgentGone as gone:
            raise LaunchError(_explain(gone.code, gone.err, job)) from None
        return env, probe

    results = cluster.each("preflight", check)
    problems = [f"{h.label}: cannot connect: {e}" for h, e in cluster.failures.items()]
    problems += [f"{h.label}: {e}" for h, e in failed(results).items()]
    seen: dict[tuple[str, str, str], list[str]] = {}
    probe: dict[str, Any] = {}
    for rank, host in enumerate(hosts):
        if host not in succeeded(results):
            continue
        env, port_probe = succeeded(results)[host]
        probe = port_probe or probe
        if env["code"] != 0:
            problems.append(f"{host.label}: {_explain(env['code'], env['err'], job)}")
            continue
        data = jsonlib.loads(env["out"])
        if data["NODE_RANK"] != str(rank):
            problems.append(
                f"{host.label}: is line {host.lineno} of {job.hostfile} (rank {rank}) but discovers "
                f"NODE_RANK={data['NODE_RANK']} via {data['matched']}; the hostfile does not name this "
                "node as it sees itself"
            )
        seen.setdefault((data["NNODES"], data["MASTER_ADDR"], data["MASTER_PORT"]), []).append(
            host.label
        )
    if len(seen) > 1:
        problems.append(
            "nodes disagree on NNODES/MASTER_ADDR/MASTER_PORT: "
            + "; ".join(f"{'/'.join(k)} on {', '.join(v)}" for k, v in seen.items())
        )
    return problems, probe


def _explain(code: int, err: str, job: Job) -> str:
    text = err.strip().splitlines()[-1] if err.strip() else f"exit {code}"
    if code == 127 or (job.python in text and "No such file" in text):
        return f"interpreter {job.python} not found; install meshkit at the same path there or set meshkit.python"
    if "cd:" in text:
        return f"workdir {job.workdir} is missing (it must be on storage every node shares)"
    return text.removeprefix("meshkit: ")


def pick_port(probe: dict[str, Any], job: Job, master: Host) -> tuple[int, str | None]:
    """The derived port if free, or held by this very session (replacing it frees the port), else
    the next free one, which every node is then given."""
    ports = probe["ports"]
    if ports[0]["free"] or probe["ours"]:
        return job.master_port, None
    free = [p["port"] for p in ports if p["free"]]
    if not free:
        raise LaunchError(
            f"ports {ports[0]['port']}..{ports[-1]['port']} are all busy on the master "
            f"{master.label}; pass --master-port"
        )
    return free[
        0
    ], f"master port {job.master_port} is busy on {master.label}; using {free[0]} on every node"


def _status_rows(
    cluster: Any, job: Job, hosts: Sequence[Host], quiet: bool = False
) -> list[dict[str, Any]]:
    from ...remote import succeeded

    def one(r: Any) -> dict[str, Any]:
        rank = hosts.index(r.host)
        code, out, err = r.run(
            tmux.command(tmux.node_op(job, "status", job.session, job.log(rank), job.state_dir))
        )
        if code != 0:
            raise LaunchError(err.strip()[-200:] or f"status exited {code}")
        return dict(jsonlib.loads(out))

    results = cluster.each("status", one, quiet=quiet)
    failures = {**cluster.failures, **{h: o.error for h, o in results.items() if o.error}}
    ok = succeeded(results)
    rows = []
    for rank, h in enumerate(hosts):
        data = ok.get(h) or {
            "state": "absent",
            "exit_code": None,
            "started": None,
            "last_line": f"unreachable: {failures.get(h, 'unknown')}",
        }
        started = data["started"]
        rows.append(
            {
                "node_rank": rank,
                "host": h.label,
                "state": data["state"],
                "exit_code": data["exit_code"],
                "started": datetime.datetime.fromtimestamp(
                    started, datetime.timezone.utc
                ).isoformat()
                if started
                else None,
                "last_line": data["last_line"],
            }
        )
    return rows


def _print_status(rows: Sequence[dict[str, Any]]) -> None:
    print(
        table(
            ["rank", "host", "state", "exit", "started", "last line"],
            [
                (
                    r["node_rank"],
                    r["host"],
                    r["state"],
                    r["exit_code"],
                    (r["started"] or "")[:19],
                    (r["last_line"] or "")[:70],
                )
                for r in rows
            ],
        )
    )


def _cluster(c: Context, job: Job, hosts: Sequence[Host], wait: float = 0.0) -> Any:
    from ...remote import Cluster

    cluster = Cluster(hosts, ssh_settings(c, job.hostfile), progress=progress)
    if wait:
        cluster.wait_for(wait)
    return cluster


def launch(
    c: Context, job: Job, hosts: Sequence[Host], *, wait: float = 0.0, dry_run: bool = False
) -> Job:
    """Preflight everywhere (read-only), save the job, then replace the session on every node;
    both phases go through one node agent per node."""
    agents: dict[Host, Any] = {}
    with _cluster(c, job, hosts, wait) as cluster:
        try:
            return _launch(cluster, agents, job, hosts, dry_run)
        finally:
            for agent in agents.values():
                agent.close()


def _launch(
    cluster: Any, agents: dict[Host, Any], job: Job, hosts: Sequence[Host], dry_run: bool
) -> Job:
    from dataclasses import replace

    from ...remote import failed, succeeded

    problems, probe = preflight(cluster, agents, job, hosts)
    if problems:
        raise LaunchError([*problems, "train: preflight failed; nothing was started"])
    port, note = pick_port(probe, job, hosts[0])
    job = replace(job, master_port=port)
    if note:
        print(note)
    if dry_run:
        print(f"would run in tmux session {job.session!r} on {len(hosts)} nodes, in {job.workdir}:")
        print(tmux.command(tmux.new_session(job)))
        return job
    master = cluster.remotes[hosts[0]]
    master.ensure_dir(str(job.home.parent), 0o755)
    master.ensure_dir(str(job.home), 0o755)
    master.write_atomic(str(jobs.job_file(job.workdir, job.session)), job.to_json(), 0o644)
    argv = tmux.new_session(job)

    def start(r: Any) -> dict[str, Any]:
        result = dict(
            agents[r.host].call("start", session=job.session, state_dir=job.state_dir, argv=argv)
        )
        if not result["started"]:
            raise LaunchError(str(result["error"]))
        return result

    results = cluster.each("start", start)
    bad = failed(results)
    rows = [
        (
            rank,
            h.label,
            "running" if succeeded(results).get(h, {}).get("running") else "NOT RUNNING",
            bad.get(h, ""),
        )
        for rank, h in enumerate(hosts)
    ]
    print(table(["rank", "host", "state", "error"], rows))
    if bad:
        raise LaunchError(
            ["train: some nodes did not start (see above); `meshkit stop` ends the others"]
        )
    print(
        f"\nlogs: meshkit logs --session {job.session}   status: meshkit status --session {job.session}"
    )
    return job


TRAIN_FLAGS = ("hostfile", "session", "include", "exclude")


@task(
    help=helps(
        *TRAIN_FLAGS,
        "nproc_per_node",
        cmd="command to run on every node (bash; $NODE_RANK etc. "
        "expand there); without it, relaunch the saved job",
        workdir="directory on shared storage to run in; logs go to WORKDIR/.meshkit/SESSION/",
        wait="seconds to wait for unreachable (rebooting) nodes before giving up",
        dry_run="run the preflight and show the command; start nothing",
    )
)
def train(
    c: Context,
    cmd: str | None = None,
    workdir: str | None = None,
    session: str | None = None,
    hostfile: str | None = None,
    nproc_per_node: str | None = None,
    wait: float = 0.0,
    dry_run: bool = False,
    include: str | None = None,
    exclude: str | None = None,
) -> None:
    """Start CMD detached in tmux on every node, each with its rank variables; or relaunch the saved job.

    Preflight first (every node reachable, interpreter present, ranks 0..N-1 matching the hostfile,
    one master and port): any failure starts nothing. After a reboot, `meshkit train` alone
    relaunches the saved job from any node.
    """
    with reported():
        if cmd is None:
            job = _load_job(c, workdir, session)
            hosts = _hosts_of(job)
            print(f"relaunching saved job {job.session!r}: {job.cmd}")
        else:
            job, hosts = _new_job(
                c, cmd, workdir, session, hostfile, nproc_per_node, include, exclude
            )
        launch(c, job, hosts, wait=float(wait), dry_run=dry_run)


@task(help=helps("session", "json", "workdir"))
def status(
    c: Context, session: str | None = None, workdir: str | None = None, json: bool = False
) -> None:
    """Per node: rank, host, state (running / exited / absent), exit code, start time, last log line."""
    with reported():
        job = _load_job(c, workdir, session)
        hosts = _hosts_of(job)
        with _cluster(c, job, hosts) as cluster:
            rows = _status_rows(cluster, job, hosts)
    if json:
        print(jsonlib.dumps(rows))
    else:
        _print_status(rows)


class _Prefixed:
    """A stream that prefixes each complete line with the node's rank (shared lock: whole lines)."""

    lock = threading.Lock()

    def __init__(self, rank: int, out: TextIO) -> None:
        self.prefix, self.out, self.partial = f"[{rank}] ", out, ""

    def write(self, text: str) -> int:
        *lines, self.partial = (self.partial + text).split("\n")
        if lines:
            with self.lock:
                self.out.write("".join(self.prefix + line + "\n" for line in lines))
                self.out.flush()
        return len(text)

    def flush(self) -> None:
        pass


@task(
    help=helps(
        "session",
        "workdir",
        node="only this rank",
        lines="how many last lines per node (default 20)",
        follow="keep printing new lines (Ctrl-C to stop)",
    )
)
def logs(
    c: Context,
    session: str | None = None,
    node: int | None = None,
    lines: int = 20,
    follow: bool = False,
    workdir: str | None = None,
) -> None:
    """Each node's log, every line prefixed with the node's rank."""
    with reported():
        job = _load_job(c, workdir, session)
        hosts = _hosts_of(job)
        ranks = [int(node)] if node is not None else list(range(len(hosts)))
        if any(not 0 <= r < len(hosts) for r in ranks):
            raise MeshkitError(f"--node {node}: the job has ranks 0..{len(hosts) - 1}")
        chosen = [hosts[r] for r in ranks]
        with _cluster(c, job, chosen) as cluster:
            for h, err in cluster.failures.items():
                print(f"[{hosts.index(h)}] unreachable: {err}", file=sys.stderr)
            tail = ["tail", "-n", str(int(lines))] + (["-F"] if follow else [])
            cluster.each(
                "logs",
                lambda r: r.run(
                    tmux.command([*tail, job.log(hosts.index(r.host))]) + " 2>/dev/null",
                    out=_Prefixed(hosts.index(r.host), sys.stdout),
                ),
            )


@task(help=helps("session", "workdir"))
def stop(c: Context, session: str | None = None, workdir: str | None = None) -> None:
    """End the job on every node: its tmux session and every process it started (torchrun and its
    workers included), TERM then KILL; then check that nothing of it is left."""
    from ...remote import failed, succeeded

    with reported():
        job = _load_job(c, workdir, session)
        hosts = _hosts_of(job)
        with _cluster(c, job, hosts) as cluster:
            results = cluster.each(
                "stop",
                lambda r: r.run(
                    tmux.command(tmux.node_op(job, "stop", job.session, job.state_dir))
                ),
            )
        rows, leftovers = [], []
        for rank, h in enumerate(hosts):
            if h in succeeded(results):
                data = jsonlib.loads(succeeded(results)[h][1])
                left = data["left"]
                rows.append(
                    (
                        rank,
                        h.label,
                        "ended" if data["session"] else "none",
                        data["signalled"],
                        "nothing left" if not left else f"{len(left)} LEFT: {left}",
                    )
                )
                if left:
                    leftovers.append(h.label)
            else:
                error = cluster.failures.get(h) or failed(results).get(h, "?")
                rows.append((rank, h.label, "?", "?", f"unreachable: {error}"))
                leftovers.append(h.label)
        print(table(["rank", "host", "session", "signalled", "verified"], rows))
        if leftovers:
            raise Exit(f"meshkit: could not verify the job ended on: {', '.join(leftovers)}", 1)


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
    from ... import sandbox, templates
    from ...config import settings
    from .mesh import mesh

    with reported():
        conf = settings(c.config).sandbox
        print(f"== sandbox.up --nodes {nodes}")
        lay = sandbox.up(conf.dir, conf.subnet, int(nodes))
        print(table(["node", "address"], [(n.name, n.address) for n in lay.nodes]))
        print(f"\n== mesh --hostfile {lay.hostfile}")
        mesh(c, hostfile=str(lay.hostfile))
        workdir = lay.shared / "demo"
        workdir.mkdir(parents=True, exist_ok=True)
        templates.copy_to("example_train.py", workdir)
        print(
            f"\n== train (torchrun example_train.py, {nproc_per_node} per node, gloo) in {workdir}"
        )
        job, hosts = _new_job(
            c,
            "torchrun example_train.py",
            str(workdir),
            "demo",
            str(lay.hostfile),
            str(nproc_per_node),
            None,
            None,
        )
        job = launch(c, job, hosts)
        rows = _wait_done(c, job, hosts, float(timeout))
        print("\n== results (one line per rank, from each node's log)")
        results = []
        for rank in range(len(hosts)):
            log = Path(job.log(rank))
            results += [
                ln for ln in log.read_text().splitlines() if ln.startswith("meshkit-example")
            ]
        for line in sorted(results, key=lambda ln: int(ln.split("rank=")[1].split()[0])):
            print(line)
        print("\n== status")
        _print_status(rows)
        good = len(results) == len(hosts) * int(nproc_per_node) and all(
            "ok=True" in ln for ln in results
        )
        if not good or any(r["exit_code"] != 0 for r in rows):
            raise Exit(
                "meshkit: demo failed: not every rank reported a correct all_reduce (see above)", 1
            )
        print(
            f"\ndemo ok: {len(results)} ranks on {len(hosts)} nodes agreed on the all_reduce sum."
        )
        print(
            f"explore: ssh -F {lay.ssh_config} node1 | meshkit status --workdir {workdir} --session demo"
            " | meshkit sandbox.down"
        )


def _wait_done(c: Context, job: Job, hosts: Sequence[Host], timeout: float) -> list[dict[str, Any]]:
    """Poll status (one connection per node, reused) until no node is running."""
    deadline = time.monotonic() + timeout
    with _cluster(c, job, hosts) as cluster:
        while True:
            rows = _status_rows(cluster, job, hosts, quiet=True)
            if all(r["state"] != "running" for r in rows) or time.monotonic() > deadline:
                return rows
            time.sleep(1.0)
