"""Running meshkit inside sandbox nodes and reading what the bundled example job printed: shared
by the sandbox job tests (train, supervised, sync, diagnose)."""

from __future__ import annotations

import re
import shlex
import shutil
import sys
import time
from pathlib import Path

import pytest
from conftest import meshkit

from meshkit import sandbox

EXAMPLE = (
    Path(__file__).resolve().parent.parent.parent / "meshkit" / "templates" / "example_train.py"
)
# Local ranks per node where several are what a test checks (test_train's torchrun and --spawn
# jobs); the supervised, sync, resume and non-root jobs run one: every rank boots torch, about
# 3 s of CPU, and that was most of CI's time.
NPROC = 2
RESULT = re.compile(
    r"meshkit-example rank=(\d+) world_size=(\d+) node_rank=\S+ meshkit_node_rank=(\d+) "
    r"local_rank=\S+ host=(\S+) sum=(\d+) expected=(\d+)"
)


def example_workdir(lay) -> Path:
    """The sandbox's shared ``work`` directory, made, holding the bundled example job."""
    workdir = lay.shared / "work"
    workdir.mkdir()
    shutil.copy(EXAMPLE, workdir / "example_train.py")
    return workdir


@pytest.fixture(scope="module")
def meshed(cluster):
    """The module's sandbox (``cluster``) meshed, and its workdir holding the example job; a
    module takes it as ``meshed = sandbox_jobs.meshed``."""
    out = meshkit("mesh", "--hostfile", str(cluster.hostfile), "--no-verify")
    assert out.returncode == 0, out.stdout + out.stderr
    return cluster, example_workdir(cluster)


def script_job(cluster, name: str, script: str, cmd: str, *flags: str) -> Path:
    """The module's sandbox meshed, a shared workdir ``name`` holding ``script`` as
    ``name.py``, and ``train --cmd CMD`` started there from the controller; the workdir."""
    hostfile = str(cluster.hostfile)
    out = meshkit("mesh", "--hostfile", hostfile, "--no-verify")
    assert out.returncode == 0, out.stdout + out.stderr
    workdir = cluster.shared / name
    workdir.mkdir()
    (workdir / f"{name}.py").write_text(script)
    out = meshkit("train", "--hostfile", hostfile, *flags, "--cmd", cmd, cwd=workdir)
    assert out.returncode == 0, out.stdout + out.stderr
    return workdir


def on_node(lay, index: int, workdir: Path, *args: str, env: str = "", timeout: float = 240):
    """meshkit run *inside* a node, as a user logged in there would."""
    command = shlex.join([sys.executable, "-m", "meshkit", *args])
    line = f"cd {shlex.quote(str(workdir))} && {env} {command}"
    return sandbox.node_exec(lay.nodes[index], ["bash", "-c", line], timeout=timeout)


def private(lay, index: int, path: Path) -> Path:
    """``path`` (under /tmp, which is each node's own) as node ``index`` sees it, from the
    controller."""
    return lay.node_dir(lay.nodes[index]) / "tmp" / path.relative_to("/tmp")


def wait_for(predicate, timeout: float = 120, interval: float = 0.5):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"not reached within {timeout}s")


def supervisor_said(workdir: Path, session: str, text: str) -> bool:
    """Whether a supervisor of ``session`` logged ``text`` (" done: ", "attempt 2 started").
    A wait reads the logs until they say what it waits for, and only then asks status: a
    status round costs about a second of CPU, which a 2-core machine running two test
    modules at once pays for in time."""
    home = workdir / ".meshkit" / session
    return any(text in log.read_text() for log in home.glob("supervisor-node*.log"))


def every_log_says(workdir: Path, session: str, nodes: int, text: str) -> bool:
    """Whether every node's log of ``session`` holds ``text`` (read before asking status, as
    ``supervisor_said``)."""
    logs = [workdir / ".meshkit" / session / f"node{rank}.log" for rank in range(nodes)]
    return all(log.exists() and text in log.read_text() for log in logs)


def check_results(found, nodes: int, nproc: int = NPROC) -> None:
    """Every rank of the world (``nproc`` a node) reported once, each with the right all_reduce
    sum, from the node its NODE_RANK names."""
    world = nodes * nproc
    assert sorted(int(match.group(1)) for _, match in found) == list(range(world))
    expected_sum = str(world * (world + 1) // 2)
    for log_rank, match in found:
        assert int(match.group(2)) == world
        assert match.group(5) == match.group(6) == expected_sum
        # ran where NODE_RANK says
        assert int(match.group(3)) == log_rank
        assert match.group(4) == f"node{log_rank}"


def job_processes(lay) -> list[str]:
    """The example job's processes (and its launchers) still alive on any node."""
    left = []
    for node in lay.nodes:
        out = sandbox.node_exec(node, ["pgrep", "-af", "example_train|torchrun|meshkit run"])
        left += [f"{node.name}: {line}" for line in out.stdout.splitlines() if "pgrep" not in line]
    return left


def inside(lay, index: int, cwd: str, *args: str, timeout: float = 120):
    """``meshkit ARGS`` run inside node ``index`` from directory ``cwd``."""
    line = f"cd {shlex.quote(cwd)} && {shlex.join([sys.executable, '-m', 'meshkit', *args])}"
    return sandbox.node_exec(lay.nodes[index], ["bash", "-c", line], timeout=timeout)
