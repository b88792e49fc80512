"""``meshkit doctor``: prove, per node and per pair, that the cluster can train before it does.

Every check goes through the node agents (``NodePool``) and is bounded in time; the N x N SSH
check is the mesh's own verify, passed in by the caller. Functions return a ``Report`` and print
nothing; the verdicts are pure functions of the replies (unit-tested with plain data).
"""

from __future__ import annotations

import contextlib
import ipaddress
import re
import shlex
import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace

from .. import protocol as p
from ..errors import UsageError
from ..hostfile import Host
from ..job import Job
from ..outcome import Outcome, ProgressFn
from ..settings import Config
from ..verifyplan import PairFailure
from .jobs import Envs, env_error, env_round
from .pool import NodePool, connect, unanswered
from .sync import Facts, facts_round
from .verify import verify

# the order of the table: what a training job hits first comes first (a stable sort keeps nodes
# in rank order within each check)
ORDER = ["ssh", "rank", "interface", "facts", "versions", "gpus", "workdir", "clock"]
ORDER += ["master port", "reach", "bandwidth", "networks", "infiniband", "collective"]
LISTEN_SECONDS = 30.0  # a listener's life: long enough for every node's connect round
CONNECT_SECONDS = 5.0  # each node retries its connects this long
CLOCK_SKEW = 2.0  # seconds of clock difference tolerated (on top of the round trip)
PROBE_SECONDS = 30.0  # the collective probe's init + all_reduce timeout
IMPORT = re.compile(r"\bimport=(\d+(?:\.\d+)?)s\b")  # the probe's seconds to import torch
# One throughput try, one way: short and bounded in bytes, so that the best of a few tries rides
# out a busy moment of a shared machine (the sandbox's 2 cores) rather than averaging it in.
BW_SECONDS, BW_BYTES, BW_REPEATS = 0.2, 64 << 20, 3
# what the CLI's flags and the Python API's arguments may be: (low, high, expected)
LIMITS = {
    "timeout": (1.0, 600.0, "seconds between 1 and 600"),
    "min_ratio": (0.0, 1.0, "a fraction between 0 and 1"),
    "min_rate": (0.0, float("inf"), "a rate of 0 bits/s or more"),
}


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
    return Check(check, host.label, peer, ok, detail, "" if ok else fix)


@dataclass(frozen=True)
class Bandwidth:
    """``doctor --bandwidth``'s matrix: bits/s from node to peer (hostfile spellings) on the
    network the job uses; the all_reduce's bus bandwidth (bits/s) when it ran."""

    rates: dict[tuple[str, str], float]
    median: float  # over the nodes of each one's median rate
    slow_nodes: list[str]  # all of whose pairs are slow
    busbw: float | None = None


@dataclass(frozen=True)
class Report:
    nodes: list[str]
    checks: list[Check] = field(default_factory=list)
    bandwidth: Bandwidth | None = None  # not in the JSON: its checks carry the same rates

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)

    @property
    def failures(self) -> list[Check]:
        return [c for c in self.checks if not c.ok]

    def as_json(self) -> dict[str, object]:
        return {"ok": self.ok, "nodes": self.nodes, "checks": [asdict(c) for c in self.checks]}


def ssh_checks(hosts: Sequence[Host], failures: Sequence[PairFailure]) -> list[Check]:
    """One row per node that logs in everywhere; one row per broken pair (verify logs in by the
    hostfile spelling and checks the host key by hostname: a pair's errors are joined)."""
    checks = []
    for source in hosts:
        broken: dict[Host, list[str]] = {}
        for f in (f for f in failures if f.source == source):
            broken.setdefault(f.target, []).append(f.error)
        if not broken:
            checks.append(verdict("ssh", source, True, f"logs in to all {len(hosts)} nodes"))
        for target, errors in broken.items():
            detail = "; ".join(dict.fromkeys(errors))[:300]
            checks.append(verdict("ssh", source, False, detail, ssh_fix(detail), target.label))
    return checks


def ssh_fix(error: str) -> str:
    down = ("No route to host", "timed out", "Connection refused", "Network is unreachable")
    if any(e in error for e in down):
        return "the network between these two nodes is down (route, firewall, sshd not running)"
    return "run `meshkit mesh` (keys, known_hosts), then `meshkit check`"


