"""Real Open MPI (Debian openmpi-bin) as a client of the mesh and as a rank source: after
``meshkit mesh --hostfile <addresses>``, mpirun started *inside* a node launches orted on the others
over the mesh's SSH (BatchMode, strict host keys), and every process's ``meshkit env`` and
``init_distributed()`` agree with the hostfile whatever order ``-H`` lists the nodes in."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from conftest import fresh_sandbox, meshkit, sandbox_name

from meshkit import sandbox

NODES = 4
NAME = sandbox_name(__name__)
MPI_TIMEOUT = 300.0  # bounds, not speed checks: torch imports crawl on a loaded machine
# Where a process runs and what it says, as one file per process in a shared directory (mpirun
# interleaves the processes' output).
WHERE = (
    "import os, pathlib, socket, subprocess, sys\n"
    "out = subprocess.run(sys.argv[2:], capture_output=True, text=True, timeout=120)\n"
    "text = (out.stdout.strip() or out.stderr.strip()).replace('\\n', ' | ')\n"
    "name = f\"{socket.gethostname()}.{os.environ['OMPI_COMM_WORLD_RANK']}\"\n"
    "line = f'{socket.gethostname()} {out.returncode} {text}'\n"
    "pathlib.Path(sys.argv[1], name).write_text(line)\n"
)
TRAIN = """\
import pathlib
import socket

import torch
import torch.distributed as dist

from meshkit.torch import init_distributed

place = init_distributed(hostfile={hostfile!r}, timeout=240)
value = torch.tensor([float(place.rank + 1)])
dist.all_reduce(value)
line = f"RESULT {{socket.gethostname()}} {{place.rank}} {{place.world_size}} {{value.item()}}"
pathlib.Path({results!r}, f"rank{{place.rank}}").write_text(line)  # mpirun interleaves stdout
dist.destroy_process_group()
"""


@pytest.fixture(scope="module")
def lay() -> Iterator[sandbox.Layout]:
    with fresh_sandbox(NAME, NODES) as layout:
        done = meshkit(
            "mesh",
            "--hostfile",
            str(layout.hostfile),
            env={"MESHKIT_CONNECT_TIMEOUT": "5"},
            timeout=400,  # a bound, not a speed check: CI machines run other sandboxes too
        )
        assert done.returncode == 0, done.stdout + done.stderr
        yield layout


def mpirun(
    lay: sandbox.Layout,
    launcher: int,
    order: Sequence[int],
    per_node: int,
    argv: Sequence[str],
    *extra: str,
) -> tuple[int, str]:
    """Real mpirun started inside node ``launcher``, by address, nodes in ``order``."""
    hosts = ",".join(f"{lay.nodes[i].address}:{per_node}" for i in order)
    done = sandbox.node_exec(
        lay.nodes[launcher],
        [
            "timeout",
            str(int(MPI_TIMEOUT)),
            "mpirun",
            "--allow-run-as-root",
            "-H",
            hosts,
            "-npernode",
            str(per_node),
            "-wdir",
            "/",  # no ./hostfile there: discovery sees only what the test passes
            "--mca",
            "btl_tcp_if_include",
            "eth0",
            "--mca",
            "oob_tcp_if_include",
            "eth0",
            *extra,
            *argv,
        ],
        timeout=MPI_TIMEOUT + 10,
    )
    return done.returncode, done.stdout + done.stderr


def results(lay: sandbox.Layout) -> Path:
    """An empty shared directory for the processes' reports."""
    out = Path(lay.shared) / "cmpi-results"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir()
    return out


def env_lines(lay: sandbox.Layout) -> list[tuple[str, int, str]]:
    """(host, exit code, output) of every process of the last ``where`` run."""
    rows = []
    for path in sorted((Path(lay.shared) / "cmpi-results").iterdir()):
        host, rc, text = path.read_text().split(" ", 2)
        rows.append((host, int(rc), text))
    return rows


