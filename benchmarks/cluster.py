"""The main sweep's clusters: the benchmark's own sandbox (its name, the nodes' bashrc and key
exchange), the meshkit it runs (the wheel's console script, set by ``use_meshkit``), the floor,
and the end-state check of a mesh (strict all-pairs logins)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from meshkit import sandbox
from meshkit.sandbox.layout import default_dir, default_subnet

from . import stats
from .harness import StepFailed, bound, run

# The benchmark's own sandbox (``--name``): several checkouts can each run one at once.
NAME = "bench"
DIR = default_dir("/var/tmp/meshkit-bench-sandbox", NAME)
SUBNET = default_subnet("10.77.0.0/24", NAME)
BASHRC = "conda"  # the nodes' ~/.bashrc (``--bashrc``)
# the nodes' sshd keeps OpenSSH's key exchanges: the peers' ssh clients pay what they would on a
# stock node (sntrup761x25519 on Debian 12), where the sandbox's default is cheaper
KEX = "openssh"
# meshkit as users run it: the console script of the wheel's venv (set by use_meshkit; see
# peers.install_meshkit). Not `python -m meshkit`: that puts the working directory first on the
# module path, so run from this checkout it imported the checkout, not the wheel.
PYTHON = sys.executable
MESHKIT = [str(Path(sys.executable).parent / "meshkit")]
TORCHRUN = Path(sys.executable).parent / "torchrun"
PER_NODE = 2


def name_sandbox(name: str, bashrc: str) -> None:
    """The run's sandbox: its name (``--name``, already checked) and the nodes' ``~/.bashrc``."""
    global NAME, DIR, SUBNET, BASHRC
    NAME = name
    DIR = default_dir("/var/tmp/meshkit-bench-sandbox", NAME)
    SUBNET = default_subnet("10.77.0.0/24", NAME)
    BASHRC = bashrc


def use_meshkit(product: Path) -> None:
    """Run meshkit, its interpreter and torchrun from ``product``, the bin directory of the venv
    the wheel was installed into."""
    global PYTHON, TORCHRUN
    PYTHON = str(product / "python")
    MESHKIT[:] = [str(product / "meshkit")]
    TORCHRUN = product / "torchrun"


def ssh(lay: sandbox.Layout, node: sandbox.Node, command: str) -> list[str]:
    return ["ssh", "-F", str(lay.ssh_config), "-o", "BatchMode=yes", node.name, command]


def names(lay: sandbox.Layout) -> list[str]:
    return [n.name for n in lay.nodes]


def floor(lay: sandbox.Layout) -> None:
    procs = [subprocess.Popen(ssh(lay, n, "true"), stdout=subprocess.DEVNULL) for n in lay.nodes]
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(bound(lay.count)))
        except subprocess.TimeoutExpired:
            p.kill()
            codes.append(-1)
    if any(codes):
        raise StepFailed("floor: a plain ssh login failed")


def logins(lay: sandbox.Layout) -> list[int]:
    pattern = re.compile(rf"Accepted publickey for \S+ from {re.escape(lay.controller_address)} ")
    return [len(pattern.findall(lay.sshd_log(n).read_text())) for n in lay.nodes]


def reset_logs(lay: sandbox.Layout) -> None:
    for n in lay.nodes:
        lay.sshd_log(n).write_text("")


@dataclass(frozen=True)
class Checked:
    """What an end-state check covered: ``pairs`` ordered pairs of the cluster's ``of``."""

    scope: str
    pairs: int
    of: int


def check_pairs(lay: sandbox.Layout, n2_max: int) -> Checked:
    """Strict all-pairs logins, by meshkit check (by address and by name); above n2_max nodes only
    among 4 nodes spread over the cluster. Returns what was checked; raises if a pair fails."""
    argv = [*MESHKIT, "check", "--hostfile", str(lay.hostfile), "--json"]
    scope = f"all {lay.count}x{lay.count} pairs"
    pick = list(range(lay.count))
    if lay.count > n2_max:
        pick = sorted({0, lay.count // 3, 2 * lay.count // 3, lay.count - 1})
        argv += ["--include", ",".join(lay.nodes[i].address for i in pick)]
        scope = f"{len(pick)}x{len(pick)} pairs among nodes {pick} (sampled above --n2-max)"
    out = run(argv, bound(lay.count, per_pair=1.0))
    try:
        doc = json.loads(out.stdout)
    except json.JSONDecodeError as exc:
        raise StepFailed(
            f"check gave no JSON (exit {out.returncode}): {out.stderr[-300:]}"
        ) from exc
    failures = stats.pair_failures(doc)
    if failures or out.returncode != 0:
        raise StepFailed(f"{len(failures)} failed pairs of {scope}, e.g. {failures[:2]}")
    return Checked(scope, len(pick) * len(pick), lay.count * lay.count)


def up(n: int) -> sandbox.Layout:
    return sandbox.up(DIR, SUBNET, n, NAME, bashrc=BASHRC, kex=KEX)


def neighbours() -> dict[str, object]:
    """What else this machine is doing: its load average and the nodes of sandboxes other than
    the benchmark's (other checkouts' tests and measurements share the cores)."""
    names = run(["ip", "netns", "list"], 30).stdout.split()
    others = [
        x for x in names if x.startswith("meshkit-") and not x.startswith(f"meshkit-{NAME}-n")
    ]
    return {
        "at": time.strftime("%H:%M:%SZ", time.gmtime()),
        "load_average_1m": round(os.getloadavg()[0], 1),
        "other_sandbox_nodes": len(others),
    }


def node_shell() -> dict[str, object]:
    """Every remote command runs the user's bash, which reads ~/.bashrc: what it costs is part of
    every login of every tool here, so the results name it and carry its text."""
    return {
        "bashrc": BASHRC,
        "about": sandbox.BASHRCS[BASHRC],
        "text": sandbox.CONDA_BASHRC if BASHRC == "conda" else sandbox.NODE_BASHRC,
    }