def read_env(outcome: Outcome[p.EnvReply] | None, failure: str | None) -> p.EnvReply:
    """What discovery (``meshkit env``) said on one node; why it said nothing as its ``error``."""
    error = env_error(outcome, failure)
    if error is not None or outcome is None or outcome.value is None:
        return p.EnvReply({}, "", None, "", error)
    return outcome.value


def ifname(view: p.EnvReply) -> str | None:
    return view.variables.get("GLOO_SOCKET_IFNAME") or None


def env_checks(hosts: Sequence[Host], views: dict[Host, p.EnvReply]) -> list[Check]:
    checks = []
    for rank, host in enumerate(hosts):
        view = views[host]
        if view.error is not None:
            fix = "fix the node (see detail) and rerun"
            checks.append(verdict("rank", host, False, view.error, fix))
            continue
        said = view.variables.get("NODE_RANK", "")
        number = int(said) if said.isascii() and said.isdigit() else None
        detail = f"NODE_RANK={number} (hostfile line {host.lineno} is rank {rank})"
        fix = (
            "list this node in the hostfile as it sees itself (an address of one of its interfaces)"
        )
        checks.append(verdict("rank", host, number == rank, detail, fix))
        found = ifname(view) is not None or len(hosts) == 1
        detail = f"{ifname(view)} ({view.interface_source})"
        fix = (
            "list addresses (not names) in the hostfile, or set GLOO_SOCKET_IFNAME and "
            "NCCL_SOCKET_IFNAME (config meshkit.env)"
        )
        missing = view.interface_source or "no interface found"
        checks.append(verdict("interface", host, found, detail if found else missing, fix))
    return checks


def versions(f: p.FactsReply) -> dict[str, str]:
    found = {"python": f.python, "torch": f.torch, "meshkit": f.meshkit}
    return {k: v or "-" for k, v in {**found, "CUDA": f.cuda, "NCCL": f.nccl}.items()}


def fact_checks(
    hosts: Sequence[Host], round_: Facts, failures: dict[Host, str], synced: bool = False
) -> list[Check]:
    """Versions equal to the master's; GPUs against the master's slots (every node runs that
    many ranks); the workdir shared and writable (a synced job's nodes hold copies: the master's
    marker is not expected there); clocks within CLOCK_SKEW of the controller's (``timing``: when
    each request left and its reply came back, controller time)."""
    checks: list[Check] = []
    slots, master = hosts[0].slots, round_.replies.get(hosts[0])
    reference = master.value if master is not None else None
    for host in hosts:
        outcome = round_.replies.get(host)
        if outcome is None or outcome.value is None:
            why = unanswered(outcome, host, failures)
            checks.append(verdict("facts", host, False, why, "fix the node and rerun"))
            continue
        f = outcome.value
        mine = versions(f)
        theirs = versions(reference) if reference is not None else mine
        differ = [f"{k} {mine[k]} (master: {theirs[k]})" for k in mine if mine[k] != theirs[k]]
        same = ", ".join(f"{k} {v}" for k, v in mine.items() if v != "-")
        fix = "install the same versions on every node (same venv path)"
        checks.append(verdict("versions", host, not differ, "; ".join(differ) or same, fix))
        over = f.gpus > 0 and slots is not None and slots > f.gpus
        gpus = f"{f.gpus} GPUs" + (f", slots={slots}" if slots is not None else "")
        fix = f"set slots={f.gpus} (or fewer) in the hostfile"
        checks.append(verdict("gpus", host, not over, gpus, fix))
        copy = synced and f.marker.endswith((" is not there", " holds another run's token"))
        problems = [f.writable] if f.writable else []
        if f.marker not in ("written", "seen") and not copy:
            problems.append(f"marker: {f.marker}")
        fine = ("shared and " if f.marker == "seen" else "") + "writable"
        fine += " (a synced copy)" if copy else ""
        fix = "put the workdir on storage every node mounts at the same path (or use train --sync)"
        checks.append(verdict("workdir", host, not problems, "; ".join(problems) or fine, fix))
        sent, back = round_.timing.get(host, (f.clock, f.clock))
        skew = f.clock - (sent + back) / 2
        late = abs(skew) > CLOCK_SKEW + (back - sent) / 2
        skewed = f"{skew:+.2f}s from the controller"
        checks.append(verdict("clock", host, not late, skewed, "synchronise clocks (chrony/NTP)"))
    return checks