def where(lay: sandbox.Layout, *argv: str) -> list[str]:
    return [sys.executable, "-c", WHERE, str(results(lay)), *argv]


@pytest.mark.parametrize("launcher", [0, 2])
@pytest.mark.parametrize("per_node", [1, 2])
@pytest.mark.parametrize("reverse", [False, True])
def test_env_under_mpirun_follows_the_hostfile(
    lay: sandbox.Layout, launcher: int, per_node: int, reverse: bool
) -> None:
    order = list(range(NODES))[::-1] if reverse else list(range(NODES))
    rc, out = mpirun(
        lay,
        launcher,
        order,
        per_node,
        where(
            lay, sys.executable, "-m", "meshkit", "env", "--json", "--hostfile", str(lay.hostfile)
        ),
    )
    assert rc == 0, out
    rows = env_lines(lay)
    assert len(rows) == NODES * per_node, out
    seen: dict[str, set[str]] = {}
    for host, code, text in rows:
        assert code == 0, text
        got = json.loads(text)
        index = int(host.removeprefix("node"))
        # every process of a node says the node's hostfile line, never its index on the node
        assert got["NODE_RANK"] == str(index), (host, got)
        assert got["MASTER_ADDR"] == lay.nodes[0].address
        assert (got["NNODES"], got["NPROC_PER_NODE"], got["WORLD_SIZE"]) == (
            str(NODES),
            str(per_node),
            str(NODES * per_node),
        )
        assert got["source"] == "openmpi"
        assert got["matched"].startswith(f"{lay.nodes[index].address} on eth0")
        assert got["matched"].endswith("NPROC_PER_NODE from OMPI_COMM_WORLD_LOCAL_SIZE")
        seen.setdefault(host, set()).add(got["NODE_RANK"])
    assert sorted(seen) == [n.name for n in lay.nodes]
    assert all(len(v) == 1 for v in seen.values())


def test_env_under_mpirun_without_hostfile_derives_or_refuses(lay: sandbox.Layout) -> None:
    # Launched from node2 with node2 first: mpirun's rank 0 is on node2, so node2 is node 0.
    order = [2, 3, 0, 1]
    first = lay.nodes[2].address

    def run(per_node: int, *extra: str) -> tuple[list[tuple[str, int, str]], str]:
        _, out = mpirun(
            lay,
            2,
            order,
            per_node,
            where(lay, sys.executable, "-m", "meshkit", "env", "--json"),
            *extra,
        )
        rows = env_lines(lay)
        assert len(rows) == NODES * per_node, out
        return rows, " ".join(text for _, _, text in rows)

    rows, text = run(2, "-x", f"MASTER_ADDR={first}")
    assert {(host, json.loads(out)["NODE_RANK"]) for host, _, out in rows} == {
        ("node2", "0"),
        ("node3", "1"),
        ("node0", "2"),
        ("node1", "3"),
    }, text
    assert "OMPI_COMM_WORLD_RANK // OMPI_COMM_WORLD_LOCAL_SIZE" in text

    # A master that is not rank 0's node: refused on the nodes that see the contradiction.
    rows, text = run(1, "-x", f"MASTER_ADDR={lay.nodes[0].address}")
    assert {(h, c != 0) for h, c, _ in rows} == {
        ("node2", True),
        ("node0", True),
        ("node1", False),
        ("node3", False),
    }, text
    assert "is not this machine, but openmpi makes this node 0" in text
    assert "is this machine, but openmpi makes it node 2" in text
    assert "Traceback" not in text

    # Nothing to go on: says what is needed.
    rows, text = run(1)
    assert all(c != 0 for _, c, _ in rows), text
    assert "MASTER_ADDR is not set" in text
    assert "--hostfile" in text

    # Interleaved ranks (--map-by node): the node cannot be told from the rank.
    rows, text = run(2, "-x", f"MASTER_ADDR={first}", "--map-by", "node")
    assert all(c != 0 for _, c, _ in rows), text
    assert "not one block" in text
    assert "--map-by node interleaves" in text


