"""Sandbox: supervised jobs end to end, a supervisor on each real sshd node, torch with gloo.

Supervised jobs on the sandbox (real sshd, tmux, torch with gloo under torchrun and --spawn), a
supervisor on every node: a killed worker and a rebooted node (node 0, where the job was
launched, included) each restart the whole job with the same ranks, which then completes; a
relaunch waits while a doctor's check fails, and its leader killed meanwhile leaves exactly one
relaunch; exhausted restarts leave a record that says why; stop ends every supervisor first."""

from __future__ import annotations

import contextlib
import functools
import json
from pathlib import Path

from helpers import sandbox_jobs
from helpers.sandbox_jobs import (
    RESULT,
    check_results,
    job_processes,
    on_node,
    supervisor_said,
    wait_for,
)

from meshkit import sandbox

SANDBOX_NODES = 3
NPROC = 1  # one rank a node: several local ranks are test_train's part (sandbox_jobs.NPROC)
FREEZER = Path("/sys/fs/cgroup/freezer")


def torch_job(session: str, spawn: bool = False) -> str:
    """The example job, under torchrun (or started by ``meshkit run --spawn``). Its first attempt
    sleeps 25 s after the all_reduce, so it still runs when the test ends a worker or reboots a
    node; the test then writes ``SESSION.sleep`` (0), so a relaunch ends once every rank has
    reported."""
    launcher = "python" if spawn else "torchrun"
    return f"{launcher} example_train.py --sleep $(cat {session}.sleep 2>/dev/null || echo 25)"


def relaunches_end(workdir: Path, session: str) -> None:
    (workdir / f"{session}.sleep").write_text("0\n")


meshed = sandbox_jobs.meshed  # the fixture: this module's sandbox, meshed, with the example


def train(lay, workdir: Path, session: str, *args: str, node: int = 0):
    out = on_node(
        lay, node, workdir, "train", "--hostfile", str(lay.hostfile), "--session", session, *args
    )
    assert out.returncode == 0, out.stdout + out.stderr
    return out


def status(lay, workdir: Path, session: str, node: int = 1) -> list[dict[str, object]]:
    out = on_node(lay, node, workdir, "status", "--session", session, "--json")
    assert out.returncode == 0, out.stdout + out.stderr
    return json.loads(out.stdout)


def status_when(lay, workdir: Path, session: str, ready):
    """The status rows once ``ready(rows)`` holds (None before, so wait_for tries again)."""
    rows = status(lay, workdir, session)
    return rows if rows and ready(rows) else None


def is_held(rows) -> bool:
    return bool(rows[0]["held"])


def took_over(workdir: Path, session: str, rank: int) -> bool:
    """Whether node ``rank``'s supervisor logged a relaunch it makes (a takeover's first word)."""
    log = workdir / ".meshkit" / session / f"supervisor-node{rank}.log"
    return log.exists() and ": relaunching" in log.read_text()


def led_by(rank: int):
    """Whether status names ``rank``'s supervisor as the leader."""
    return lambda rows: rows[0]["leader"] == rank


def supervisor_is(lay, workdir: Path, session: str, *states: str):
    """Status once its supervisor is in one of ``states`` ("done", "gave up"); asked only once a
    supervisor's log says "STATE: " (status rounds are dear, logs cheap)."""
    if not any(supervisor_said(workdir, session, f" {state}: ") for state in states):
        return None
    rows = status(lay, workdir, session)
    return rows if rows[0]["supervisor"] in states else None


def attempts(workdir: Path, session: str, rank: int) -> list[str]:
    """A node's log split at the attempt markers (logs append: every attempt is kept)."""
    log = workdir / ".meshkit" / session / f"node{rank}.log"
    if not log.exists():
        return []
    text = log.read_text()
    parts = text.split("===== meshkit: attempt ")
    return [parts[0], *("attempt " + p for p in parts[1:])]


def results_of(workdir: Path, session: str, nodes: int, attempt: int):
    found = []
    for rank in range(nodes):
        parts = attempts(workdir, session, rank)
        if len(parts) >= attempt:
            found += [(rank, m) for m in RESULT.finditer(parts[attempt - 1])]
    return found