def port_check(
    master: Host, port: int, outcome: Outcome[p.ListenReply] | None, may_move: bool = False
) -> Check:
    """``may_move``: the caller (train) moves to a free port itself, so busy is only a note."""
    if outcome is None or outcome.value is None:
        why = outcome.error if outcome else "unreachable"
        return verdict("master port", master, False, f"cannot probe: {why}", "fix the node")
    error = outcome.value.error
    if error is None:
        return verdict("master port", master, True, f"port {port} free on the master")
    moves = may_move and "busy" in error
    detail = f"{error} on the master {master.label}" + "; train moves to a free port" * moves
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
    checks = []
    for host in hosts:
        outcome = replies.get(host)
        if outcome is None or (to_master and host == hosts[0]):
            continue
        if outcome.value is None:
            checks.append(verdict(what, host, False, str(outcome.error), "fix the node"))
            continue
        master = (port, hosts[0].label)
        results = [r for r in outcome.value.results if ((r.port, r.label) == master) == to_master]
        broken = [r for r in results if not r.ok]
        if not broken:
            checks.append(verdict(what, host, True, fine.format(len(results))))
        checks += [verdict(what, host, False, r.detail, fix, r.label) for r in broken]
    return checks


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
        line = next((x for x in reply.out.splitlines() if x.startswith("meshkit-probe ")), None)
        ok = reply.code == 0 and line is not None and line.endswith("ok=True")
        detail = line or (reply.err.strip().splitlines() or [f"exit {reply.code}"])[-1]
        detail = detail.removeprefix("meshkit-probe ")[:300]
        if found := IMPORT.search(detail):
            imports[host.label] = float(found[1])
        checks.append(verdict("collective", host, ok, detail, fix))
    slowest = max(imports, key=imports.__getitem__, default=None)
    if slowest and imports[slowest] > seconds / 3:
        # every rank must join within the timeout of the first: a slow start, not the network
        # (a node that did not answer keeps its own fix)
        slow = f"torch took {imports[slowest]:.0f}s to import on {slowest}: raise --timeout"
        checks = [replace(c, fix=slow) if c.fix == fix and not c.ok else c for c in checks]
    return checks


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
    checks = ssh_checks(hosts, verify()) if verify is not None else []
    envs = env_round(pool, job) if envs is None else envs
    views = {h: read_env(envs.get(h), pool.failures.get(h)) for h in hosts}
    checks += env_checks(hosts, views)
    # facts: the master writes the shared-workdir marker, then the others look for it (unless
    # the caller's round did: train's, with the marker written by the machine it runs on)
    marker = None
    if facts is None:
        facts = facts_round(pool, job.workdir, hosts, hosts[0])
        marker = facts.marker
    checks += fact_checks(hosts, facts, pool.failures, job.sync)
    try:
        checks += network_checks(pool, job, hosts, views, port_may_move)
    finally:
        pool.call_all("", lambda h: p.DoneRequest(marker if h == hosts[0] else None), p.DoneReply)
    if verify is not None:
        blocked = any(not c.ok for c in checks if c.check in ("master port", "reach", "rank"))
        checks += collective_round(pool, job, hosts, blocked, probe_seconds, [])
    checks.sort(key=lambda c: ORDER.index(c.check))
    return Report([h.label for h in hosts], checks)


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
    replies = pool.call_all("collective", lambda h: request, p.ProbeReply, timeout=seconds + 60)
    return collective_checks(hosts, replies, pool.failures, seconds)


