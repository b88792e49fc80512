"""A sandbox node made slow: its CPU capped, as a fail-slow machine's is, node by node, live.

Each capped node has a cgroup of its own, ``<cpu hierarchy>/meshkit-sandbox-<name>/node<i>``,
whose CPU quota is a FRACTION of the node's own CPU per 100 ms period (cgroup v1:
``cpu.cfs_period_us`` and ``cpu.cfs_quota_us``; cgroup v2: ``cpu.max``). A sandbox node's CPU
is its share of this machine, the machine's CPUs over the sandbox's nodes (``share``): with
``--cpu 0.33`` on 2 CPUs and 5 nodes, the node's processes together get a third of 0.4 CPU, as a
real node capped at a third of its cores would be to its peers. On a loaded machine, where a
node gets less than its quota anyway, a quota binds nothing: so the group's weight (``cpu.shares``,
``cpu.weight``) is FRACTION of one busy process's too, and the sandbox's group, which holds the
capped nodes, weighs their fractions' sum: under contention a node capped at a third gets a third
of what an uncapped node's process gets. Every process of the node (those whose
network namespace is the node's) is moved into it at each call; those started later through the
node's sshd inherit it. Processes entered from outside (``node_exec``'s nsenter) are not the
sshd's descendants and do not, until the next call.

The cap is this machine's record of the node (``cpu.json`` in the node's directory): a reboot or a
poweron (``restore``) puts the new sshd back in the group. ``--cpu 1`` (or more) lifts the quota
and drops the record; ``remove`` (at ``sandbox.down``) removes the sandbox's groups.
"""

from __future__ import annotations

import errno
import json
import math
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

from ..errors import SandboxError
from .layout import Layout, Node
from .system import netns_pids

PERIOD_US = 100_000
MIN_CPU = 0.01  # cgroup v1 refuses a quota under 1 ms a period
RECORD = "cpu.json"  # in the node's directory
GROUP_PREFIX = "meshkit-sandbox-"
MOUNTS = Path("/proc/self/mounts")
JOIN_ROUNDS = 5  # a process may fork while its parent is moved: list the node again
REMOVE_TRIES = 20  # a killed process leaves its cgroup a moment after SIGKILL
V1 = 1
V2 = 2
WEIGHT_FILE = {V1: "cpu.shares", V2: "cpu.weight"}
DEFAULT_WEIGHT = {V1: 1024, V2: 100}  # one busy process's, as the kernel weighs it
WEIGHT_RANGE = {V1: (2, 262144), V2: (1, 10000)}


@dataclass(frozen=True)
class Hierarchy:
    """Where cgroups with the cpu controller are made: cgroup v1's cpu mount or the v2 one."""

    mount: Path
    version: int  # V1 or V2

    def sandbox_group(self, name: str) -> Path:
        return self.mount / f"{GROUP_PREFIX}{name}"

    def node_group(self, name: str, node: Node) -> Path:
        return self.sandbox_group(name) / node.name


@dataclass(frozen=True)
class Cap:
    """A node's CPU now: ``cpu`` None is no cap; ``processes``: the node's, in its group."""

    node: str
    cpu: float | None
    group: Path | None
    processes: int


def check(cpu: float) -> None:
    """Refuse a share that cannot be a quota (what, and the fix)."""
    if not math.isfinite(cpu) or cpu <= 0:
        raise SandboxError(f"--cpu {cpu}: give a share of the node's CPU above 0, e.g. 0.33")
    if cpu < MIN_CPU:
        raise SandboxError(f"--cpu {cpu}: at least {MIN_CPU} (1 ms of CPU each 100 ms)")


def capped(cpu: float) -> bool:
    """Whether ``cpu`` caps the node: 1 (a whole CPU) or more lifts the cap."""
    return cpu < 1


def share(sandbox: Layout) -> float:
    """A sandbox node's own CPU: this machine's CPUs over the sandbox's nodes."""
    return (os.cpu_count() or 1) / max(1, sandbox.count)


def quota_us(cpu: float, own: float = 1.0) -> int:
    """The node's CPU time per period, in microseconds: ``cpu`` of its ``own`` CPUs."""
    return max(round(cpu * own * PERIOD_US), round(MIN_CPU * PERIOD_US))


