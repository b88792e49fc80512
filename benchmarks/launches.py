"""The launches of the example on one meshed cluster: ``meshkit train`` (with torchrun, or
``--spawn``), pdsh+torchrun and torchrunx, each on a settled machine and in a balanced order,
each until every rank is done and each rank's result line checked."""

from __future__ import annotations

import itertools
import os
import random
import shlex
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from meshkit import sandbox

from . import cluster, peers, stats
from .cluster import PER_NODE, names
from .harness import StepFailed, bound, must, settle
from .measurement import Options, Row


def job_dirs(lay: sandbox.Layout) -> dict[str, set[Path]]:
    """Each node's meshkit job state directories (node-private /tmp, read from the controller)."""
    found = {}
    for node in lay.nodes:
        root = lay.node_dir(node) / "tmp" / f"meshkit-{os.getuid()}" / "jobs"
        found[node.name] = set(root.iterdir()) if root.is_dir() else set()
    return found


def wait_exits(lay: sandbox.Layout, before: dict[str, set[Path]], timeout: float) -> dict[str, str]:
    """Until every node's new job wrote its exit file (no logins); node -> code.

    The harness shares this machine's two cores with the ranks it times, so its wait must cost
    next to nothing: it finds each node's new job directory once (``train`` created them all
    before it returned), then each poll stats only the first exit file still missing (every
    node must finish, so the others can wait their turn). Re-listing every node's directory at
    every poll would take noticeable CPU from meshkit's ranks, while pdsh+torchrun is timed by a
    blocking wait. Polls are 10 ms apart, so the end is seen about as soon as that blocking wait
    sees pdsh's; one stat per poll is still next to no CPU."""
    deadline = time.monotonic() + timeout
    exits: list[tuple[str, str]] = []
    for name, dirs in job_dirs(lay).items():
        exits += [(name, str(d / "exit")) for d in sorted(dirs - before[name])]
    if len({name for name, _ in exits}) < lay.count:
        raise StepFailed(f"a new job directory on only {len(exits)} of {lay.count} nodes")
    codes: dict[str, str] = {}
    for name, path in exits:
        while not os.path.exists(path):
            if time.monotonic() > deadline:
                raise StepFailed(f"ranks done on {sorted(codes)} only after {timeout:.0f}s")
            time.sleep(0.01)
        with open(path) as handle:
            codes[name] = handle.read().strip()
    return codes


def check_launch(text: str, n: int) -> None:
    problems = stats.launch_problems(stats.rank_lines(text), n, PER_NODE)
    if problems:
        raise StepFailed("; ".join(problems)[:400])


def launches(row: Row, lay: sandbox.Layout, workdir: Path, opt: Options, repeat: int) -> list[str]:
    """The launches, one after another on one meshed cluster: ``meshkit train`` until every
    session runs and until every rank is done, pdsh+torchrun and torchrunx until every rank is
    done. Each starts on a settled machine (``settle``), in an order that goes through all six
    orders of the three over six repeats (``launch_order``): in a fixed order (meshkit first,
    right after the cluster came up and after check's N² logins, the peers minutes later, after
    the doctor) one sweep had meshkit 1.02-1.12x pdsh+torchrun, another on the same meshkit code
    0.90-1.02x. Returns meshkit's job flags: its logs are read next. Above --launch-max, only
    every session up, with a command that needs no torch."""
    n = row.nodes
    hostfile = str(lay.hostfile)
    if n > opt.launch_max:
        # What --launch-max bounds is 2 torch processes per node sharing this machine's cores.
        job = ["--hostfile", hostfile, "--session", f"bup{repeat}", "--workdir", str(workdir)]
        light = "echo meshkit-bench up on node $NODE_RANK; sleep 600"
        row.sample(
            "train_running",
            "meshkit",
            lambda: must([*cluster.MESHKIT, "train", *job, "--cmd", light], bound(n, base=240)),
        )
        why = f"launch until done up to --launch-max {opt.launch_max}"
        for tool in ("meshkit", "pdsh_torchrun", "torchrunx"):
            row.skip("train_done", tool, why)
        if opt.spawn:  # the light command's launch is the same with --spawn
            row.skip("train_running", "meshkit_spawn", why)
            row.skip("train_done", "meshkit_spawn", why)
        time.sleep(1.0)  # the echo is in every log
        return job
    session = f"bex{repeat}"
    job = ["--hostfile", hostfile, "--session", session, "--workdir", str(workdir)]
    order: list[Callable[[], None]] = [
        lambda: launch_meshkit(row, lay, workdir, job, session),
        lambda: launch_pdsh(row, lay, workdir, opt),
        lambda: launch_torchrunx(row, lay, workdir, opt),
    ]
    if opt.spawn:
        spawn_job = ["--hostfile", hostfile, "--session", f"bsx{repeat}", "--workdir", str(workdir)]
        order.append(
            lambda: launch_meshkit(row, lay, workdir, spawn_job, f"bsx{repeat}", spawn=True)
        )
    for index in launch_order(repeat, len(order)):
        settle()
        order[index]()
    return job