@pytest.mark.parametrize("per_node", [1, 2])
def test_init_distributed_under_mpirun_in_reverse_order(lay: sandbox.Layout, per_node: int) -> None:
    script = Path(lay.shared) / "cmpi_train.py"
    script.write_text(TRAIN.format(hostfile=str(lay.hostfile), results=str(results(lay))))
    # From node3 with -H reversed: mpirun's rank 0 runs on node3, far from MASTER_ADDR (node0).
    rc, out = mpirun(lay, 3, [3, 2, 1, 0], per_node, [sys.executable, str(script)])
    assert rc == 0, out
    reports = [p.read_text().split() for p in (Path(lay.shared) / "cmpi-results").iterdir()]
    world = NODES * per_node
    assert len(reports) == world, out
    assert sorted(int(r[2]) for r in reports) == list(range(world))
    assert {float(r[4]) for r in reports} == {float(world * (world + 1) // 2)}
    # the torch rank follows the hostfile: rank 0 (and the store) on the master node
    assert {r[1] for r in reports if int(r[2]) < per_node} == {"node0"}


def test_init_distributed_from_the_hostfile_alone_any_start_order(lay: sandbox.Layout) -> None:
    """No launcher: each node runs the script itself (as ``meshkit run`` would), node3 first; the
    hostfile makes node0 the host of the store, whichever process starts first."""
    script = Path(lay.shared) / "cmpi_train.py"
    script.write_text(TRAIN.format(hostfile=str(lay.hostfile), results=str(results(lay))))
    with ThreadPoolExecutor(NODES) as pool:
        runs = [
            pool.submit(
                sandbox.node_exec,
                lay.nodes[i],
                ["timeout", str(int(MPI_TIMEOUT)), sys.executable, str(script)],
                MPI_TIMEOUT + 10,
            )
            for i in reversed(range(NODES))
        ]
        outs = [r.result() for r in runs]
    assert all(o.returncode == 0 for o in outs), [o.stdout + o.stderr for o in outs]
    reports = sorted(
        p.read_text().split()[1:] for p in (Path(lay.shared) / "cmpi-results").iterdir()
    )
    assert reports == [[f"node{i}", str(i), str(NODES), "10.0"] for i in range(NODES)]


def test_pbs_nodefile_on_real_nodes(lay: sandbox.Layout) -> None:
    """PBS's nodefile (one line per slot), read on each node, found by the node's hostname."""
    nodefile = Path(lay.shared) / "cmpi.nodefile"
    nodefile.write_text("".join(f"{n.name}\n{n.name}\n" for n in lay.nodes))

    def env_on(node: sandbox.Node, *extra: str) -> subprocess.CompletedProcess[str]:
        return sandbox.node_exec(
            node,
            [
                "env",
                f"PBS_NODEFILE={nodefile}",
                *extra,
                sys.executable,
                "-m",
                "meshkit",
                "env",
                "--json",
            ],
        )

    for i, node in enumerate(lay.nodes):
        done = env_on(node)
        assert done.returncode == 0, done.stderr
        got = json.loads(done.stdout)
        assert (got["NODE_RANK"], got["MASTER_ADDR"], got["NPROC_PER_NODE"], got["source"]) == (
            str(i),
            "node0",
            "2",
            "pbs",
        )
    # a MASTER_ADDR of the user's that is not node 0 is refused where it shows
    wrong = f"MASTER_ADDR={lay.nodes[2].address}"
    outcomes = [env_on(n, wrong) for n in lay.nodes]
    assert [o.returncode != 0 for o in outcomes] == [True, False, True, False]
    assert "is this machine, but pbs makes it node 2" in outcomes[2].stderr
    assert "Traceback" not in outcomes[0].stderr + outcomes[2].stderr
