"""What every benchmark script shares: a step run with a bound on its time (``run``, ``must``,
``StepFailed``), this machine's CPU (``machine_busy``, ``settle``, ``cpu_steal``) and what a
results file records about its run (``commit``, ``machine``)."""

from __future__ import annotations

import os
import platform
import re
import shlex
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
REPO = Path(__file__).resolve().parent.parent


class StepFailed(Exception):
    """A variant did not finish or did not reach its end state; the message says why."""


def bound(n: int, base: float = 180.0, per_node: float = 2.0, per_pair: float = 0.0) -> float:
    """Time limit of one step at N nodes: generous, but every step ends."""
    return base + per_node * n + per_pair * n * n


def run(
    argv: Sequence[str],
    timeout: float,
    *,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(
            list(argv),
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
            cwd=cwd,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        raise StepFailed(f"{shlex.join(argv)[:200]}: no end within {timeout:.0f}s") from exc


def must(argv: Sequence[str], timeout: float, **kw: object) -> str:
    out = run(argv, timeout, **kw)  # type: ignore[arg-type]
    if out.returncode != 0:
        lines = (out.stdout + out.stderr).strip().splitlines()
        # The lines that say what failed (a doctor's failed checks come before its summary),
        # then the last three.
        bad = [x for x in lines[:-3] if re.search(r"fail|error|FAIL|✗|not ", x)][:6]
        raise StepFailed(
            f"{shlex.join(argv)[:200]} exited {out.returncode}: {' | '.join(bad + lines[-3:])}"
        )
    return out.stdout


def cpu_steal() -> float:
    """CPU seconds this machine's cores have had stolen by the hypervisor since boot: other
    tenants' work on the same physical cores (recorded per run, start and end)."""
    with open("/proc/stat") as handle:
        fields = [int(v) for v in handle.readline().split()[1:9]]
    return fields[7] / os.sysconf("SC_CLK_TCK")


def machine_busy() -> float:
    """CPU seconds all of this machine's cores have spent busy since boot (/proc/stat)."""
    with open("/proc/stat") as handle:
        fields = [int(v) for v in handle.readline().split()[1:9]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def settle(limit: float = 15.0, window: float = 0.5, idle: float = 0.1) -> float:
    """Before a launch: wait until this machine is idle (under ``idle`` of one core busy over
    ``window`` seconds), at most ``limit`` seconds; the seconds waited. Back to back, whatever
    one launch left winding down (sshd sessions closing, interpreters exiting) would be taken
    from the next one's ranks."""
    start = time.monotonic()
    while time.monotonic() - start < limit:
        before = machine_busy()
        time.sleep(window)
        if machine_busy() - before < idle * window:
            break
    return time.monotonic() - start


def commit() -> dict[str, object]:
    """The commit measured (this checkout's HEAD) and whether the tree differed from it."""

    def git(*args: str) -> str:
        out = run(["git", "-C", str(REPO), *args], 30)
        return out.stdout.strip() if out.returncode == 0 else ""

    return {
        "commit": git("rev-parse", "HEAD") or "unknown",
        "subject": git("log", "-1", "--format=%s")[:200],
        "dirty": bool(git("status", "--porcelain", "--untracked-files=no")),
    }


def machine() -> dict[str, object]:
    mem = next(
        (
            line.split()[1]
            for line in Path("/proc/meminfo").read_text().splitlines()
            if line.startswith("MemTotal")
        ),
        "0",
    )
    ssh_v = subprocess.run(
        ["ssh", "-V"], capture_output=True, text=True, check=False
    ).stderr.strip()
    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.processor(),
    )
    return {
        "cpus": os.cpu_count(),
        "cpu_model": cpu,
        "memory_gib": round(int(mem) / 1024 / 1024, 1),
        "python": platform.python_version(),
        "openssh": ssh_v,
        "kernel": platform.release(),
        "machine": platform.machine(),
        "quiet_machine": "UNSET: the person running the sweep states here whether nothing else ran",
    }


def shared_run(
    measured: dict[str, object], begun: float, load_start: tuple[float, float, float]
) -> dict[str, object]:
    """The head of the results of a run that other sessions may share the machine with: the
    commit (``measured``), the machine, when it started, and its load averages at the start and
    at the end, which say how busy it was."""
    where = machine()
    where["quiet_machine"] = "not known: see load_average_start and load_average_end"
    return {
        **measured,
        "machine": where,
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(begun)),
        "load_average_start": [round(value, 2) for value in load_start],
        "load_average_end": [round(value, 2) for value in os.getloadavg()],
    }
