"""The N x N check of a mesh as data: from each node, which targets to try (every node by its
hostfile spelling, and by its own hostname), the shell script that tries them with plain OpenSSH,
and the failures its output shows. Pure: no I/O; ``meshkit.ops.verify`` runs the script on the
nodes.
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from .hostfile import Host
from .meshplan import HOSTNAME

VERIFY_BATCH = 8  # concurrent outgoing checks per node: stays under sshd's default MaxStartups (10)


@dataclass(frozen=True)
class PairFailure:
    """``source`` could not reach ``target`` (by one of its names, or at all), and why."""

    source: Host
    target: Host
    error: str


@dataclass(frozen=True)
class VerifyTarget:
    """One way to reach a node from the others: by the hostfile spelling (a full login: it proves
    the user keys and the host key), or by its hostname (its host-key check alone)."""

    index: int
    name: str
    by: str  # "hostfile" or "hostname"

    @property
    def key(self) -> str:  # how the script's output names it: its rank, then "h" by hostname
        return f"{self.index}{'h' if self.by == 'hostname' else ''}"


def targets(hosts: Sequence[Host], own_hostnames: Mapping[Host, str]) -> list[VerifyTarget]:
    """Every node by its hostfile spelling, and by its own hostname where that is another name."""
    found = []
    for index, host in enumerate(hosts):
        found.append(VerifyTarget(index, host.host, "hostfile"))
        name = own_hostnames.get(host, "")
        if name and name.lower() != host.host.lower() and HOSTNAME.match(name):
            found.append(VerifyTarget(index, name, "hostname"))
    return found


# A login ("check"), and a host-key check alone ("keycheck"): a key exchange, then the "none"
# authentication, which sshd refuses; OpenSSH says "Permission denied" only after the host key
# passed StrictHostKeyChecking, so that refusal is the proof (and no shell starts on the target).
VERIFY_FUNCTIONS = (
    'check() { i=$1; shift; if out=$("$@" 2>&1 </dev/null); then echo "ok $i"; '
    'else echo "fail $i $(printf %s "$out" | tr "\\n" " " | cut -c1-300)"; fi; }\n'
    'keycheck() { i=$1; shift; out=$("$@" 2>&1 </dev/null) && { echo "ok $i"; return; }; '
    'case $out in *"Permission denied ("*) echo "ok $i" ;; '
    '*) echo "fail $i $(printf %s "$out" | tr "\\n" " " | cut -c1-300)" ;; esac; }'
)
VERIFY_OPTIONS = ("BatchMode=yes", "StrictHostKeyChecking=yes", "LogLevel=ERROR")


def verify_script(
    hosts: Sequence[Host], connect_timeout: float, start: int, own_hostnames: Mapping[Host, str]
) -> str:
    """From one node to every node: a full login by the hostfile spelling, and a host-key check
    by the node's hostname; plain OpenSSH, BatchMode, strict host keys. Host data enters the
    script only through shlex.join. Node ``start`` begins with target ``start``, so each target
    gets about one batch of connections at a time, not all N."""
    lines = [VERIFY_FUNCTIONS]
    every = targets(hosts, own_hostnames)

    def from_start(target: VerifyTarget) -> tuple[int, str]:
        return (target.index - start) % len(hosts), target.by

    order = sorted(every, key=from_start)
    options = (*VERIFY_OPTIONS, f"ConnectTimeout={int(connect_timeout)}")
    ssh = ["ssh", *(word for option in options for word in ("-o", option))]
    for count, target in enumerate(order, start=1):
        node = hosts[target.index]
        keycheck = target.by == "hostname"
        argv = [*ssh, "-o", "PreferredAuthentications=none"] if keycheck else [*ssh]
        if node.port:
            argv += ["-p", str(node.port)]
        if node.user:
            argv += ["-l", node.user]
        argv += ["--", target.name, "true"]
        function = "keycheck" if keycheck else "check"
        lines.append(f"{function} {target.key} {shlex.join(argv)} &")
        if count % VERIFY_BATCH == 0:
            lines.append("wait")
    lines.append("wait")
    return "\n".join(lines) + "\n"


def parse_verify(
    source: Host, hosts: Sequence[Host], output: str, own_hostnames: Mapping[Host, str]
) -> list[PairFailure]:
    """One failure per target that did not answer ``ok`` by every name it was tried by."""
    seen: dict[str, str | None] = {}
    for line in output.splitlines():
        status, _, rest = line.partition(" ")
        key, _, error = rest.partition(" ")
        if status in ("ok", "fail"):
            seen[key] = None if status == "ok" else (error.strip() or "failed")
    errors: dict[int, list[str]] = {}
    for target in targets(hosts, own_hostnames):
        result = seen.get(target.key, "no result")
        if result is not None:
            how = f" (host key by hostname {target.name})" if target.by == "hostname" else ""
            errors.setdefault(target.index, []).append(f"{result}{how}")
    # One failure per pair, whichever names failed.
    return [
        PairFailure(source, hosts[index], "; ".join(reasons))
        for index, reasons in sorted(errors.items())
    ]


def matrix(hosts: Sequence[Host], failures: Sequence[PairFailure]) -> str:
    """``from \\ to`` grid of ok (.) and failed (X) pairs, rows and columns by rank."""
    bad = {(failure.source, failure.target) for failure in failures}
    header = "from\\to " + " ".join(f"{index:>3}" for index in range(len(hosts)))
    rows = []
    for index, source in enumerate(hosts):
        marks = " ".join(f"{'X' if (source, target) in bad else '.':>3}" for target in hosts)
        rows.append(f"{index:>3} {source.label[:20]:<20} {marks}")
    return "\n".join([header, *rows])


@dataclass
class VerifyResult:
    """The N x N check over ``hosts``: every failed pair (a pair may fail by several names)."""

    hosts: list[Host]
    failures: list[PairFailure] = field(default_factory=list)

    @property
    def ok_pairs(self) -> int:
        failed_pairs = {(failure.source, failure.target) for failure in self.failures}
        return len(self.hosts) ** 2 - len(failed_pairs)
