"""train / status / logs / stop on the sandbox: real tmux, real torchrun with gloo across nodes."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import meshkit
from helpers.sandbox_jobs import NPROC, RESULT, check_results, job_processes, on_node, wait_for

from meshkit import sandbox

SANDBOX_NODES = 3
REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def meshed(cluster):
    out = meshkit("mesh", "--hostfile", str(cluster.hostfile), "--no-verify")
    assert out.returncode == 0, out.stdout + out.stderr
    workdir = cluster.shared / "work"
    workdir.mkdir()
    shutil.copy(REPO / "meshkit" / "templates" / "example_train.py", workdir / "example_train.py")
    return cluster, workdir


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
            found += [(rank, m) for m in RESULT.finditer(log.read_text())]
    return found


def status(lay, workdir: Path, session: str, index: int = 0):
    out = on_node(lay, index, workdir, "status", "--session", session, "--json")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_bare_torchrun_from_a_worker_status_reboot_relaunch_stop(meshed):
    lay, workdir = meshed
    n = len(lay.nodes)
    out = train_on(
        lay,
        1,
        workdir,
        "bare",
        "--nproc-per-node",
        str(NPROC),
        "--cmd",
        "torchrun example_train.py --sleep 600",
    )
    assert out.returncode == 0, out.stdout + out.stderr
    check_results(wait_for(lambda: len(r := results(workdir, "bare", n)) == n * NPROC and r), n)

    rows = status(lay, workdir, "bare")
    assert [(r["node_rank"], r["host"], r["state"]) for r in rows] == [
        (i, node.address, "running") for i, node in enumerate(lay.nodes)
    ]
    assert set(rows[0]) == {"node_rank", "host", "state", "exit_code", "started", "last_line"} | {
        "stalled",
        "idle_s",
    }

    sandbox.reboot(lay, 2)
    rows = status(lay, workdir, "bare")
    assert [r["state"] for r in rows] == ["running", "running", "absent"]

    # relaunch from another node with no --cmd: the saved job, all ranks again
    out = on_node(lay, 0, workdir, "train", "--session", "bare", "--wait", "20")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "relaunching saved job" in out.stdout
    wait_for(lambda: len(results(workdir, "bare", n)) == 2 * n * NPROC)
    assert [r["state"] for r in status(lay, workdir, "bare", index=2)] == ["running"] * n

    logs = on_node(lay, 2, workdir, "logs", "--session", "bare", "--lines", "3", "--node", "1")
    assert logs.returncode == 0 and all(
        line.startswith("[1] ") for line in logs.stdout.splitlines()
    )

    out = on_node(lay, 2, workdir, "stop", "--session", "bare")
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.count("nothing left") == n
    assert job_processes(lay) == []
    assert [r["state"] for r in status(lay, workdir, "bare")] == ["absent"] * n


def test_seed_style_run_sh_from_a_worker_and_exit_codes(meshed):
    lay, workdir = meshed
    n = len(lay.nodes)
    cmd = f"{REPO}/meshkit/templates/run.sh $GPUS_PER_NODE $NNODES $NODE_RANK $MASTER_ADDR $MASTER_PORT"
    out = train_on(lay, 2, workdir, "seed", "--nproc-per-node", str(NPROC), "--cmd", cmd)
    assert out.returncode == 0, out.stdout + out.stderr
    rows = wait_for(lambda: all_exited(lay, workdir, "seed"))
    assert [r["exit_code"] for r in rows] == [0] * n
    check_results(results(workdir, "seed", n), n)

    out = train_on(lay, 0, workdir, "fails", "--cmd", "echo about to fail; exit 7")
    assert out.returncode == 0
    rows = wait_for(lambda: all_exited(lay, workdir, "fails"))
    assert [(r["exit_code"], r["last_line"]) for r in rows] == [(7, "about to fail")] * n


def test_spawn_starts_every_rank_without_torchrun_and_a_failure_ends_the_node(meshed):
    lay, workdir = meshed
    n = len(lay.nodes)
    args = ("--nproc-per-node", str(NPROC), "--spawn")
    out = train_on(lay, 1, workdir, "spawned", *args, "--cmd", "python example_train.py")
    assert out.returncode == 0, out.stdout + out.stderr
    rows = wait_for(lambda: all_exited(lay, workdir, "spawned"))
    assert [r["exit_code"] for r in rows] == [0] * n
    found = results(workdir, "spawned", n)
    check_results(found, n)
    # torchrun's worker variables, from meshkit: GROUP_RANK is the node's rank
    assert all(f"node_rank={rank} " in m.group(0) for rank, m in found)
    assert "torchrun" not in (workdir / ".meshkit" / "spawned" / "node0.log").read_text()

    # a bare relaunch from another node keeps --spawn
    out = on_node(lay, 2, workdir, "train", "--session", "spawned")
    assert out.returncode == 0, out.stdout + out.stderr
    wait_for(lambda: len(results(workdir, "spawned", n)) == 2 * n * NPROC)
    assert [r["exit_code"] for r in wait_for(lambda: all_exited(lay, workdir, "spawned"))] == [
        0
    ] * n
    assert json.loads((workdir / ".meshkit" / "spawned" / "job.json").read_text())["spawn"]

    # stop ends spawned ranks (each in a process group of its own) and finds nothing left
    cmd = "python example_train.py --sleep 600"
    out = train_on(lay, 1, workdir, "spawnstop", *args, "--cmd", cmd)
    assert out.returncode == 0, out.stdout + out.stderr
    wait_for(lambda: len(results(workdir, "spawnstop", n)) == n * NPROC)
    assert [r["state"] for r in status(lay, workdir, "spawnstop")] == ["running"] * n
    out = on_node(lay, 0, workdir, "stop", "--session", "spawnstop")
    assert out.returncode == 0 and out.stdout.count("nothing left") == n, out.stdout + out.stderr
    assert job_processes(lay) == []

    # one rank failing ends its node's other rank at once, and the node exits with its code
    cmd = "if [ $LOCAL_RANK = 1 ]; then echo rank $RANK fails; exit 5; fi; exec sleep 600"
    out = train_on(lay, 0, workdir, "spawnfail", *args, "--cmd", cmd)
    assert out.returncode == 0, out.stdout + out.stderr
    rows = wait_for(lambda: all_exited(lay, workdir, "spawnfail"), timeout=60)
    assert [r["exit_code"] for r in rows] == [5] * n
    assert [r["last_line"] for r in rows] == [f"rank {2 * i + 1} fails" for i in range(n)]
    for node in lay.nodes:
        assert sandbox.node_exec(node, ["pgrep", "-f", "^sleep 600"]).stdout == ""

    # a launcher under --spawn would start NPROC launchers per node: refused, nothing started
    out = train_on(lay, 0, workdir, "spawnbad", *args, "--cmd", "torchrun example_train.py")
    assert out.returncode == 2 and "--spawn starts the node's ranks itself" in out.stderr
    assert nothing_started(lay, "spawnbad")


def all_exited(lay, workdir: Path, session: str):
    rows = status(lay, workdir, session)
    return rows if all(r["state"] == "exited" for r in rows) else None


def nothing_started(lay, session: str) -> bool:
    return all(
        sandbox.node_exec(node, ["tmux", "has-session", "-t", session]).returncode != 0
        for node in lay.nodes
    )


def test_preflight_failures_start_nothing(meshed, tmp_path):
    lay, workdir = meshed
    base = ["train", "--hostfile", str(lay.hostfile), "--session", "bad", "--cmd", "sleep 600"]

    out = on_node(lay, 1, workdir, *base, env="MESHKIT_PYTHON=/nonexistent/python3")
    assert out.returncode != 0 and "interpreter /nonexistent/python3 not found" in out.stderr
    assert "nothing was started" in out.stderr and "Traceback" not in out.stderr
    assert nothing_started(lay, "bad")

    swapped = lay.shared / "swapped"
    swapped.mkdir()
    (swapped / "hostfile").write_text("node0\nnode1\nnode2\n")
    (swapped / "ssh_config").write_text(
        f"Host node0\n  HostName {lay.nodes[1].address}\nHost node1\n  HostName {lay.nodes[0].address}\n"
        f"Host node2\n  HostName {lay.nodes[2].address}\n"
    )
    out = on_node(
        lay,
        2,
        workdir,
        "train",
        "--hostfile",
        str(swapped / "hostfile"),
        "--session",
        "bad",
        "--cmd",
        "sleep 600",
    )
    assert out.returncode != 0 and "discovers NODE_RANK=1" in out.stderr, out.stderr
    assert nothing_started(lay, "bad")

    subprocess.run(["ip", "link", "set", lay.nodes[2].veth, "down"], check=True)
    try:
        out = on_node(lay, 0, workdir, *base, env="MESHKIT_CONNECT_TIMEOUT=3", timeout=60)
    finally:
        subprocess.run(["ip", "link", "set", lay.nodes[2].veth, "up"], check=True)
    assert (
        out.returncode != 0
        and f"{lay.nodes[2].address}: cannot connect: no answer within 3s" in out.stderr
    )
    assert nothing_started(lay, "bad")

    out = meshkit("train", "--session", "nosuch", "--workdir", str(workdir))
    assert out.returncode != 0 and "no saved job" in out.stderr and "--cmd" in out.stderr
