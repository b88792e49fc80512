"""train / status / logs / stop on the sandbox: real tmux, real torchrun with gloo across nodes."""

from __future__ import annotations

import functools
import json
import re
import subprocess
from pathlib import Path

from conftest import meshkit
from helpers import sandbox_jobs
from helpers.sandbox_jobs import (
    NPROC,
    RESULT,
    check_results,
    every_log_says,
    job_processes,
    on_node,
    wait_for,
)

from meshkit import sandbox

SANDBOX_NODES = 3
REPO = Path(__file__).resolve().parent.parent


meshed = sandbox_jobs.meshed  # the fixture: this module's sandbox, meshed, with the example


def train_on(lay, index: int, workdir: Path, session: str, *args: str):
    """``meshkit train`` with the sandbox's hostfile, run inside node ``index``."""
    return on_node(
        lay, index, workdir, "train", "--hostfile", str(lay.hostfile), "--session", session, *args
    )


def results(workdir: Path, session: str, nodes: int) -> list[tuple[int, re.Match[str]]]:
    found = []
    for rank in range(nodes):
        log = workdir / ".meshkit" / session / f"node{rank}.log"
        if log.exists():
            found += [(rank, match) for match in RESULT.finditer(log.read_text())]
    return found


def status(lay, workdir: Path, session: str, index: int = 0):
    out = on_node(lay, index, workdir, "status", "--session", session, "--json")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_bare_torchrun_from_a_worker_status_reboot_relaunch_stop(meshed):
    lay, workdir = meshed
    nodes = len(lay.nodes)
    cmd = "torchrun example_train.py --sleep 600"
    out = train_on(lay, 1, workdir, "bare", "--nproc-per-node", str(NPROC), "--cmd", cmd)
    assert out.returncode == 0, out.stdout + out.stderr

    def every_rank_reported() -> list[tuple[int, re.Match[str]]] | None:
        found = results(workdir, "bare", nodes)
        if len(found) != nodes * NPROC:
            return None
        return found

    check_results(wait_for(every_rank_reported), nodes)

    rows = status(lay, workdir, "bare")
    assert [(row["node_rank"], row["host"], row["state"]) for row in rows] == [
        (i, node.address, "running") for i, node in enumerate(lay.nodes)
    ]
    assert set(rows[0]) == {
        "node_rank",
        "host",
        "state",
        "exit_code",
        "started",
        "last_line",
        "stalled",
        "idle_s",
        "health",  # issue 44: each node's health (an unsupervised job's status asks it too)
        "progress",  # issue 45: its ranks' steps (the example tells them)
        "straggler",  # issue 45: null, or its figures when status names it one
    }
    assert rows[0]["health"]["state"] == "ok", rows[0]

    sandbox.reboot(lay, 2)
    rows = status(lay, workdir, "bare")
    assert [row["state"] for row in rows] == ["running", "running", "absent"]

    # relaunch from another node with no --cmd: the saved job, all ranks again
    out = on_node(lay, 0, workdir, "train", "--session", "bare", "--wait", "20")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "relaunching saved job" in out.stdout
    wait_for(lambda: len(results(workdir, "bare", nodes)) == 2 * nodes * NPROC)
    rows = status(lay, workdir, "bare", index=2)
    assert [row["state"] for row in rows] == ["running"] * nodes

    logs = on_node(lay, 2, workdir, "logs", "--session", "bare", "--lines", "3", "--node", "1")
    assert logs.returncode == 0
    assert all(line.startswith("[1] ") for line in logs.stdout.splitlines())

    out = on_node(lay, 2, workdir, "stop", "--session", "bare")
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.count("nothing left") == nodes
    assert job_processes(lay) == []
    assert [row["state"] for row in status(lay, workdir, "bare")] == ["absent"] * nodes


