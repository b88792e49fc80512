"""The spare-node scenarios' shared parts (tests/test_spares.py, tests/test_spares_shrink.py):
a meshed hostfile with a spare line, the example job under torchrun or --spawn, power, status
and what each attempt said."""

from __future__ import annotations

import json
import re
import shlex
import sys
from pathlib import Path

import pytest
from conftest import meshkit

from helpers.sandbox_jobs import RESULT, example_workdir, on_node, wait_for
from meshkit import sandbox

# A script's view of a job, through the Python API (run inside a node, from the workdir):
# train with keyword arguments given as JSON, or print status as `status --json` does.
API = """
import json, sys
from meshkit.api import Cluster
cluster = Cluster(sys.argv[1], session=sys.argv[2])
if sys.argv[3] == "status":
    print(json.dumps(cluster.status().as_json()))
else:
    started = cluster.train(sys.argv[4], **json.loads(sys.argv[3]))
    sys.exit(0 if started.ok else 1)
"""

ACTIVE = 4
# One rank per node: each scenario runs under both launchers and boots torch on every node at
# least twice (the CPU of CI's suite is half ranks importing torch); several local ranks per node
# are the train, demo and resume tests' part.
NPROC = 1
LAUNCHERS = ("torchrun", "spawn")
REPLACE_AFTER = "8s"
WHO = RESULT  # each rank's line of the example: rank, world, node rank, host, sums
ATTEMPT = re.compile(r"attempt=(\d+) reason=(\S+) generation=(\d+) master=(\S+)")


def job_cmd(session: str, spawn: bool = False) -> str:
    """The example job under torchrun (or spawned by meshkit run). Each attempt first says what
    it was told; the first sleeps (so it still runs when the test powers a node off) until the
    test writes SESSION.sleep."""
    said = "echo attempt=$((MESHKIT_RESTART_COUNT + 1)) reason=$MESHKIT_RESTART_REASON"
    said += " generation=$MESHKIT_GENERATION master=$MASTER_ADDR"
    sleep = f"$(cat {session}.sleep 2>/dev/null || echo 600)"
    launcher = "python" if spawn else "torchrun"
    return f"{said}; {launcher} example_train.py --sleep {sleep}"


def mesh_with_spare(cluster):
    """A hostfile of the sandbox's first ACTIVE nodes and the rest as spares (beside the sandbox's
    own: its ssh settings), meshed, and a shared workdir holding the example."""
    hostfile = cluster.root / "hostfile-spares"
    lines = [node.address for node in cluster.nodes[:ACTIVE]]
    lines += [f"{node.address} spare" for node in cluster.nodes[ACTIVE:]]
    hostfile.write_text("\n".join(lines) + "\n")
    out = meshkit("mesh", "--hostfile", str(hostfile), "--no-verify")
    assert out.returncode == 0, out.stdout + out.stderr
    return cluster, example_workdir(cluster), hostfile


def power_off(lay, index: int) -> None:
    sandbox.poweroff(lay, index)


def power_on(lay, index: int) -> None:
    sandbox.poweron(lay, index)


def train(
    lay,
    workdir: Path,
    hostfile: Path,
    session: str,
    *args: str,
    node: int = 0,
    spawn: bool = False,
    replace_after: str = REPLACE_AFTER,
    api: bool = False,
    restarts: int = 2,
    cmd: str | None = None,
    env: str = "",
    check: bool = True,
):
    """``train`` of the example job (``cmd``: another command line) inside node ``node``
    (``env``: variables set before it, "A=1 B=2"; ``check``: it must succeed)."""
    if api:  # the same job, from a script: Cluster.train(restarts=, replace_after=, ...)
        return train_by_api(lay, workdir, hostfile, session, node, spawn, replace_after, *args)
    flags = ["--hostfile", str(hostfile), "--session", session, "--nproc-per-node", str(NPROC)]
    flags += ["--restarts", str(restarts), "--replace-after", replace_after, *args]
    if spawn:
        flags.append("--spawn")
    command = cmd or job_cmd(session, spawn)
    out = on_node(lay, node, workdir, "train", *flags, "--cmd", command, env=env)
    if check:
        assert out.returncode == 0, out.stdout + out.stderr
    return out


def train_by_api(
    lay,
    workdir: Path,
    hostfile: Path,
    session: str,
    node: int,
    spawn: bool,
    replace_after: str,
    *args: str,
):
    """``train``'s job started by ``Cluster.train`` inside node ``node``; ``args`` are flag
    pairs (``--min-nodes 3``), given as the keyword arguments of the same names."""
    kwargs: dict[str, object] = {"nproc_per_node": NPROC, "restarts": 2, "spawn": spawn}
    kwargs["replace_after"] = replace_after
    for flag, value in zip(args[::2], args[1::2]):
        kwargs[flag.removeprefix("--").replace("-", "_")] = int(value) if value.isdigit() else value
    out = by_api(lay, node, workdir, hostfile, session, json.dumps(kwargs), job_cmd(session, spawn))
    assert out.returncode == 0, out.stdout + out.stderr
    return out


def by_api(lay, node: int, workdir: Path, hostfile: Path, session: str, *args: str):
    """``API`` run inside node ``node`` from the workdir, as a user's script would be."""
    argv = [sys.executable, "-c", API, str(hostfile), session, *args]
    line = f"cd {shlex.quote(str(workdir))} && {shlex.join(argv)}"
    return sandbox.node_exec(lay.nodes[node], ["bash", "-c", line], timeout=240)


def status(
    lay, workdir: Path, session: str, node: int, hostfile: Path | None = None
) -> list[dict[str, object]]:
    """``status --json``, or with ``hostfile`` the same rows from ``Cluster.status()``."""
    if hostfile is not None:
        out = by_api(lay, node, workdir, hostfile, session, "status")
    else:
        out = on_node(lay, node, workdir, "status", "--session", session, "--json")
    assert out.stdout.strip(), out.stderr
    return json.loads(out.stdout)


def moved_to(lay, workdir: Path, session: str, rank: int, node: int):
    """``status --json`` rows once node ``node`` holds ``rank`` in generation 2 (else None)."""
    rows = status(lay, workdir, session, node=1)
    hosts = [row["host"] for row in rows]
    if hosts[rank] == lay.nodes[node].address and rows[0]["generation"] == 2:
        return rows
    return None


def last_attempt(workdir: Path, session: str, rank: int) -> str:
    log = workdir / ".meshkit" / session / f"node{rank}.log"
    if not log.exists():
        return ""
    return log.read_text().split("===== meshkit: attempt ")[-1]


def ran_to_the_end(workdir: Path, session: str, ranks: int) -> bool:
    """Whether every rank of the last attempt of ``ranks`` nodes reported its all_reduce."""
    for rank in range(ranks):
        if len(WHO.findall(last_attempt(workdir, session, rank))) != NPROC:
            return False
    return True


def started(lay, workdir: Path, session: str, nodes: int = ACTIVE) -> None:
    """Once every node's first attempt runs (each rank's all_reduce reported)."""
    wait_for(lambda: ran_to_the_end(workdir, session, nodes), timeout=240, interval=2)


def job_left(lay, index: int) -> list[str]:
    out = sandbox.node_exec(
        lay.nodes[index], ["pgrep", "-af", "example_train|torchrun|-m meshkit (run|supervise)"]
    )
    return [line for line in out.stdout.splitlines() if "pgrep" not in line]


@pytest.fixture(scope="module")
def meshed(cluster):
    """The module's sandbox (``cluster``), meshed with a spare: ``mesh_with_spare``'s three."""
    return mesh_with_spare(cluster)