def limits(version: int, cpu: float | None, own: float = 1.0) -> dict[str, str]:
    """The files to write in the node's group, in order; ``cpu`` None: no quota. ``own``: the
    node's own CPUs (``share``)."""
    if version == V1:
        quota = "-1"
        if cpu is not None:
            quota = str(quota_us(cpu, own))
        files = {"cpu.cfs_period_us": str(PERIOD_US), "cpu.cfs_quota_us": quota}
    else:
        quota = "max"
        if cpu is not None:
            quota = str(quota_us(cpu, own))
        files = {"cpu.max": f"{quota} {PERIOD_US}"}
    return {**files, **weight(version, cpu)}


def weight(version: int, cpu: float | None) -> dict[str, str]:
    """A group's weight under contention: ``cpu`` of one busy process's (None: one's)."""
    default = DEFAULT_WEIGHT[version]
    value = default
    if cpu is not None:
        value = round(default * cpu)
    low, high = WEIGHT_RANGE[version]
    return {WEIGHT_FILE[version]: str(min(high, max(low, value)))}


def _weigh_sandbox(sandbox: Layout, found: Hierarchy) -> None:
    """The sandbox's group weighs what its capped nodes do together (their fractions' sum)."""
    top = found.sandbox_group(sandbox.name)
    if not top.is_dir():
        return
    fractions = [recorded(sandbox, node) for node in sandbox.nodes]
    total = sum(fraction for fraction in fractions if fraction is not None)
    _set(top, weight(found.version, total if total > 0 else None))


def _unescape(field: str) -> str:
    """A path as /proc/mounts writes it: space, tab, newline and backslash as octal escapes."""
    return re.sub(r"\\([0-7]{3})", lambda found: chr(int(found.group(1), 8)), field)


def hierarchies(mounts: str) -> list[Hierarchy]:
    """The candidate hierarchies in /proc/mounts text: v1's with the cpu controller first (the
    v2 one then has no cpu controller), then v2's."""
    first = []
    second = []
    for line in mounts.splitlines():
        fields = line.split()
        if len(fields) < 4:
            continue
        mount = Path(_unescape(fields[1]))
        if fields[2] == "cgroup" and "cpu" in fields[3].split(","):
            first.append(Hierarchy(mount, V1))
        elif fields[2] == "cgroup2":
            second.append(Hierarchy(mount, V2))
    return first + second


def _has_cpu(hierarchy: Hierarchy) -> bool:
    if hierarchy.version == V1:
        return True
    try:
        controllers = (hierarchy.mount / "cgroup.controllers").read_text().split()
    except OSError:
        return False
    return "cpu" in controllers


def hierarchy() -> Hierarchy:
    """The hierarchy to cap nodes in, or why there is none and the fix."""
    try:
        mounts = MOUNTS.read_text()
    except OSError as exc:
        raise SandboxError(f"cannot read {MOUNTS} to find the cgroups: {exc.strerror}") from None
    for found in hierarchies(mounts):
        if _has_cpu(found):
            return found
    raise SandboxError(
        "no cgroup hierarchy with the cpu controller on this machine, so a node's CPU cannot be "
        "capped; mount one: mount -t cgroup -o cpu cgroup /sys/fs/cgroup/cpu (cgroup v1), or "
        "enable cpu in cgroup v2's root (its cgroup.controllers)"
    )


def recorded(sandbox: Layout, node: Node) -> float | None:
    """The node's cap as recorded, or None."""
    try:
        data = json.loads((sandbox.node_dir(node) / RECORD).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict):
        return None
    cpu = data.get("cpu")
    if isinstance(cpu, int | float) and math.isfinite(cpu) and MIN_CPU <= cpu < 1:
        return float(cpu)
    return None


def _record(sandbox: Layout, node: Node, cpu: float | None) -> None:
    path = sandbox.node_dir(node) / RECORD
    if cpu is None:
        path.unlink(missing_ok=True)
        return
    temporary = path.with_suffix(".tmp")
    temporary.write_text(json.dumps({"cpu": cpu}))
    os.replace(temporary, path)


def _write(path: Path, text: str) -> None:
    """One write of ``text`` (a cgroup file takes each value in a write of its own)."""
    descriptor = os.open(path, os.O_WRONLY)
    try:
        os.write(descriptor, text.encode())
    finally:
        os.close(descriptor)