LAUNCH_ORDERS = list(itertools.permutations(range(3)))
# Four launches (with --spawn): a Williams square, each launch in each place once and right after
# each other launch once in every four repeats (all 24 orders would take 24 repeats).
LAUNCH_ORDERS_4 = [(0, 1, 3, 2), (1, 2, 0, 3), (2, 3, 1, 0), (3, 0, 2, 1)]


def launch_order(repeat: int, count: int = 3) -> tuple[int, ...]:
    """Which launch runs first, second and third at this repeat: every one of the six orders once
    in six repeats, so each tool runs first, second and third equally often and right after
    each other tool equally often. (Rotating one order, as before, always ran meshkit right
    after torchrunx and pdsh+torchrun right after meshkit.) Four launches: LAUNCH_ORDERS_4."""
    orders = LAUNCH_ORDERS_4 if count == 4 else LAUNCH_ORDERS
    return orders[repeat % len(orders)]


def launch_meshkit(
    row: Row,
    lay: sandbox.Layout,
    workdir: Path,
    job: list[str],
    session: str,
    spawn: bool = False,
) -> None:
    """``meshkit train`` of the example: torchrun on every node, or (``spawn``) each node's ranks
    started by meshkit itself, the same script without torchrun."""
    n = row.nodes
    tool = "meshkit_spawn" if spawn else "meshkit"
    how = (
        ["--spawn", "--cmd", "python example_train.py"]
        if spawn
        else ["--cmd", "torchrun example_train.py"]
    )
    before = job_dirs(lay)
    start = time.perf_counter()

    def train() -> None:
        must(
            [
                *cluster.MESHKIT,
                "train",
                *job,
                "--nproc-per-node",
                str(PER_NODE),
                *how,
            ],
            bound(n, base=240),
        )

    row.sample("train_running", tool, train)
    if row.raw[f"train_running/{tool}"][-1] is None:
        return
    try:
        codes = wait_exits(lay, before, bound(n, base=300, per_node=10))
        if any(c != "0" for c in codes.values()):
            raise StepFailed(f"exit codes {codes}")
        row.add(f"train_done/{tool}", round(time.perf_counter() - start, 4))
        text = "".join(p.read_text() for p in (workdir / ".meshkit" / session).glob("node*.log"))
        check_launch(text, n)
        row.end_state.setdefault(f"train_done/{tool}", []).append(
            f"{n * PER_NODE} ranks, right sum"
        )
    except StepFailed as exc:
        row.add(f"train_done/{tool}", None)
        row.failures.setdefault(f"train_done/{tool}", []).append(str(exc))


def launch_pdsh(row: Row, lay: sandbox.Layout, workdir: Path, opt: Options) -> None:
    n = row.nodes
    if "pdsh" in opt.unavailable or n > opt.peers_max:
        row.skip(
            "train_done",
            "pdsh_torchrun",
            opt.unavailable.get("pdsh") or f"peers only up to --peers-max {opt.peers_max}",
        )
        return
    port = random.randint(20000, 40000)
    command = peers.pdsh_torchrun_command(workdir, cluster.TORCHRUN, n, PER_NODE, "node0", port)
    argv = peers.pdsh_argv(names(lay), command)
    out: list[str] = []

    def pdsh_launch() -> None:
        out.append(must(argv, bound(n, base=300, per_node=10), env=peers.pdsh_env(lay.ssh_config)))

    def pdsh_verify() -> str:
        check_launch(out[0], n)
        return f"{n * PER_NODE} ranks, right sum"

    row.sample("train_done", "pdsh_torchrun", pdsh_launch, pdsh_verify)


def launch_torchrunx(row: Row, lay: sandbox.Layout, workdir: Path, opt: Options) -> None:
    n = row.nodes
    why = opt.unavailable.get("torchrunx") or (
        None if n <= opt.peers_max else f"peers only up to --peers-max {opt.peers_max}"
    )
    if why:
        row.skip("train_done", "torchrunx", why)
        return
    trx: list[str] = []
    python = opt.bins["torchrunx"] / "python"

    def trx_launch() -> None:
        launch = [str(python), str(peers.TRX_SCRIPT), str(n), str(PER_NODE)]
        line = f"cd {shlex.quote(str(workdir))} && {shlex.join(launch)}"
        try:
            res = sandbox.node_exec(
                lay.nodes[0], ["bash", "-lc", line], timeout=bound(n, base=300, per_node=10)
            )
        except subprocess.TimeoutExpired as exc:
            raise StepFailed("torchrunx: no end in time") from exc
        if res.returncode != 0:
            raise StepFailed(f"torchrunx exited {res.returncode}: {res.stderr.strip()[-400:]}")
        trx.append(res.stdout)

    known = lay.node_dir(lay.nodes[0]) / "ssh" / "known_hosts"
    known_before = known.read_bytes() if known.exists() else b""

    def trx_verify() -> str:
        check_launch(trx[0], n)
        # fabric (under torchrunx) trusts unknown host keys (AutoAddPolicy): prove it had none
        # to trust, i.e. it only logged in to hosts meshkit mesh had made known.
        if (known.read_bytes() if known.exists() else b"") != known_before:
            raise StepFailed("torchrunx (fabric AutoAddPolicy) added a host key on node0")
        return f"{n * PER_NODE} ranks, right sum; no host key auto-added"

    row.sample("train_done", "torchrunx", trx_launch, trx_verify)
