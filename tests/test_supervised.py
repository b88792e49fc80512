"""Supervised jobs on the sandbox (real sshd, tmux, torchrun with gloo): a killed worker and a
rebooted node each restart the whole job with the same ranks, which then completes; exhausted
restarts leave a supervisor that says why; stop ends the supervisor first."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from conftest import meshkit
from test_train import NPROC, RESULT, check_results, job_processes, on_node, wait_for

from meshkit import sandbox

SANDBOX_NODES = 3
REPO = Path(__file__).resolve().parent.parent
TORCH = "torchrun example_train.py --sleep 25"


@pytest.fixture(scope="module")
def meshed(cluster):
    out = meshkit("mesh", "--hostfile", str(cluster.hostfile), "--no-verify")
    assert out.returncode == 0, out.stdout + out.stderr
    workdir = cluster.shared / "work"
    workdir.mkdir()
    shutil.copy(REPO / "meshkit" / "templates" / "example_train.py", workdir / "example_train.py")
    return cluster, workdir


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


def supervisor_is(lay, workdir: Path, session: str, *states: str):
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
    assert "supervisor: tmux session" in out.stdout
    rows = wait_for(lambda: supervisor_is(lay, workdir, "gives", "gave up"), timeout=120)
    assert [r["exit_code"] for r in rows] == [3] * n
    assert [r["state"] for r in rows] == ["exited"] * n
    assert {(r["attempt"], r["restarts_left"]) for r in rows} == {(2, 0)}
    reason = str(rows[0]["last_restart_reason"])
    assert reason.startswith("no restarts left") and "exited with code 3" in reason
    for rank in range(n):
        parts = attempts(workdir, "gives", rank)
        assert len(parts) == 2 and parts[1].startswith("attempt 2 of 2")
        assert all("trying" in p for p in parts)
    text = on_node(lay, 2, workdir, "status", "--session", "gives").stdout
    assert "supervisor: gave up, attempt 2 of 2, restarts left 0" in text
    # a code outside --restart-on gives up at once, without a restart
    train(lay, workdir, "notlisted", "--restarts", "3", "--restart-on", "1,137", "--cmd", "exit 4")
    rows = wait_for(lambda: supervisor_is(lay, workdir, "notlisted", "gave up"), timeout=120)
    assert rows[0]["attempt"] == 1 and "not in --restart-on" in str(rows[0]["last_restart_reason"])


def test_a_killed_worker_restarts_the_whole_job_with_the_same_ranks(meshed):
    lay, workdir = meshed
    n = len(lay.nodes)
    train(lay, workdir, "killed", "--restarts", "2", "--nproc-per-node", str(NPROC), "--cmd", TORCH)
    wait_for(lambda: len(results_of(workdir, "killed", n, 1)) == n * NPROC, timeout=180)
    rows = status(lay, workdir, "killed")
    assert rows[0]["supervisor"] == "running" and rows[0]["attempt"] == 1
    victim = sandbox.node_exec(lay.nodes[1], ["pgrep", "-f", "-u", "0", "--", "-u example_train"])
    pids = victim.stdout.split()
    assert pids, victim
    sandbox.node_exec(lay.nodes[1], ["kill", "-9", pids[0]])
    rows = wait_for(lambda: supervisor_is(lay, workdir, "killed", "done", "gave up"), timeout=300)
    assert rows[0]["supervisor"] == "done", rows
    assert rows[0]["attempt"] == 2 and rows[0]["restarts_left"] == 1
    assert "node 1 " in str(rows[0]["last_restart_reason"])
    assert [r["exit_code"] for r in rows] == [0] * n
    check_results(results_of(workdir, "killed", n, 2), n)  # attempt 2: every rank, same nodes
    assert job_processes(lay) == []


def test_a_rebooted_node_is_relaunched_once_it_is_back(meshed):
    lay, workdir = meshed
    n = len(lay.nodes)
    train(lay, workdir, "reboot", "--restarts", "1", "--nproc-per-node", str(NPROC), "--cmd", TORCH)
    wait_for(lambda: len(results_of(workdir, "reboot", n, 1)) == n * NPROC, timeout=180)
    sandbox.reboot(lay, 2)
    rows = wait_for(lambda: supervisor_is(lay, workdir, "reboot", "done", "gave up"), timeout=300)
    assert rows[0]["supervisor"] == "done", rows
    assert rows[0]["attempt"] == 2 and "node 2 " in str(rows[0]["last_restart_reason"])
    check_results(results_of(workdir, "reboot", n, 2), n)


def test_stop_ends_the_supervisor_first(meshed):
    lay, workdir = meshed
    train(lay, workdir, "stopme", "--restarts", "3", "--cmd", "sleep 600", node=1)
    assert status(lay, workdir, "stopme")[0]["supervisor"] == "running"
    out = on_node(lay, 2, workdir, "stop", "--session", "stopme")
    assert out.returncode == 0, out.stdout + out.stderr
    tmux = sandbox.node_exec(lay.nodes[1], ["tmux", "ls"]).stdout
    assert "stopme" not in tmux
    rows = status(lay, workdir, "stopme")
    assert [r["state"] for r in rows] == ["absent"] * len(lay.nodes)
    assert rows[0]["supervisor"] is None
    left = sandbox.node_exec(lay.nodes[1], ["pgrep", "-af", "meshkit supervise"]).stdout
    assert [ln for ln in left.splitlines() if "pgrep" not in ln] == []