def network_checks(
    pool: NodePool, job: Job, hosts: Sequence[Host], views: dict[Host, p.EnvReply], may_move: bool
) -> list[Check]:
    """The master port free on the master and reachable from every node; every node reaching
    every other on the interface its backends will use."""
    master, port = hosts[0], job.master_port
    request = p.ListenRequest(None, port, LISTEN_SECONDS)
    held = pool.call_all("port", lambda h: request, p.ListenReply, [master]).get(master)
    checks = [port_check(master, port, held, may_move)]
    port_open = held is not None and held.value is not None and held.value.error is None
    ok_hosts = [h for h in hosts if views[h].error is None]
    asks = {h: p.ListenRequest(ifname(views[h]), 0, LISTEN_SECONDS) for h in ok_hosts}
    listens = pool.call_all("listen", asks.get, p.ListenReply, ok_hosts)
    targets: dict[Host, p.ProbeTarget] = {}
    for h in ok_hosts:
        got = listens.get(h, Outcome[p.ListenReply](error="unreachable"))
        if got.value is None or got.value.error:
            why = f"cannot listen: {got.value.error if got.value else got.error}"
            checks.append(verdict("reach", h, False, why, "fix the node's interface"))
            continue
        address = h.host if got.value.address == "*" else got.value.address
        targets[h] = p.ProbeTarget(h.label, address, got.value.port)

    def connects(h: Host) -> p.ConnectRequest:
        peers = [t for peer, t in targets.items() if peer != h]
        if port_open and h != master:
            # to MASTER_ADDR as this node's env spells it, as torchrun's store client will
            address = views[h].variables.get("MASTER_ADDR") or master.host
            peers.append(p.ProbeTarget(master.label, address, port))
        return p.ConnectRequest(peers, CONNECT_SECONDS)

    wait = CONNECT_SECONDS + 30
    replies = pool.call_all("reach", connects, p.ConnectReply, ok_hosts, timeout=wait)
    if port_open:
        checks += reach_checks(hosts, port, replies, "master port")
    return checks + reach_checks(hosts, port, replies, "reach")


# doctor --bandwidth's maps: (client, server) -> tests; node -> interface; node -> its networks
Results = dict[tuple[Host, Host], list[p.BandwidthResult]]
Ifnames = dict[Host, str | None]
Replies = dict[Host, p.BandwidthReply]


def pair_rounds(n: int) -> list[list[tuple[int, int]]]:
    """Every pair of ``n`` nodes once, in rounds of disjoint pairs (the circle method): n-1
    rounds of n/2 pairs; for odd n, n rounds, each with one node out."""
    ring = [*range(n), *([-1] if n % 2 else [])]
    rounds = []
    for _ in range(len(ring) - 1):
        half = len(ring) // 2
        pairs = zip(ring[:half], reversed(ring[half:]))
        rounds.append([(min(a, b), max(a, b)) for a, b in pairs if -1 not in (a, b)])
        ring = [ring[0], ring[-1], *ring[1:-1]]
    return rounds


def disjoint(pairs: Sequence[tuple[Host, Host]]) -> list[list[tuple[Host, Host]]]:
    """``pairs`` in rounds in which no node is twice (greedy: each into the first that has room)."""
    rounds: list[list[tuple[Host, Host]]] = []
    for pair in pairs:
        free = next((r for r in rounds if not {*pair} & {h for two in r for h in two}), None)
        free.append(pair) if free is not None else rounds.append([pair])
    return rounds


def _better(r: p.BandwidthResult) -> tuple[bool, float]:
    return r.error is None, min(r.sent, r.received)