def test_exhausted_restarts_give_up_with_the_reason_and_last_exit_codes(meshed):
    lay, workdir = meshed
    n = len(lay.nodes)
    out = train(lay, workdir, "gives", "--restarts", "1", "--cmd", "echo trying; exit 3")
    assert "supervisors: tmux session" in out.stdout
    assert "on every node" in out.stdout
    rows = wait_for(lambda: supervisor_is(lay, workdir, "gives", "gave up"), timeout=120)
    assert [r["exit_code"] for r in rows] == [3] * n
    assert [r["state"] for r in rows] == ["exited"] * n
    assert {(r["attempt"], r["restarts_left"]) for r in rows} == {(2, 0)}
    reason = str(rows[0]["last_restart_reason"])
    assert reason.startswith("no restarts left")
    assert "exited with code 3" in reason
    for rank in range(n):
        parts = attempts(workdir, "gives", rank)
        assert len(parts) == 2
        assert parts[1].startswith("attempt 2 of 2")
        # attempt 1 may have been stopped on a slower node before it printed anything
        assert "trying" in parts[1]
    text = on_node(lay, 2, workdir, "status", "--session", "gives").stdout
    assert "supervisor: gave up, attempt 2 of 2, restarts left 0" in text
    # a code outside --restart-on gives up at once, without a restart
    train(lay, workdir, "notlisted", "--restarts", "3", "--restart-on", "1,137", "--cmd", "exit 4")
    rows = wait_for(lambda: supervisor_is(lay, workdir, "notlisted", "gave up"), timeout=120)
    assert rows[0]["attempt"] == 1
    assert "not in --restart-on" in str(rows[0]["last_restart_reason"])


def test_a_killed_worker_restarts_the_whole_job_with_the_same_ranks(meshed):
    lay, workdir = meshed
    n = len(lay.nodes)
    args = ("--restarts", "2", "--nproc-per-node", str(NPROC), "--cmd", torch_job("killed"))
    train(lay, workdir, "killed", *args)
    wait_for(lambda: len(results_of(workdir, "killed", n, 1)) == n * NPROC, timeout=180)
    relaunches_end(workdir, "killed")
    rows = status(lay, workdir, "killed")
    assert rows[0]["supervisor"] == "running"
    assert rows[0]["attempt"] == 1
    victim = sandbox.node_exec(lay.nodes[1], ["pgrep", "-f", "-u", "0", "--", "-u example_train"])
    pids = victim.stdout.split()
    assert pids, victim
    sandbox.node_exec(lay.nodes[1], ["kill", "-9", pids[0]])
    rows = wait_for(lambda: supervisor_is(lay, workdir, "killed", "done", "gave up"), timeout=300)
    assert rows[0]["supervisor"] == "done", rows
    assert rows[0]["attempt"] == 2
    assert rows[0]["restarts_left"] == 1
    assert "node 1 " in str(rows[0]["last_restart_reason"])
    assert [r["exit_code"] for r in rows] == [0] * n
    # attempt 2: every rank, on the same nodes
    check_results(results_of(workdir, "killed", n, 2), n, NPROC)
    assert job_processes(lay) == []


def test_a_rebooted_node_is_relaunched_once_it_is_back(meshed):
    lay, workdir = meshed
    n = len(lay.nodes)
    # under --spawn (the others run torchrun): a supervised relaunch of spawned ranks, and no
    # launcher's torch import on every node twice
    args = ("--restarts", "1", "--nproc-per-node", str(NPROC), "--spawn")
    train(lay, workdir, "reboot", *args, "--cmd", torch_job("reboot", spawn=True))
    wait_for(lambda: len(results_of(workdir, "reboot", n, 1)) == n * NPROC, timeout=180)
    relaunches_end(workdir, "reboot")
    sandbox.reboot(lay, 2)
    rows = wait_for(lambda: supervisor_is(lay, workdir, "reboot", "done", "gave up"), timeout=300)
    assert rows[0]["supervisor"] == "done", rows
    assert rows[0]["attempt"] == 2
    assert "node 2 " in str(rows[0]["last_restart_reason"])
    check_results(results_of(workdir, "reboot", n, 2), n, NPROC)


