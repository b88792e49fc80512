"""``meshkit run --spawn``: the node's ranks started by meshkit itself. Real processes on this
machine (bash, sleep, signals); the cluster-wide launch with real torch is in test_train.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from conftest import meshkit

from meshkit.distenv import DistEnvError, NodeEnv, process_place, rank_variables
from meshkit.envrun import check_spawn_cmd
from meshkit.errors import UsageError
from meshkit.job import Job, from_json
from meshkit.sources import torchrun


def node(rank: int = 1, nnodes: int = 3, nproc: int = 2) -> NodeEnv:
    return NodeEnv(rank, nnodes, "10.0.0.1", 29500, nproc, "hostfile", "10.0.0.2 on eth0")


def test_rank_variables_are_torchruns_in_node_blocks():
    assert rank_variables(node(), 1) == {
        "RANK": "3",
        "LOCAL_RANK": "1",
        "GROUP_RANK": "1",
        "ROLE_RANK": "3",
        "ROLE_NAME": "default",
        "LOCAL_WORLD_SIZE": "2",
        "GROUP_WORLD_SIZE": "3",
        "ROLE_WORLD_SIZE": "6",
    }
    with pytest.raises(DistEnvError):
        rank_variables(node(), 2)


def test_a_spawned_rank_is_placed_as_torchruns_worker_would_be():
    """What discovery and init_distributed read inside a rank: the same node, the same rank."""
    env = {"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500", "WORLD_SIZE": "6"}
    env |= rank_variables(node(), 1)
    placement = torchrun(env)
    assert placement is not None
    assert (placement.node_rank, placement.nnodes, placement.nproc_per_node) == (1, 3, 2)
    place = process_place(node(), env)
    assert (place.rank, place.world_size, place.local_rank) == (3, 6, 1)


@pytest.mark.parametrize(
    "cmd",
    [
        "torchrun train.py",
        "/opt/venv/bin/torchrun --nproc-per-node 2 train.py",
        "python -m torch.distributed.run train.py",
        "OMP_NUM_THREADS=4 torchrun train.py",
    ],
)
def test_spawn_refuses_a_launcher_in_the_command(cmd):
    with pytest.raises(UsageError, match="--spawn starts the node's ranks itself"):
        check_spawn_cmd(cmd)


@pytest.mark.parametrize("cmd", ["python train.py", "python -m mypkg.train", "torchrunx-free.sh"])
def test_spawn_takes_a_script(cmd):
    check_spawn_cmd(cmd)


def test_the_saved_job_keeps_spawn_and_old_job_files_load():
    job = Job("python t.py", "/w", "s", "/w/hostfile", "/venv/bin/python", 29500, 2, spawn=True)
    again = from_json(job.to_json(), "job.json")
    assert again.spawn
    assert again == job
    assert job.node_job().argv[3:5] == ["run", "--hostfile"]
    assert "--spawn" in job.node_job().argv
    old = job.to_json().replace('"spawn": true,', "")
    assert not from_json(old, "job.json").spawn


@pytest.fixture
def hostfile(tmp_path: Path) -> Path:
    path = tmp_path / "hostfile"
    path.write_text("127.0.0.1\n")
    return path


def spawn_args(hostfile: Path, cmd: str, *extra: str) -> list[str]:
    return ["run", "--spawn", "--hostfile", str(hostfile), "--nproc-per-node", "3", *extra,
            "--cmd", cmd]  # fmt: skip


def run_spawn(hostfile: Path, cmd: str, *extra: str):
    return meshkit(*spawn_args(hostfile, cmd, *extra), cwd=hostfile.parent, timeout=60)


def test_every_rank_runs_with_its_variables_and_its_output_in_the_log(hostfile):
    log = hostfile.parent / "logs" / "node{rank}.log"
    out = run_spawn(
        hostfile,
        "echo rank=$RANK local=$LOCAL_RANK world=$WORLD_SIZE node=$NODE_RANK omp=$OMP_NUM_THREADS",
        "--log",
        str(log),
    )
    assert out.returncode == 0, out.stderr
    lines = sorted(out.stdout.splitlines())
    omp = os.environ.get("OMP_NUM_THREADS", "1")  # torchrun's default, unless it is set already
    assert lines == [f"rank={i} local={i} world=3 node=0 omp={omp}" for i in range(3)]
    assert sorted((hostfile.parent / "logs" / "node0.log").read_text().splitlines()) == lines


def test_one_rank_failing_ends_the_others_and_gives_its_code(hostfile):
    marker = f"meshkit-test-{uuid.uuid4().hex[:8]}"
    start = time.monotonic()
    out = run_spawn(
        hostfile, f"if [ $LOCAL_RANK = 1 ]; then exit 7; fi; exec -a {marker} sleep 120"
    )
    assert out.returncode == 7, out.stderr
    assert time.monotonic() - start < 30  # not the sleep's 120 s: the others were ended
    assert not pids_of(marker)


def pids_of(marker: str) -> list[str]:
    out = subprocess.run(["pgrep", "-f", f"^{marker}"], capture_output=True, text=True, check=False)
    return out.stdout.split()


def started(hostfile: Path, marker: str, ignore_int: bool = False) -> subprocess.Popen[bytes]:
    """``meshkit run --spawn`` of three sleeps, once all three run. ``ignore_int``: started as
    the keeper starts it, with INT (and HUP) ignored."""

    def ignore() -> None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)

    proc = subprocess.Popen(
        [sys.executable, "-m", "meshkit", *spawn_args(hostfile, f"exec -a {marker} sleep 120")],
        cwd=hostfile.parent,
        preexec_fn=ignore if ignore_int else None,
    )
    deadline = time.monotonic() + 30
    while len(pids_of(marker)) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    return proc


def end(proc: subprocess.Popen[bytes], marker: str) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    for pid in pids_of(marker):
        os.kill(int(pid), signal.SIGKILL)


def test_term_reaches_every_rank_and_nothing_is_left(hostfile):
    marker = f"meshkit-test-{uuid.uuid4().hex[:8]}"
    proc = started(hostfile, marker)
    try:
        assert len(pids_of(marker)) == 3
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 128 + signal.SIGTERM
        assert not pids_of(marker)
    finally:
        end(proc, marker)


def test_a_signal_ignored_at_the_start_stays_ignored(hostfile):
    """The keeper ignores INT and HUP for its job (stop ends the tree itself): so do the ranks."""
    marker = f"meshkit-test-{uuid.uuid4().hex[:8]}"
    proc = started(hostfile, marker, ignore_int=True)
    try:
        assert len(pids_of(marker)) == 3
        proc.send_signal(signal.SIGINT)
        time.sleep(0.5)
        assert proc.poll() is None
        assert len(pids_of(marker)) == 3
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 128 + signal.SIGTERM
    finally:
        end(proc, marker)


def test_a_launcher_under_spawn_is_a_usage_error(hostfile):
    out = run_spawn(hostfile, "torchrun train.py")
    assert out.returncode == 2
    assert "--spawn starts the node's ranks itself" in out.stderr
    assert "Traceback" not in out.stderr
