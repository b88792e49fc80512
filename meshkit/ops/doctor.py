"""``meshkit doctor``: prove, per node and per pair, that the cluster can train before it does.

Every check goes through the node agents (``NodePool``) and is bounded in time; the N x N SSH
check is the mesh's own verify, passed in by the caller. Functions return a ``Report`` and print
nothing. This module runs the rounds; the verdicts on their replies are ``ops/verdicts.py``'s
(pure, unit-tested with plain data), and ``doctor --bandwidth``'s measurement is
``ops/bandwidth.py``'s.
"""

from __future__ import annotations

import shlex
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace

from .. import protocol as p
from ..errors import UsageError
from ..hostfile import Host
from ..job import Job
from ..outcome import Outcome, ProgressFn
from ..settings import Config
from ..verifyplan import PairFailure
from .bandwidth import Bandwidth, measure_pairs
from .jobs import Envs, env_round
from .pool import NodePool, connect
from .sync import Facts, facts_round
from .verdicts import (
    ORDER,
    Check,
    collective_checks,
    env_checks,
    fact_checks,
    ifname,
    port_check,
    reach_checks,
    read_env,
    ssh_checks,
    verdict,
)
from .verify import verify

LISTEN_SECONDS = 30.0  # a listener's life: long enough for every node's connect round
CONNECT_SECONDS = 5.0  # each node retries its connects this long
PROBE_SECONDS = 30.0  # the collective probe's init + all_reduce timeout
# the collective probe after ``--bandwidth`` moves about a second's worth of the slowest link
PROBE_BYTES_LEAST = 1 << 20
PROBE_BYTES_MOST = 64 << 20
# what the CLI's flags and the Python API's arguments may be: (low, high, expected)
LIMITS = {
    "timeout": (1.0, 600.0, "seconds between 1 and 600"),
    "min_ratio": (0.0, 1.0, "a fraction between 0 and 1"),
    "min_rate": (0.0, float("inf"), "a rate of 0 bits/s or more"),
}


@dataclass(frozen=True)
class Report:
    nodes: list[str]
    checks: list[Check] = field(default_factory=list)
    bandwidth: Bandwidth | None = None  # not in the JSON: its checks carry the same rates

    @property
    def ok(self) -> bool:
        return all(check.ok for check in self.checks)

    @property
    def failures(self) -> list[Check]:
        return [check for check in self.checks if not check.ok]

    def as_json(self) -> dict[str, object]:
        checks = [asdict(check) for check in self.checks]
        return {"ok": self.ok, "nodes": self.nodes, "checks": checks}


def within(name: str, value: float, shown: str) -> float:
    """``value`` if within ``name``'s limit (NaN is not); else the error, naming it ``shown``."""
    low, high, expected = LIMITS[name]
    if not low <= value <= high:
        raise UsageError(f"{shown}: expected {expected}")
    return value


def doctor(
    conf: Config,
    job: Job,
    hosts: Sequence[Host],
    quick: bool = False,
    timeout: float = PROBE_SECONDS,
    bandwidth: bool = False,
    min_ratio: float = 0.5,
    min_rate: float = 0.0,
    progress: ProgressFn | None = None,
) -> Report:
    """``meshkit doctor``, for the CLI and the Python API alike: every check (``quick``: all but
    the N x N SSH check and the collective probe), or with ``bandwidth`` every pair's throughput
    (``measure``); ``timeout``: the collective probe's. The limits are checked before connecting."""
    for name, value in (("timeout", timeout), ("min_ratio", min_ratio), ("min_rate", min_rate)):
        within(name, value, f"{name}={value:g}")
    with connect(conf, job.hostfile, hosts, job.python, progress) as pool:
        if bandwidth:
            return measure(pool, job, hosts, min_ratio, min_rate, timeout)
        ssh = None if quick else (lambda: verify(pool, hosts).failures)
        return run(pool, job, hosts, verify=ssh, probe_seconds=timeout)


def run(
    pool: NodePool,
    job: Job,
    hosts: Sequence[Host],
    *,
    verify: Callable[[], Sequence[PairFailure]] | None = None,
    probe_seconds: float = PROBE_SECONDS,
    port_may_move: bool = False,
    envs: Envs | None = None,
    facts: Facts | None = None,
) -> Report:
    """Every check, in the order a training job would hit them. The slow parts run only with
    ``verify`` (the SSH N x N check): it, and the collective probe. ``envs`` and ``facts``: rounds
    the caller ran already (train runs each once)."""
    checks = []
    if verify is not None:
        checks += ssh_checks(hosts, verify())
    if envs is None:
        envs = env_round(pool, job, hosts)
    views = {host: read_env(envs.get(host), pool.failures.get(host)) for host in hosts}
    checks += env_checks(hosts, views)
    # facts: the master writes the shared-workdir marker, then the others look for it (unless
    # the caller's round did: train's, with the marker written by the machine it runs on)
    marker = None
    if facts is None:
        facts = facts_round(pool, job.workdir, hosts, hosts[0], job)
        marker = facts.marker
    checks += fact_checks(hosts, facts, pool.failures, job.sync)

    def done(host: Host) -> p.DoneRequest:
        """Close the node's listeners; the master also removes the marker this round wrote."""
        if host == hosts[0]:
            return p.DoneRequest(marker)
        return p.DoneRequest(None)

    try:
        checks += network_checks(pool, job, hosts, views, port_may_move)
    finally:
        pool.call_all("", done, p.DoneReply, hosts)
    if verify is not None:
        networked = ("master port", "reach", "rank")
        blocked = any(not check.ok for check in checks if check.check in networked)
        checks += collective_round(pool, job, hosts, blocked, probe_seconds, [])
    checks.sort(key=lambda check: ORDER.index(check.check))
    return Report([host.label for host in hosts], checks)