def rate_text(bits: float) -> str:
    for unit, size in (("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bits >= size:
            return f"{bits / size:.3g} {unit}"
    return f"{bits:.0f} bit/s"


def _subnets(reply: p.BandwidthReply) -> dict[str, tuple[str, str]]:
    """A node's networks: subnet -> (interface, address)."""
    found: dict[str, tuple[str, str]] = {}
    for line in reply.networks:
        name, _, cidr = line.partition(" ")
        with contextlib.suppress(ValueError):
            found.setdefault(str(ipaddress.IPv4Interface(cidr).network), (name, cidr.split("/")[0]))
    return found


def pair_targets(
    client: p.BandwidthReply, server: p.BandwidthReply, server_if: str | None, label: str, port: int
) -> list[p.BandwidthTarget]:
    """The client's tests towards the server: one per network both are on (the server's exported
    interface's first), never to an address the client holds itself (docker0's 172.17.0.1)."""
    mine, theirs = _subnets(client), _subnets(server)
    own = {address for _, address in mine.values()}
    shared = [net for net in theirs if net in mine and theirs[net][1] not in own]
    shared.sort(key=lambda net: theirs[net][0] != server_if)
    return [p.BandwidthTarget(label, theirs[net][1], port, net) for net in shared]


def bandwidth_checks(
    hosts: Sequence[Host], results: Results, ifnames: Ifnames, min_ratio: float, min_rate: float
) -> tuple[list[Check], Bandwidth]:
    """One check per pair on the exported network (``results``: (client, server) -> its tests,
    that network's first): slow below ``min_ratio`` x the cluster's median or below ``min_rate``
    (bits/s). The median is over the nodes of each node's median rate: one slow node of three is
    still held to what the others reach, and a pair that ran alone in its round (beside a slow
    one, on a CPU-bound network) does not raise it; a node all of whose pairs are slow is named."""
    rates, per_node = {}, {h: list[float]() for h in hosts}
    for (client, server), (r, *_) in results.items():
        if r.error is None:
            rates[client, server], rates[server, client] = r.sent * 8, r.received * 8
    for (a, b), value in rates.items():
        per_node[a].append(value)
        per_node[b].append(value)
    median = statistics.median([statistics.median(v) for v in per_node.values() if v] or [0.0])
    floor = max(min_ratio * median, min_rate)
    pairs = sorted(results, key=lambda two: (hosts.index(two[0]), hosts.index(two[1])))
    slow = {two for two in pairs if min(rates.get(two, 0), rates.get(two[::-1], 0)) < floor}
    mates = {h: {two for two in pairs if h in two} for h in hosts}
    nodes = [h for h in hosts if len(hosts) > 2 and mates[h] and mates[h] <= slow]
    link = (
        "look at this link: cable, switch ports and negotiated speed on both ends (ethtool), or "
        "other traffic on it"
    )
    checks = []
    for a, b in pairs:
        r, culprit = results[a, b][0], next((h.label for h in nodes if h in (a, b)), None)
        detail = f"failed: {r.error}"
        if not r.error:
            detail = (
                f"node->peer {rate_text(rates[a, b])}, peer->node {rate_text(rates[b, a])} "
                f"on {ifnames.get(a) or r.network}; median {rate_text(median)}"
            )
        fix = (
            f"every pair of {culprit} is slow: look at that node's NIC (ethtool: speed, duplex, "
            "errors), cable and switch port"
        )
        ok = (a, b) not in slow
        checks.append(verdict("bandwidth", a, ok, detail, fix if culprit else link, b.label))
    matrix = {(a.label, b.label): v for (a, b), v in rates.items()}
    return checks, Bandwidth(matrix, median, [h.label for h in nodes])


def network_checks_bw(
    hosts: Sequence[Host], replies: Replies, results: Results, ifnames: Ifnames, min_ratio: float
) -> list[Check]:
    """Per node with more than one network: each one's rate (its fastest pair there, the slower
    direction), which is fastest, and whether the exported interface is it (a failure when another
    is faster by more than 1/min_ratio on every pair, measured in turn); and its InfiniBand
    devices."""
    checks = []
    for host in hosts:
        reply = replies.get(host, p.BandwidthReply([], [], [], False))
        names = {net: name for net, (name, _) in _subnets(reply).items()}
        mine = ifnames.get(host) or ""
        speed: dict[str, float] = {}
        faster: dict[str, bool] = {}  # network -> faster than the exported one on every pair
        for pair, tests in results.items():
            rate = {names.get(r.network, r.network): min(r.sent, r.received) * 8 for r in tests}
            for net, value in rate.items() if host in pair and len(tests) > 1 else ():
                speed[net] = max(speed.get(net, 0.0), value)
                slow = rate.get(mine, 0.0) < min_ratio * value
                faster[net] = net != mine and faster.get(net, True) and slow
        if len(speed) > 1:
            fastest = max(speed, key=lambda n: (faster[n], speed[n]))
            shown = [f"{n}{' (exported)' * (n == mine)} {rate_text(v)}" for n, v in speed.items()]
            best = "the exported one is fastest" if fastest == mine else f"fastest: {fastest}"
            fix = (
                f"list this node by its {fastest} address in the hostfile, or set "
                f"GLOO_SOCKET_IFNAME/NCCL_SOCKET_IFNAME={fastest} (config meshkit.env)"
            )
            detail = f"{', '.join(shown)}; {best}"
            checks.append(verdict("networks", host, not faster[fastest], detail, fix))
        active = ",".join(d.split()[0] for d in reply.infiniband if d.endswith("ACTIVE"))
        found = ", ".join(reply.infiniband)
        detail = f"{found}; NCCL_IB_HCA={active or '(none active)'}" if found else "none found"
        checks.append(verdict("infiniband", host, True, detail))
    return checks


def bandwidth_round(
    pool: NodePool, pairs: dict[Host, Host], replies: Replies, ifnames: Ifnames, networks: int = 64
) -> Results:
    """One round: each server (``pairs``' values) listens, each client tests towards it (on its
    first ``networks`` networks in common)."""
    bound = BW_REPEATS * 2 * (BW_SECONDS + 5)  # one test's worst case (a drain after each try)
    request = p.ListenRequest(None, 0, bound * 4, bandwidth=True)
    listens = pool.call_all("listen", lambda h: request, p.ListenReply, list(pairs.values()))
    tests: dict[Host, list[p.BandwidthTarget]] = {}
    results = {}
    for client, server in pairs.items():
        got = listens.get(server, Outcome[p.ListenReply](error="unreachable"))
        why = got.value.error if got.value else got.error
        port = got.value.port if got.value else 0
        found = pair_targets(replies[client], replies[server], ifnames[server], server.label, port)
        tests[client] = [] if why else found[:networks]
        why = f"{server.label} cannot listen: {why}" if why else "no network in common"
        results[client, server] = [p.BandwidthResult(server.label, "", 0.0, 0.0, why)]

    def test(h: Host) -> p.BandwidthRequest | None:
        return p.BandwidthRequest(tests[h], BW_SECONDS, BW_BYTES, BW_REPEATS) if tests[h] else None

    timeout = bound * max((len(t) for t in tests.values()), default=1) + 30
    done = pool.call_all("bandwidth", test, p.BandwidthReply, list(pairs), timeout=timeout)
    for client, server in pairs.items():
        if client in done:
            reply = done[client]
            failed = [p.BandwidthResult(server.label, "", 0.0, 0.0, str(reply.error))]
            results[client, server] = reply.value.results if reply.value else failed
    return results


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
    envs = env_round(pool, job)
    views = {h: read_env(envs.get(h), pool.failures.get(h)) for h in hosts}
    checks = [c for c in env_checks(hosts, views) if not c.ok or c.check == "interface"]
    ifnames = {h: ifname(views[h]) for h in hosts}
    found = pool.call_all("networks", lambda h: p.BandwidthRequest([], 0, 0, 0), p.BandwidthReply)
    replies = {h: o.value for h, o in found.items() if o.value is not None}
    for h in hosts:
        if h not in replies:
            why = unanswered(found.get(h), h, pool.failures)
            checks.append(verdict("bandwidth", h, False, why, "fix the node"))
    results: Results = {}
    todo = [[(hosts[a], hosts[b]) for a, b in r] for r in pair_rounds(len(hosts))]
    try:
        for networks in (64, 1, 1):
            for round_ in todo:
                pairs = {a: b for a, b in round_ if {a, b} <= set(replies)}
                for pair, got in bandwidth_round(pool, pairs, replies, ifnames, networks).items():
                    old = results.setdefault(pair, got)
                    better = [max(two, key=_better) for two in zip(old, got)]
                    results[pair] = better + old[len(got) :]
            # a pair found slow is measured again (twice at most), later and on the exported
            # network only: on a shared machine one busy second must not name a link (the better
            # measurement counts; a slow link stays slow)
            pair_checks, matrix = bandwidth_checks(hosts, results, ifnames, min_ratio, min_rate)
            slow = {(c.node, c.peer) for c in pair_checks if not c.ok}
            todo = disjoint([(a, b) for a, b in results if (a.label, b.label) in slow])
    finally:
        pool.call_all("", lambda h: p.DoneRequest(None), p.DoneReply)
    checks += pair_checks + network_checks_bw(hosts, replies, results, ifnames, min_ratio)
    lacking = [h.label for h in hosts if h not in replies or not replies[h].torch]
    if lacking:
        why = f"not run: no torch on {', '.join(lacking)}"
        checks.append(verdict("collective", hosts[0], True, why))
    else:
        failed = [c for c in checks if not c.ok]
        blocked = any(c.check == "rank" or c.detail.startswith("failed:") for c in failed)
        # sized to take about a second on the slowest link measured (1 to 64 MiB)
        size = int(min(max(min(matrix.rates.values(), default=0) / 16, 1 << 20), 64 << 20))
        probe = collective_round(pool, job, hosts, blocked, seconds, ["--bytes", str(size)])
        checks += probe
        words = [w for c in probe for w in c.detail.split() if w.startswith("busbw=")]
        matrix = replace(matrix, busbw=min((float(w[6:]) for w in words), default=None))
    checks.sort(key=lambda c: ORDER.index(c.check))
    return Report([h.label for h in hosts], checks, matrix)