def supervisors(lay, session: str) -> list[list[str]]:
    """Each node's supervisor processes of ``session`` (command lines)."""
    found = []
    for node in lay.nodes:
        out = sandbox.node_exec(node, ["pgrep", "-af", "meshkit supervise"]).stdout
        found.append([ln for ln in out.splitlines() if f"--session {session} " in ln])
    return found


def host_pid(lay, session: str, rank: int) -> int:
    """The supervisor of ``session`` on node ``rank``, as this machine numbers it."""
    tail = [b"--hostfile", str(lay.hostfile).encode(), b"--session", session.encode()]
    for proc in Path("/proc").iterdir():
        with contextlib.suppress(OSError):
            argv = (proc / "cmdline").read_bytes().split(b"\0")
            if argv[3:8] == [b"supervise", *tail] and f"--rank\0{rank}\0".encode() in b"\0".join(
                argv
            ):
                return int(proc.name)
    raise AssertionError(f"no supervisor of {session} on node {rank}")


@contextlib.contextmanager
def frozen(pid: int):
    """``pid`` hung (the cgroup freezer) for the block."""
    group = FREEZER / f"meshkit-test-{pid}"
    group.mkdir()
    try:
        (group / "cgroup.procs").write_text(f"{pid}\n")
        (group / "freezer.state").write_text("FROZEN\n")
        yield
    finally:
        (group / "freezer.state").write_text("THAWED\n")
        for task in (group / "cgroup.procs").read_text().split():
            (FREEZER / "cgroup.procs").write_text(f"{task}\n")
        group.rmdir()


def test_a_rebooted_launching_node_is_relaunched_with_no_command(meshed):
    """Node 0 launched the job and is its master: its reboot takes its supervisor with it, the
    others carry on without it (node 1 leads), relaunch the job on every node with the same
    ranks, and start node 0's supervisor again."""
    lay, workdir = meshed
    n = len(lay.nodes)
    args = ("--restarts", "1", "--nproc-per-node", str(NPROC), "--cmd", torch_job("reboot0"))
    train(lay, workdir, "reboot0", *args)
    wait_for(lambda: len(results_of(workdir, "reboot0", n, 1)) == n * NPROC, timeout=180)
    relaunches_end(workdir, "reboot0")
    assert status(lay, workdir, "reboot0")[0]["leader"] == 0
    sandbox.reboot(lay, 0)
    rows = wait_for(lambda: supervisor_is(lay, workdir, "reboot0", "done", "gave up"), timeout=300)
    assert rows[0]["supervisor"] == "done", rows
    assert rows[0]["attempt"] == 2
    assert "node 0 " in str(rows[0]["last_restart_reason"])
    check_results(results_of(workdir, "reboot0", n, 2), n, NPROC)
    log = (workdir / ".meshkit" / "reboot0" / "supervisor-node1.log").read_text()
    assert "attempt 2: relaunching" in log
    assert "attempt 2 started" in log  # node 1 led it
    assert "supervising" in (workdir / ".meshkit" / "reboot0" / "supervisor-node0.log").read_text()