def quick(
    pool: NodePool,
    job: Job,
    hosts: Sequence[Host],
    envs: Envs | None = None,
    facts: Facts | None = None,
) -> Report:
    """The quick parts, for ``train --doctor`` and the supervisor's health gate: everything but
    the N x N SSH check (the train connections just proved the controller's side) and the
    collective probe; a busy master port is only a note, since train then moves to a free one."""
    return run(pool, job, hosts, port_may_move=True, envs=envs, facts=facts)


def collective_round(
    pool: NodePool, job: Job, hosts: Sequence[Host], blocked: bool, seconds: float, extra: list[str]
) -> list[Check]:
    """The collective probe through ``meshkit run`` on every node (``extra``: its flags); not
    run (and said so) when the network checks before it failed."""
    if blocked:
        why = "not run: the network checks above failed"
        return [verdict("collective", hosts[0], False, why, "fix the failures above first")]
    probe = ["-m", "meshkit.templates.collective_probe", "--timeout", f"{seconds:g}", *extra]
    argv = job.meshkit_argv("run", "--cmd", shlex.join([job.python, *probe]))
    request = p.ProbeRequest(job.workdir, argv, seconds + 30)
    wait = seconds + 60
    replies = pool.call_all("collective", lambda host: request, p.ProbeReply, hosts, wait)
    return collective_checks(hosts, replies, pool.failures, seconds)


def network_checks(
    pool: NodePool, job: Job, hosts: Sequence[Host], views: dict[Host, p.EnvReply], may_move: bool
) -> list[Check]:
    """The master port free on the master and reachable from every node; every node reaching
    every other on the interface its backends will use."""
    master = hosts[0]
    port = job.master_port
    request = p.ListenRequest(None, port, LISTEN_SECONDS)
    held = pool.call_all("port", lambda host: request, p.ListenReply, [master]).get(master)
    checks = [port_check(master, port, held, may_move)]
    port_open = held is not None and held.value is not None and held.value.error is None
    ok_hosts = [host for host in hosts if views[host].error is None]
    asks = {host: p.ListenRequest(ifname(views[host]), 0, LISTEN_SECONDS) for host in ok_hosts}
    listens = pool.call_all("listen", asks.get, p.ListenReply, ok_hosts)
    targets: dict[Host, p.ProbeTarget] = {}
    for host in ok_hosts:
        listened = listens.get(host, Outcome[p.ListenReply](error="unreachable"))
        if listened.value is None:
            why = f"cannot listen: {listened.error}"
            checks.append(verdict("reach", host, False, why, "fix the node's interface"))
            continue
        if listened.value.error:
            why = f"cannot listen: {listened.value.error}"
            checks.append(verdict("reach", host, False, why, "fix the node's interface"))
            continue
        address = listened.value.address
        if address == "*":
            address = host.host  # it listens on every address: the hostfile's reaches it
        targets[host] = p.ProbeTarget(host.label, address, listened.value.port)

    def connects(host: Host) -> p.ConnectRequest:
        peers = [target for peer, target in targets.items() if peer != host]
        if port_open and host != master:
            # to MASTER_ADDR as this node's env spells it, as torchrun's store client will
            address = views[host].variables.get("MASTER_ADDR") or master.host
            peers.append(p.ProbeTarget(master.label, address, port))
        return p.ConnectRequest(peers, CONNECT_SECONDS)

    wait = CONNECT_SECONDS + 30
    replies = pool.call_all("reach", connects, p.ConnectReply, ok_hosts, timeout=wait)
    if port_open:
        checks += reach_checks(hosts, port, replies, "master port")
    return checks + reach_checks(hosts, port, replies, "reach")


def measure(
    pool: NodePool,
    job: Job,
    hosts: Sequence[Host],
    min_ratio: float,
    min_rate: float,
    seconds: float,
) -> Report:
    """``doctor --bandwidth``: every pair's throughput both ways, on every network the pair
    shares, measured by the agents in rounds of disjoint pairs; then one timed all_reduce."""
    envs = env_round(pool, job, hosts)
    views = {host: read_env(envs.get(host), pool.failures.get(host)) for host in hosts}
    # of the env checks, those the bandwidth needs: the interfaces, and what failed
    checks = []
    for check in env_checks(hosts, views):
        if not check.ok or check.check == "interface":
            checks.append(check)
    ifnames = {host: ifname(views[host]) for host in hosts}
    measured = measure_pairs(pool, hosts, ifnames, min_ratio, min_rate)
    checks += measured.checks
    matrix = measured.matrix
    if measured.without_torch:
        why = f"not run: no torch on {', '.join(measured.without_torch)}"
        checks.append(verdict("collective", hosts[0], True, why))
    else:
        failed = [check for check in checks if not check.ok]
        no_rank = any(check.check == "rank" for check in failed)
        no_test = any(check.detail.startswith("failed:") for check in failed)
        blocked = no_rank or no_test
        slowest = min(matrix.rates.values(), default=0)
        size = int(min(max(slowest / 16, PROBE_BYTES_LEAST), PROBE_BYTES_MOST))
        probe = collective_round(pool, job, hosts, blocked, seconds, ["--bytes", str(size)])
        checks += probe
        matrix = replace(matrix, busbw=slowest_busbw(probe))
    checks.sort(key=lambda check: ORDER.index(check.check))
    return Report([host.label for host in hosts], checks, matrix)


def slowest_busbw(probe: list[Check]) -> float | None:
    """The lowest bus bandwidth the probe's ranks said (``busbw=`` in their rows)."""
    rates = []
    for check in probe:
        for word in check.detail.split():
            if word.startswith("busbw="):
                rates.append(float(word.removeprefix("busbw=")))
    return min(rates, default=None)
