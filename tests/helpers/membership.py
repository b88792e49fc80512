"""The membership scenarios' shared parts (tests/test_partition_membership.py,
tests/test_launches.py): a meshed hostfile of some active nodes and some spares, a plain job
that says where and in which generation it was launched and runs until the test tells it to
finish (no torch: these scenarios are about who runs, not what), and what each node runs."""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Iterator
from pathlib import Path

from conftest import meshkit

from helpers.sandbox_jobs import on_node
from meshkit import sandbox

REPLACE_AFTER = "8s"  # short: a lost node is replaced within seconds
SCRIPT = "membership_job.sh"
# Each launch says which job it is (its name: the session, or another where one session runs
# two jobs), where it ran, in which generation and attempt; then it waits for NAME.finish in
# the shared workdir and exits 0.
JOB = """\
echo "launched as=$1 generation=$MESHKIT_GENERATION attempt=$((MESHKIT_RESTART_COUNT + 1))\
 rank=$NODE_RANK host=$(hostname)"
while [ ! -e "$1.finish" ]; do sleep 0.5; done
echo "finished on $(hostname)"
"""
LAUNCHED = re.compile(r"launched as=(\S+) generation=(\d+) attempt=(\d+) rank=(\d+) host=(\S+)")


def mesh(lay, name: str, active: list[int], spares: list[int]) -> Path:
    """A hostfile ``name`` of the nodes ``active`` then ``spares`` (spare lines), meshed."""
    hostfile = lay.root / name
    lines = [lay.nodes[index].address for index in active]
    lines += [f"{lay.nodes[index].address} spare" for index in spares]
    hostfile.write_text("\n".join(lines) + "\n")
    out = meshkit("mesh", "--hostfile", str(hostfile), "--no-verify")
    assert out.returncode == 0, out.stdout + out.stderr
    return hostfile


def workdir(lay) -> Path:
    """The shared workdir, holding the job's script."""
    work = lay.shared / "work"
    work.mkdir(exist_ok=True)
    (work / SCRIPT).write_text(JOB)
    return work


def train(lay, work: Path, hostfile: Path, session: str, *args: str, node: int = 0, name: str = ""):
    """``train`` of the plain job (named ``name``, else the session) inside node ``node``,
    supervised: 2 restarts, a short --replace-after; returns what it printed (it must
    succeed)."""
    flags = ["--hostfile", str(hostfile), "--session", session, "--restarts", "2"]
    flags += ["--replace-after", REPLACE_AFTER, *args]
    out = on_node(lay, node, work, "train", *flags, "--cmd", f"bash {SCRIPT} {name or session}")
    assert out.returncode == 0, out.stdout + out.stderr
    return out


def finish(work: Path, session: str) -> None:
    (work / f"{session}.finish").write_text("")


def launches(work: Path, session: str, name: str = "") -> list[tuple[int, int, int, str]]:
    """Every launch of the job ``name`` (else the session's) any rank's log of ``session``
    holds: (generation, attempt, rank, host)."""
    found = []
    for log in sorted((work / ".meshkit" / session).glob("node*.log")):
        for match in LAUNCHED.finditer(log.read_text()):
            launched, generation, attempt, rank, host = match.groups()
            if launched == (name or session):
                found.append((int(generation), int(attempt), int(rank), host))
    return sorted(found)


def running(lay, index: int, name: str) -> list[str]:
    """The job's processes on node ``index`` (its script's, the job ``name``'s)."""
    out = sandbox.node_exec(lay.nodes[index], ["pgrep", "-af", f"{SCRIPT} {name}$"])
    return [line for line in out.stdout.splitlines() if "pgrep" not in line]


def supervising(lay, index: int, session: str) -> list[str]:
    """The session's supervisor processes on node ``index``."""
    out = sandbox.node_exec(lay.nodes[index], ["pgrep", "-af", "meshkit supervise"])
    return [line for line in out.stdout.splitlines() if f"--session {session} " in line]


def tmux_sessions(lay, index: int) -> list[str]:
    """The tmux sessions on node ``index`` (none: no server)."""
    out = sandbox.node_exec(lay.nodes[index], ["tmux", "list-sessions", "-F", "#S"])
    return out.stdout.split()


def status(lay, work: Path, session: str, node: int, hostfile: Path) -> list[dict[str, object]]:
    """``status --json`` inside node ``node`` (it exits 1 when a node does not answer)."""
    args = ["status", "--session", session, "--hostfile", str(hostfile), "--json"]
    out = on_node(lay, node, work, *args)
    assert out.stdout.strip(), out.stdout + out.stderr
    return json.loads(out.stdout)


def supervisor_logs(work: Path, session: str) -> str:
    """Every supervisor log of ``session``, one after the other."""
    logs = sorted((work / ".meshkit" / session).glob("supervisor-node*.log"))
    return "\n".join(log.read_text() for log in logs)


def split(lay, one: list[int], other: list[int]) -> None:
    """A partition: every link between a node of ``one`` and a node of ``other`` cut."""
    for left in one:
        for right in other:
            sandbox.cut(lay, left, right)


def heal(lay, one: list[int], other: list[int]) -> None:
    for left in one:
        for right in other:
            sandbox.mend(lay, left, right)


@contextlib.contextmanager
def logs_if_failed(work: Path, session: str) -> Iterator[None]:
    """Print every log of ``session`` should the block fail (pytest shows what a failed test
    printed): a partition scenario's failure is read in its supervisors' logs."""
    try:
        yield
    except BaseException:
        for log in sorted((work / ".meshkit" / session).glob("*.log")):
            print(f"----- {log.name}\n{log.read_text()}")
        raise