def _made(hierarchy: Hierarchy, name: str, node: Node) -> Path:
    """The node's group, made where missing (v2: the cpu controller enabled on the way)."""
    group = hierarchy.node_group(name, node)
    try:
        if hierarchy.version == V2:
            _enable_cpu(hierarchy.mount)
        hierarchy.sandbox_group(name).mkdir(exist_ok=True)
        if hierarchy.version == V2:
            _enable_cpu(hierarchy.sandbox_group(name))
        group.mkdir(exist_ok=True)
    except OSError as exc:
        raise SandboxError(
            f"cannot make the cgroup {group}: {exc.strerror}; a node's CPU is capped as root, "
            "in a cgroup hierarchy this machine lets root change"
        ) from None
    return group


def _enable_cpu(parent: Path) -> None:
    control = parent / "cgroup.subtree_control"
    if "cpu" not in control.read_text().split():
        _write(control, "+cpu")


def _set(group: Path, files: dict[str, str]) -> None:
    for file, value in files.items():
        try:
            _write(group / file, value)
        except OSError as exc:
            raise SandboxError(
                f"cannot write {value!r} to {group / file}: {exc.strerror}"
            ) from None


def members(group: Path) -> set[int]:
    """The processes in ``group`` (none where it is gone)."""
    try:
        listed = (group / "cgroup.procs").read_text()
    except OSError:
        return set()
    return {int(pid) for pid in listed.split()}


def _move(pids: list[int], group: Path) -> None:
    for pid in pids:
        try:
            _write(group / "cgroup.procs", str(pid))
        except OSError as exc:
            if exc.errno == errno.ESRCH:  # exited meanwhile
                continue
            raise SandboxError(f"cannot move process {pid} into {group}: {exc.strerror}") from None


def join(node: Node, group: Path) -> int:
    """Every process of the node into ``group``, again while new ones appear; how many are in."""
    pids = netns_pids(node.netns)
    for _round in range(JOIN_ROUNDS):
        inside = members(group)
        outside = [pid for pid in pids if pid not in inside]
        if not outside:
            break
        _move(outside, group)
        pids = netns_pids(node.netns)
    inside = members(group)
    return len([pid for pid in pids if pid in inside])


def slow(sandbox: Layout, index: int, cpu: float) -> Cap:
    """Cap node ``index`` at ``cpu`` of its own CPU (``share``), or lift its cap (``cpu`` 1 or
    more)."""
    check(cpu)
    node = sandbox.node(index)
    if not capped(cpu):
        return _lift(sandbox, node)
    found = hierarchy()
    group = _made(found, sandbox.name, node)
    _set(group, limits(found.version, cpu, share(sandbox)))
    _record(sandbox, node, cpu)
    _weigh_sandbox(sandbox, found)
    return Cap(node.name, cpu, group, join(node, group))


def _lift(sandbox: Layout, node: Node) -> Cap:
    """No quota on the node's group (its processes stay in it, now free); no record."""
    _record(sandbox, node, None)
    try:
        mounts = MOUNTS.read_text()
    except OSError:
        mounts = ""
    for found in hierarchies(mounts):
        group = found.node_group(sandbox.name, node)
        if group.is_dir():
            _set(group, limits(found.version, None))
            _weigh_sandbox(sandbox, found)
    return Cap(node.name, None, None, 0)


def restore(sandbox: Layout, node: Node) -> None:
    """After a node booted: its recorded cap on its fresh processes."""
    cpu = recorded(sandbox, node)
    if cpu is None:
        return
    found = hierarchy()
    group = _made(found, sandbox.name, node)
    _set(group, limits(found.version, cpu, share(sandbox)))
    _weigh_sandbox(sandbox, found)
    join(node, group)


def remove(name: str) -> list[str]:
    """The sandbox's groups removed, any process left in them moved out to the hierarchy's root
    first; safe to repeat. Returns the groups removed."""
    try:
        mounts = MOUNTS.read_text()
    except OSError:
        return []
    removed = []
    for found in hierarchies(mounts):
        top = found.sandbox_group(name)
        if not top.is_dir():
            continue
        groups = [child for child in top.iterdir() if child.is_dir()]
        for group in [*groups, top]:
            _remove_group(group, found.mount)
        removed.append(str(top))
    return removed


def _remove_group(group: Path, out: Path) -> None:
    """``group`` removed; what is left in it moved to ``out`` (a killed process leaves its group
    a moment after SIGKILL, so a busy group is tried again, a while)."""
    for _try in range(REMOVE_TRIES):
        if not group.is_dir():
            return
        _move(sorted(members(group)), out)
        try:
            group.rmdir()
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.05)
            continue
        return
    raise SandboxError(f"cannot remove the cgroup {group}: processes stay in it; kill them")