def test_a_leader_killed_during_a_held_relaunch_leaves_exactly_one_relaunch(meshed):
    """A relaunch waits while a doctor's check fails on a node (here node 2's workdir goes
    read-only) and status names the node and the check. Meanwhile the leader hangs (node 1
    takes the attempt over once its heartbeat is stale), then goes on while node 1's supervisor
    is killed: once the check passes, one relaunch, attempt 2 only, one supervisor per node."""
    lay, workdir = meshed
    train(lay, workdir, "held", "--restarts", "3", "--cmd", "sleep 600")
    assert wait_for(lambda: all(supervisors(lay, "held")), timeout=60)
    rows = status(lay, workdir, "held")
    assert (rows[0]["supervisor"], rows[0]["leader"]) == ("running", 0)
    ro = f"mount --bind {workdir} {workdir} && mount -o remount,bind,ro {workdir}"
    assert sandbox.node_exec(lay.nodes[2], ["sh", "-c", ro]).returncode == 0
    try:
        sandbox.node_exec(lay.nodes[1], ["pkill", "-9", "-f", "^sleep 600"])
        said = functools.partial(supervisor_said, workdir, "held", "held by")
        rows = wait_for(lambda: said() and status_when(lay, workdir, "held", is_held))
        assert rows[0]["supervisor"] == "running"
        assert rows[0]["relaunching"]
        assert rows[0]["attempt"] == 2
        held = str(rows[0]["held"])
        assert held.startswith(f"{lay.nodes[2].address}: workdir: "), held
        text = on_node(lay, 1, workdir, "status", "--session", "held").stdout
        assert "relaunch held by " in text
        assert "(leader: node 0)" in text
        # node 0's supervisor hangs (frozen: tmux resumes a stopped pane at once): its heartbeat
        # goes stale and node 1 takes the attempt over
        with frozen(host_pid(lay, "held", 0)):
            # node 1 says so once it took over (its heartbeat stale: a minute)
            taken = functools.partial(took_over, workdir, "held", 1)
            rows = wait_for(lambda: taken() and status_when(lay, workdir, "held", led_by(1)))
            assert rows[0]["supervisor"] == "running"
            assert rows[0]["relaunching"]
            assert rows[0]["attempt"] == 2
        # node 0's goes on, and node 1's (now the attempt's claimer) is killed mid-relaunch
        for line in supervisors(lay, "held")[1]:
            sandbox.node_exec(lay.nodes[1], ["kill", "-9", line.split()[0]])
        rows = wait_for(lambda: status_when(lay, workdir, "held", led_by(0)))
        assert rows[0]["supervisor"] == "running"
        assert rows[0]["relaunching"]
        assert rows[0]["attempt"] == 2
    finally:
        sandbox.node_exec(lay.nodes[2], ["umount", str(workdir)])

    def relaunched(rows) -> bool:
        return rows[0]["supervisor"] == "running" and all(row["state"] == "running" for row in rows)

    said = functools.partial(supervisor_said, workdir, "held", "attempt 2 started")
    rows = wait_for(lambda: said() and status_when(lay, workdir, "held", relaunched), timeout=120)
    assert (rows[0]["attempt"], rows[0]["restarts_left"], rows[0]["held"]) == (2, 2, None)
    for rank in range(len(lay.nodes)):
        text = (workdir / ".meshkit" / "held" / f"node{rank}.log").read_text()
        assert text.count("===== meshkit: attempt") == 1
        assert "attempt 2 of 4" in text
    # node 1's supervisor is back (the relaunch starts one wherever none is live)
    wait_for(lambda: all(len(s) == 1 for s in supervisors(lay, "held")), timeout=60)
    wait_for(lambda: status(lay, workdir, "held")[0]["leader"] == 0, timeout=60)
    assert on_node(lay, 2, workdir, "stop", "--session", "held").returncode == 0
    assert supervisors(lay, "held") == [[]] * len(lay.nodes)


def test_stop_ends_every_supervisor_first(meshed):
    lay, workdir = meshed
    train(lay, workdir, "stopme", "--restarts", "3", "--cmd", "sleep 600", node=1)
    assert status(lay, workdir, "stopme")[0]["supervisor"] == "running"
    assert wait_for(lambda: all(supervisors(lay, "stopme")), timeout=60)
    out = on_node(lay, 2, workdir, "stop", "--session", "stopme")
    assert out.returncode == 0, out.stdout + out.stderr
    for node in lay.nodes:
        assert "stopme" not in sandbox.node_exec(node, ["tmux", "ls"]).stdout
    rows = status(lay, workdir, "stopme")
    assert [r["state"] for r in rows] == ["absent"] * len(lay.nodes)
    assert rows[0]["supervisor"] is None
    assert rows[0]["leader"] is None
    assert supervisors(lay, "stopme") == [[]] * len(lay.nodes)