def test_seed_style_run_sh_from_a_worker_and_exit_codes(meshed):
    lay, workdir = meshed
    nodes = len(lay.nodes)
    run_sh = f"{REPO}/meshkit/templates/run.sh"
    cmd = f"{run_sh} $GPUS_PER_NODE $NNODES $NODE_RANK $MASTER_ADDR $MASTER_PORT"
    out = train_on(lay, 2, workdir, "seed", "--nproc-per-node", str(NPROC), "--cmd", cmd)
    assert out.returncode == 0, out.stdout + out.stderr
    rows = wait_for(lambda: all_exited(lay, workdir, "seed", reported(workdir, "seed", nodes)))
    assert [row["exit_code"] for row in rows] == [0] * nodes
    check_results(results(workdir, "seed", nodes), nodes)

    out = train_on(lay, 0, workdir, "fails", "--cmd", "echo about to fail; exit 7")
    assert out.returncode == 0
    said = functools.partial(every_log_says, workdir, "fails", nodes, "about to fail")
    rows = wait_for(lambda: all_exited(lay, workdir, "fails", said))
    ends = [(row["exit_code"], row["last_line"]) for row in rows]
    assert ends == [(7, "about to fail")] * nodes


def test_spawn_starts_every_rank_without_torchrun_and_a_failure_ends_the_node(meshed):
    lay, workdir = meshed
    nodes = len(lay.nodes)
    args = ("--nproc-per-node", str(NPROC), "--spawn")
    out = train_on(lay, 1, workdir, "spawned", *args, "--cmd", "python example_train.py")
    assert out.returncode == 0, out.stdout + out.stderr
    rows = wait_for(
        lambda: all_exited(lay, workdir, "spawned", reported(workdir, "spawned", nodes))
    )
    assert [row["exit_code"] for row in rows] == [0] * nodes
    found = results(workdir, "spawned", nodes)
    check_results(found, nodes)
    # torchrun's worker variables, from meshkit: GROUP_RANK is the node's rank
    assert all(f"node_rank={rank} " in match.group(0) for rank, match in found)
    assert "torchrun" not in (workdir / ".meshkit" / "spawned" / "node0.log").read_text()

    # a bare relaunch from another node keeps --spawn
    out = on_node(lay, 2, workdir, "train", "--session", "spawned")
    assert out.returncode == 0, out.stdout + out.stderr
    wait_for(lambda: len(results(workdir, "spawned", nodes)) == 2 * nodes * NPROC)
    rows = wait_for(
        lambda: all_exited(lay, workdir, "spawned", reported(workdir, "spawned", nodes))
    )
    assert [row["exit_code"] for row in rows] == [0] * nodes
    assert json.loads((workdir / ".meshkit" / "spawned" / "job.json").read_text())["spawn"]

    # stop ends spawned ranks (each in a process group of its own) and finds nothing left; the
    # ranks need not boot torch for that (the jobs above did), and each would cost 3 s of CPU
    cmd = "echo rank $RANK up; exec sleep 600"
    out = train_on(lay, 1, workdir, "spawnstop", *args, "--cmd", cmd)
    assert out.returncode == 0, out.stdout + out.stderr

    def every_rank_up() -> bool:
        logs = [workdir / ".meshkit" / "spawnstop" / f"node{rank}.log" for rank in range(nodes)]
        ups = [re.findall(r"rank \d+ up", log.read_text()) for log in logs if log.exists()]
        return sum(len(up) for up in ups) == nodes * NPROC

    wait_for(every_rank_up)
    assert [row["state"] for row in status(lay, workdir, "spawnstop")] == ["running"] * nodes
    out = on_node(lay, 0, workdir, "stop", "--session", "spawnstop")
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.count("nothing left") == nodes, out.stdout + out.stderr
    assert job_processes(lay) == []
    for node in lay.nodes:
        assert sandbox.node_exec(node, ["pgrep", "-f", "^sleep 600"]).stdout == ""

    # one rank failing ends its node's other rank at once, and the node exits with its code
    cmd = "if [ $LOCAL_RANK = 1 ]; then echo rank $RANK fails; exit 5; fi; exec sleep 600"
    out = train_on(lay, 0, workdir, "spawnfail", *args, "--cmd", cmd)
    assert out.returncode == 0, out.stdout + out.stderr
    said = functools.partial(every_log_says, workdir, "spawnfail", nodes, " fails")
    rows = wait_for(lambda: all_exited(lay, workdir, "spawnfail", said), timeout=60)
    assert [row["exit_code"] for row in rows] == [5] * nodes
    assert [row["last_line"] for row in rows] == [f"rank {2 * i + 1} fails" for i in range(nodes)]
    for node in lay.nodes:
        assert sandbox.node_exec(node, ["pgrep", "-f", "^sleep 600"]).stdout == ""

    # a launcher under --spawn would start NPROC launchers per node: refused, nothing started
    out = train_on(lay, 0, workdir, "spawnbad", *args, "--cmd", "torchrun example_train.py")
    assert out.returncode == 2
    assert "--spawn starts the node's ranks itself" in out.stderr
    assert nothing_started(lay, "spawnbad")


