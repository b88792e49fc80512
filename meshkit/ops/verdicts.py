"""The doctor's verdicts: one ``Check`` row per node (and per pair where a pair can fail), each a
pure function of the agents' replies, so they are unit-tested with plain data. The rounds that
gather the replies are ``ops/doctor.py``'s; the bandwidth verdicts are ``ops/bandwidth.py``'s.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from .. import protocol as p
from ..health import HealthState, NodeHealth, words
from ..hostfile import Host
from ..outcome import Outcome
from .pool import unanswered

if TYPE_CHECKING:  # annotations only: status imports the verdicts, and neither is on its path
    from ..verifyplan import PairFailure
    from .sync import Facts

# the order of the table: what a training job hits first comes first (a stable sort keeps nodes
# in rank order within each check)
ORDER = ["ssh", "rank", "interface", "facts", "versions", "gpus", "workdir", "clock", "health"]
ORDER += ["master port", "reach", "bandwidth", "networks", "infiniband", "collective"]
CLOCK_SKEW = 2.0  # seconds of clock difference tolerated (on top of the round trip)
IMPORT = re.compile(r"\bimport=(\d+(?:\.\d+)?)s\b")  # the probe's seconds to import torch
PROBE_PREFIX = "meshkit-probe "  # the collective probe's result line starts with it


@dataclass(frozen=True)
class Check:
    check: str  # one of ORDER
    node: str
    peer: str | None
    ok: bool
    detail: str
    fix: str = ""


def verdict(
    check: str, host: Host, ok: bool, detail: str, fix: str = "", peer: str | None = None
) -> Check:
    """One row about ``host``; its ``fix`` is said only when it failed."""
    if ok:
        fix = ""
    return Check(check, host.label, peer, ok, detail, fix)


def ssh_checks(hosts: Sequence[Host], failures: Sequence[PairFailure]) -> list[Check]:
    """One row per node that logs in everywhere; one row per broken pair (verify logs in by the
    hostfile spelling and checks the host key by hostname: a pair's errors are joined)."""
    checks = []
    for source in hosts:
        broken: dict[Host, list[str]] = {}
        for failure in failures:
            if failure.source == source:
                broken.setdefault(failure.target, []).append(failure.error)
        if not broken:
            checks.append(verdict("ssh", source, True, f"logs in to all {len(hosts)} nodes"))
        for target, errors in broken.items():
            detail = "; ".join(dict.fromkeys(errors))[:300]
            checks.append(verdict("ssh", source, False, detail, ssh_fix(detail), target.label))
    return checks


def ssh_fix(error: str) -> str:
    down = ("No route to host", "timed out", "Connection refused", "Network is unreachable")
    if any(symptom in error for symptom in down):
        return "the network between these two nodes is down (route, firewall, sshd not running)"
    return "run `meshkit mesh` (keys, known_hosts), then `meshkit check`"


def env_error(outcome: Outcome[p.EnvReply] | None, failure: str | None) -> str | None:
    """Why a node has no usable discovery: unreachable, its agent failed, or discovery there
    failed (its own message); None when it has one."""
    if outcome is None:
        return f"cannot connect: {failure or 'unknown'}"
    if outcome.value is None:
        return str(outcome.error)
    return outcome.value.error


def read_env(outcome: Outcome[p.EnvReply] | None, failure: str | None) -> p.EnvReply:
    """What discovery (``meshkit env``) said on one node; why it said nothing as its ``error``."""
    error = env_error(outcome, failure)
    if error is not None or outcome is None or outcome.value is None:
        return p.EnvReply({}, "", None, "", error)
    return outcome.value


def ifname(view: p.EnvReply) -> str | None:
    """The interface the node's backends will use (None when discovery chose none)."""
    name = view.variables.get("GLOO_SOCKET_IFNAME")
    if not name:
        return None
    return name


def env_checks(hosts: Sequence[Host], views: dict[Host, p.EnvReply]) -> list[Check]:
    checks = []
    for rank, host in enumerate(hosts):
        view = views[host]
        if view.error is not None:
            fix = "fix the node (see detail) and rerun"
            checks.append(verdict("rank", host, False, view.error, fix))
            continue
        checks.append(rank_check(host, rank, view))
        checks.append(interface_check(host, view, alone=len(hosts) == 1))
    return checks


def rank_check(host: Host, rank: int, view: p.EnvReply) -> Check:
    said = view.variables.get("NODE_RANK", "")
    number = None
    if said.isascii() and said.isdigit() and len(said) <= 9:  # a rank, not a node's 5,000 digits
        number = int(said)
    detail = f"NODE_RANK={number} (hostfile line {host.lineno} is rank {rank})"
    fix = "list this node in the hostfile as it sees itself (an address of one of its interfaces)"
    return verdict("rank", host, number == rank, detail, fix)


def interface_check(host: Host, view: p.EnvReply, alone: bool) -> Check:
    """A single node needs no interface: it talks to nobody."""
    found = ifname(view) is not None or alone
    if found:
        detail = f"{ifname(view)} ({view.interface_source})"
    elif view.interface_source:
        detail = view.interface_source
    else:
        detail = "no interface found"
    fix = (
        "list addresses (not names) in the hostfile, or set GLOO_SOCKET_IFNAME and "
        "NCCL_SOCKET_IFNAME (config meshkit.env)"
    )
    return verdict("interface", host, found, detail, fix)


def versions(reply: p.FactsReply) -> dict[str, str]:
    """What a node runs, by name; "-" for what it lacks."""
    found = {
        "python": reply.python,
        "torch": reply.torch,
        "meshkit": reply.meshkit,
        "CUDA": reply.cuda,
        "NCCL": reply.nccl,
    }
    return {name: version or "-" for name, version in found.items()}


def fact_checks(
    hosts: Sequence[Host], round_: Facts, failures: dict[Host, str], synced: bool = False
) -> list[Check]:
    """Versions equal to the master's; GPUs against the master's slots (every node runs that
    many ranks); the workdir shared and writable (a synced job's nodes hold copies: the master's
    marker is not expected there); clocks within CLOCK_SKEW of the controller's (``timing``: when
    each request left and its reply came back, controller time)."""
    checks: list[Check] = []
    slots = hosts[0].slots
    master = round_.replies.get(hosts[0])
    reference = None
    if master is not None:
        reference = master.value
    for host in hosts:
        outcome = round_.replies.get(host)
        if outcome is None or outcome.value is None:
            why = unanswered(outcome, host, failures)
            checks.append(verdict("facts", host, False, why, "fix the node and rerun"))
            continue
        reply = outcome.value
        checks.append(versions_check(host, reply, reference))
        checks.append(gpus_check(host, reply, slots))
        checks.append(workdir_check(host, reply, synced))
        checks.append(clock_check(host, reply, round_.timing.get(host)))
        if reply.health is not None:
            checks.append(health_check(host, reply.health))
    return checks


HEALTH_FIX = (
    "fix the node (the reasons above; `meshkit doctor` again shows it mended), or leave it "
    "out (--exclude) or give the job a spare (hostfile `spare`, train --restarts)"
)


def health_check(host: Host, health: NodeHealth) -> Check:
    """The node's health (``meshkit.health``): fails on ``unhealthy``; ``degraded`` and
    ``unknown`` pass, with their reasons in the detail."""
    ok = health.state != HealthState.UNHEALTHY
    return verdict("health", host, ok, words(health), HEALTH_FIX)


def versions_check(host: Host, reply: p.FactsReply, master: p.FactsReply | None) -> Check:
    mine = versions(reply)
    theirs = mine
    if master is not None:
        theirs = versions(master)
    differ = []
    for name in mine:
        if mine[name] != theirs[name]:
            differ.append(f"{name} {mine[name]} (master: {theirs[name]})")
    if differ:
        detail = "; ".join(differ)
    else:
        detail = ", ".join(f"{name} {version}" for name, version in mine.items() if version != "-")
    fix = "install the same versions on every node (same venv path)"
    return verdict("versions", host, not differ, detail, fix)


def gpus_check(host: Host, reply: p.FactsReply, slots: int | None) -> Check:
    """A node without GPUs is fine (CPU ranks); one with fewer GPUs than slots is not."""
    over = reply.gpus > 0 and slots is not None and slots > reply.gpus
    detail = f"{reply.gpus} GPUs"
    if slots is not None:
        detail += f", slots={slots}"
    fix = f"set slots={reply.gpus} (or fewer) in the hostfile"
    return verdict("gpus", host, not over, detail, fix)


def workdir_check(host: Host, reply: p.FactsReply, synced: bool) -> Check:
    marker = reply.marker
    # a synced job's node holds a copy: not seeing the master's marker there is expected
    copy = synced and marker.endswith((" is not there", " holds another run's token"))
    problems = []
    if reply.writable:
        problems.append(reply.writable)
    if marker not in ("written", "seen") and not copy:
        problems.append(f"marker: {marker}")
    if problems:
        detail = "; ".join(problems)
    elif marker == "seen":
        detail = "shared and writable"
    else:
        detail = "writable"
    if not problems and copy:
        detail += " (a synced copy)"
    fix = "put the workdir on storage every node mounts at the same path (or use train --sync)"
    return verdict("workdir", host, not problems, detail, fix)


def clock_check(host: Host, reply: p.FactsReply, timing: tuple[float, float] | None) -> Check:
    """The node's clock against the middle of its request's round trip; the round trip's half
    is tolerated on top of CLOCK_SKEW (the reply was read somewhere within it)."""
    sent = reply.clock
    back = reply.clock
    if timing is not None:
        sent = timing[0]
        back = timing[1]
    skew = reply.clock - (sent + back) / 2
    late = abs(skew) > CLOCK_SKEW + (back - sent) / 2
    detail = f"{skew:+.2f}s from the controller"
    return verdict("clock", host, not late, detail, "synchronise clocks (chrony/NTP)")


def port_check(
    master: Host, port: int, outcome: Outcome[p.ListenReply] | None, may_move: bool = False
) -> Check:
    """``may_move``: the caller (train) moves to a free port itself, so busy is only a note."""
    if outcome is None:
        return verdict("master port", master, False, "cannot probe: unreachable", "fix the node")
    if outcome.value is None:
        why = outcome.error
        return verdict("master port", master, False, f"cannot probe: {why}", "fix the node")
    error = outcome.value.error
    if error is None:
        return verdict("master port", master, True, f"port {port} free on the master")
    moves = may_move and "busy" in error
    detail = f"{error} on the master {master.label}"
    if moves:
        detail += "; train moves to a free port"
    fix = f"stop what holds port {port} there, or pass --master-port (any free port)"
    return verdict("master port", master, moves, detail, fix)


def reach_checks(
    hosts: Sequence[Host], port: int, replies: dict[Host, Outcome[p.ConnectReply]], what: str
) -> list[Check]:
    """Of each node's connect round: ``what`` = "master port", its connect to the master's
    ``port`` (the other nodes'); "reach", those to every peer's listener."""
    to_master = what == "master port"
    if to_master:
        fine = f"connects to port {port} on the master"
        fix = (
            f"open TCP port {port} on the master to the other nodes (firewall), or pass "
            "--master-port"
        )
    else:
        fine = "reaches all {} peers on their interfaces"
        fix = (
            "check the link and firewalls between these two nodes on this interface; "
            "gloo/NCCL connect every pair"
        )

    def is_master_port(result: p.ConnectResult) -> bool:
        return result.port == port and result.label == hosts[0].label

    checks = []
    for host in hosts:
        outcome = replies.get(host)
        if outcome is None:
            continue
        if to_master and host == hosts[0]:
            continue  # the master does not connect to itself
        if outcome.value is None:
            checks.append(verdict(what, host, False, str(outcome.error), "fix the node"))
            continue
        results = [each for each in outcome.value.results if is_master_port(each) == to_master]
        broken = [result for result in results if not result.ok]
        if not broken:
            checks.append(verdict(what, host, True, fine.format(len(results))))
        for result in broken:
            checks.append(verdict(what, host, False, result.detail, fix, result.label))
    return checks


def probe_line(reply: p.ProbeReply) -> str | None:
    """The collective probe's result line in its output, if it got that far."""
    for line in reply.out.splitlines():
        if line.startswith(PROBE_PREFIX):
            return line
    return None


def collective_checks(
    hosts: Sequence[Host],
    replies: dict[Host, Outcome[p.ProbeReply]],
    failures: dict[Host, str],
    seconds: float,
) -> list[Check]:
    checks = []
    fix = (
        "see the failing checks above; set GLOO_SOCKET_IFNAME/NCCL_SOCKET_IFNAME if gloo/NCCL "
        "picked the wrong interface"
    )
    imports: dict[str, float] = {}
    for host in hosts:
        outcome = replies.get(host)
        if outcome is None or outcome.value is None:
            why = unanswered(outcome, host, failures)
            checks.append(verdict("collective", host, False, why, "fix the node"))
            continue
        reply = outcome.value
        line = probe_line(reply)
        ok = reply.code == 0 and line is not None and line.endswith("ok=True")
        if line is not None:
            detail = line
        else:
            # the last line of its errors says why it did not get that far
            errors = reply.err.strip().splitlines()
            detail = errors[-1] if errors else f"exit {reply.code}"
        detail = detail.removeprefix(PROBE_PREFIX)[:300]
        found = IMPORT.search(detail)
        if found is not None:
            imports[host.label] = float(found[1])
        checks.append(verdict("collective", host, ok, detail, fix))
    slowest = max(imports, key=imports.__getitem__, default=None)
    if slowest is not None and imports[slowest] > seconds / 3:
        # every rank must join within the timeout of the first: a slow start, not the network
        # (a node that did not answer keeps its own fix)
        slow = f"torch took {imports[slowest]:.0f}s to import on {slowest}: raise --timeout"
        for index, check in enumerate(checks):
            if check.fix == fix and not check.ok:
                checks[index] = replace(check, fix=slow)
    return checks