def reported(workdir: Path, session: str, nodes: int):
    """A check: every rank printed its result line (right before it ends)."""
    return lambda: len(results(workdir, session, nodes)) >= nodes * NPROC


def all_exited(lay, workdir: Path, session: str, ready):
    """Status once every node exited; asked only once ``ready()`` (the logs say the job is
    ending): the logs are cheap to read, a status round costs about a second of CPU."""
    if not ready():
        return None
    rows = status(lay, workdir, session)
    if all(row["state"] == "exited" for row in rows):
        return rows
    return None


def nothing_started(lay, session: str) -> bool:
    return all(
        sandbox.node_exec(node, ["tmux", "has-session", "-t", session]).returncode != 0
        for node in lay.nodes
    )


def test_preflight_failures_start_nothing(meshed, tmp_path):
    lay, workdir = meshed
    base = ["train", "--hostfile", str(lay.hostfile), "--session", "bad", "--cmd", "sleep 600"]

    out = on_node(lay, 1, workdir, *base, env="MESHKIT_PYTHON=/nonexistent/python3")
    assert out.returncode != 0
    assert "interpreter /nonexistent/python3 not found" in out.stderr
    assert "nothing was started" in out.stderr
    assert "Traceback" not in out.stderr
    assert nothing_started(lay, "bad")

    swapped = lay.shared / "swapped"
    swapped.mkdir()
    (swapped / "hostfile").write_text("node0\nnode1\nnode2\n")
    (swapped / "ssh_config").write_text(
        f"Host node0\n  HostName {lay.nodes[1].address}\n"
        f"Host node1\n  HostName {lay.nodes[0].address}\n"
        f"Host node2\n  HostName {lay.nodes[2].address}\n"
    )
    hostfile = str(swapped / "hostfile")
    args = ["--hostfile", hostfile, "--session", "bad", "--cmd", "sleep 600"]
    out = on_node(lay, 2, workdir, "train", *args)
    assert out.returncode != 0, out.stderr
    assert "discovers NODE_RANK=1" in out.stderr, out.stderr
    assert nothing_started(lay, "bad")

    subprocess.run(["ip", "link", "set", lay.nodes[2].veth, "down"], check=True)
    try:
        out = on_node(lay, 0, workdir, *base, env="MESHKIT_CONNECT_TIMEOUT=3", timeout=60)
    finally:
        subprocess.run(["ip", "link", "set", lay.nodes[2].veth, "up"], check=True)
    assert out.returncode != 0
    assert f"{lay.nodes[2].address}: cannot connect: no answer within 3s" in out.stderr
    assert nothing_started(lay, "bad")

    out = meshkit("train", "--session", "nosuch", "--workdir", str(workdir))
    assert out.returncode != 0
    assert "no saved job" in out.stderr
    assert "--cmd" in out.stderr
