"""The hostfile: text -> ordered ``Host`` entries, one per node, in rank order.

Pure: no I/O and no name resolution. Every problem in a file is reported at once, each with its
``path:line``; a file that parses names each node once (same host and port twice is an error) and
gives every node the same ``slots=``.

Format (one node per line, line order is rank order, ``#`` starts a comment)::

    [user@]host[:port] [slots=N] [spare]

A ``spare`` line is a node held in reserve: meshed and checked like every node, but it takes no
rank until a supervised job's membership gives it a lost node's (``train --restarts``).

``host`` is an IPv4 address, an IPv6 address (in brackets when a port follows), a hostname, or a
pdsh/SLURM range such as ``node[01-16]`` that expands to several nodes.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping, Sequence

from .errors import HostfileError
from .record import record, split

TYPE_CHECKING = False
if TYPE_CHECKING:
    import re

MAX_NODES = 4096
MAX_LINE_CHARS = 1024
MAX_SLOTS = 1024
FORMAT = "[user@]host[:port] [slots=N] [spare]"

# Checked only for names, users and ranges, and compiled on first use: `meshkit run` reads the
# hostfile on every node at every launch, and a hostfile of addresses then needs neither re nor
# hostlist nor fnmatch, whose imports would be a noticeable part of each launch.
_PATTERNS = {
    "hostname": r"^(?=.{1,253}$)[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,62})(?:\.[A-Za-z0-9_-]{1,63})*\.?$",
    "user": r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,31}$",
    "range": r"^[A-Za-z0-9_.,\[\]-]+$",
    # an IPv6 zone (fe80::1%eth0): an interface name or number. Python's ipaddress takes any
    # text after '%', and the host goes into ssh's and the nodes' commands.
    "scope": r"^[A-Za-z0-9_.-]{1,64}$",
}
_compiled: dict[str, re.Pattern[str]] = {}


def _fits(kind: str, text: str) -> bool:
    pattern = _compiled.get(kind)
    if pattern is None:
        import re

        pattern = re.compile(_PATTERNS[kind])
        _compiled[kind] = pattern
    return pattern.match(text) is not None


def _expand_range(text: str) -> list[str]:
    """``node[01-03],gpu1`` -> its names (``hostlist.BadHostlist`` as ``ValueError``)."""
    import hostlist

    try:
        names: list[str] = hostlist.expand_hostlist(text)
    except hostlist.BadHostlist as exc:
        raise ValueError(str(exc)) from None
    return names


@record
class Host:
    """One node as the hostfile lists it."""

    host: str
    user: str | None = None
    port: int | None = None
    slots: int | None = None
    lineno: int = 0
    spare: bool = False  # held in reserve: no rank until a job's membership gives it one

    @property
    def is_ip(self) -> bool:
        return ip_of(self.host) is not None

    @property
    def label(self) -> str:
        """The node's name as written (``host`` or ``host:port``), for tables and messages."""
        if self.port is None:
            return self.host
        if ":" in self.host:
            return f"[{self.host}]:{self.port}"
        return f"{self.host}:{self.port}"

    def line(self) -> str:
        """The node as a hostfile line (without ``spare``: the line of a member)."""
        text = self.label
        if self.user is not None:
            text = f"{self.user}@{text}"
        if self.slots is not None:
            text += f" slots={self.slots}"
        return text

    def known_hosts_name(self) -> str:
        """How OpenSSH names this node in known_hosts: ``host``, or ``[host]:port`` off port 22."""
        if self.port in (None, 22):
            return self.host
        return f"[{self.host}]:{self.port}"


def ip_of(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(text)
    except ValueError:
        return None


def _split_spec(spec: str) -> tuple[str | None, str, str | None]:
    """``[user@]host[:port]`` -> (user, host, port text); brackets only around an IPv6 address."""
    user = None
    if "@" in spec:
        user, spec = spec.rsplit("@", 1)
    if spec.startswith("["):
        end = spec.find("]")
        if end < 0:
            raise ValueError("'[' without ']': write an IPv6 address as [addr] or [addr]:port")
        host = spec[1:end]
        rest = spec[end + 1 :]
        if rest and not rest.startswith(":"):
            raise ValueError(f"unexpected {rest!r} after ']': expected :port or nothing")
        if not isinstance(ip_of(host), ipaddress.IPv6Address):
            raise ValueError(f"{host!r} in brackets is not an IPv6 address")
        if not rest:
            return user, host, None
        return user, host, rest[1:]
    if spec.count(":") == 1:
        host, port = spec.split(":")
        return user, host, port
    return user, spec, None  # no colon, or a bare IPv6 address (no port)


def _number(text: str, what: str, low: int, high: int) -> int:
    is_number = text.isascii() and text.isdigit()
    if not is_number or not low <= int(text) <= high:
        raise ValueError(f"bad {what} {text!r}: expected a whole number {low}..{high}")
    return int(text)


def _expand(host: str) -> list[str]:
    """One host token -> the hosts it names (ranges expanded, bounded)."""
    address = ip_of(host)
    if address is not None:
        scope = getattr(address, "scope_id", None)
        if scope is not None and not _fits("scope", scope):
            raise ValueError(
                f"bad IPv6 scope id {scope[:40]!r} in {host[:80]!r}: expected an interface name "
                "or number (letters, digits, '_', '.', '-')"
            )
        return [host]
    if not _fits("range", host):
        raise ValueError(
            f"bad host {host!r}: expected an IP address, a hostname or a range like node[01-16]"
        )
    if "[" in host or "," in host:
        try:
            names = _expand_range(host)
        except ValueError as exc:
            raise ValueError(f"bad host range {host!r}: {exc}") from None
        if len(names) > MAX_NODES:
            raise ValueError(f"range {host!r} names {len(names)} hosts, more than {MAX_NODES}")
    else:
        names = [host]
    for name in names:
        if not _fits("hostname", name):
            raise ValueError(f"bad host {name!r}: expected an IP address or a hostname")
    return names


def _parse_line(text: str, lineno: int) -> list[Host]:
    spec, *options = text.split()
    user, host, port_text = _split_spec(spec)
    if user is not None and not _fits("user", user):
        raise ValueError(f"bad user {user!r}: expected a login name before '@'")
    names = _expand(host)
    port = None
    if port_text is not None:
        port = _number(port_text, "port", 1, 65535)
    slots = None
    spare = False
    for option in options:
        if option == "spare":
            if spare:
                raise ValueError("spare given twice")
            spare = True
            continue
        key, sep, value = option.partition("=")
        if key != "slots" or not sep:
            raise ValueError(f"unknown option {option!r}: the options are slots=N and spare")
        if slots is not None:
            raise ValueError("slots= given twice")
        slots = _number(value, "slots", 1, MAX_SLOTS)
    return [Host(name, user, port, slots, lineno, spare) for name in names]


def parse(text: str, path: str = "hostfile") -> list[Host]:
    """Parse hostfile text; raise ``HostfileError`` listing every problem with ``path:line``."""
    hosts: list[Host] = []
    problems: list[str] = []
    seen: dict[tuple[str, int], int] = {}
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        if len(raw) > MAX_LINE_CHARS:
            problems.append(f"{path}:{lineno}: line longer than {MAX_LINE_CHARS} characters")
            continue
        try:
            entries = _parse_line(line, lineno)
        except ValueError as exc:
            problems.append(f"{path}:{lineno}: {exc} (format: {FORMAT})")
            continue
        for entry in entries:
            key = (entry.host.lower(), entry.port or 22)
            if key in seen:
                problems.append(
                    f"{path}:{lineno}: {entry.label} duplicates line {seen[key]}; "
                    "list each node once"
                )
            seen.setdefault(key, lineno)
            hosts.append(entry)
        if len(hosts) > MAX_NODES:
            raise HostfileError(f"{path}:{lineno}: more than {MAX_NODES} nodes; split the cluster")
    if not hosts and not problems:
        problems.append(f"{path}: no hosts; add one line per node: {FORMAT}")
    if hosts and all(entry.spare for entry in hosts):
        problems.append(f"{path}: every line is a spare; a spare stands in for a node: list one")
    problems += _uneven_slots_problems(hosts, path)
    if problems:
        raise HostfileError(problems)
    return hosts


def active(hosts: Sequence[Host]) -> list[Host]:
    """The nodes that take ranks, in rank order (the hostfile's lines that are not spares)."""
    return [host for host in hosts if not host.spare]


def rank_of(hosts: Sequence[Host], label: str) -> int | None:
    """The rank of the node spelled ``label`` (``Host.label``) in ``hosts`` (None: not one)."""
    for rank, host in enumerate(hosts):
        if host.label == label:
            return rank
    return None


def members_text(hosts: Sequence[Host]) -> str:
    """A hostfile of exactly these nodes, in this (rank) order: a job's membership, as its nodes'
    ``meshkit run`` reads it."""
    lines = ["# meshkit: this job's membership, in rank order (written by its supervisor)"]
    lines += [host.line() for host in hosts]
    return "\n".join(lines) + "\n"


def _slots_said(host: Host) -> str:
    if host.slots:
        return f"slots={host.slots}"
    return "no slots="


def _uneven_slots_problems(hosts: Sequence[Host], path: str) -> list[str]:
    """Every node runs the same number of processes: each line whose slots= differs from the
    first line's is a problem."""
    if not hosts:
        return []
    first = hosts[0]
    problems = []
    for entry in hosts:
        if entry.slots != first.slots:
            problems.append(
                f"{path}:{entry.lineno}: {_slots_said(entry)} but line {first.lineno} has "
                f"{_slots_said(first)}; every node runs "
                "the same number of processes: give every line the same slots="
            )
    return problems


def duplicate_problems(
    hosts: Sequence[Host], addresses: Mapping[str, Sequence[str]], path: str = "hostfile"
) -> list[str]:
    """Entries that reach the same address and port under different names (``addresses``: host ->
    its resolved addresses; unresolved hosts are absent and cannot clash)."""
    owner: dict[tuple[str, int], Host] = {}
    problems = []
    for entry in hosts:
        for address in addresses.get(entry.host, ()):
            key = (address, entry.port or 22)
            other = owner.setdefault(key, entry)
            if other is not entry and other.host != entry.host:
                problems.append(
                    f"{path}:{entry.lineno}: {entry.label} is {address}, the same node as "
                    f"{other.label} on line {other.lineno}; list each node once"
                )
                break
    return problems


def select(
    hosts: Sequence[Host], include: str | None = None, exclude: str | None = None
) -> list[Host]:
    """Keep hosts named by ``include`` and drop those named by ``exclude``; each is a comma list of
    names, shell patterns (``gpu*``) or ranges (``node[01-04]``). Order (rank order) is kept."""
    keep = None
    if include:
        keep = _patterns(include, "--include")
    drop: list[str] = []
    if exclude:
        drop = _patterns(exclude, "--exclude")
    chosen = []
    for host in hosts:
        if keep is not None and not _matches(host, keep):
            continue
        if _matches(host, drop):
            continue
        chosen.append(host)
    if not chosen:
        raise HostfileError(
            f"--include {include!r} / --exclude {exclude!r} leave no hosts; "
            "check the names against the hostfile"
        )
    return chosen


def _patterns(text: str, flag: str) -> list[str]:
    if len(text) > MAX_LINE_CHARS:
        raise HostfileError(f"{flag}: longer than {MAX_LINE_CHARS} characters")
    patterns: list[str] = []
    for raw_part in split(text, ","):
        part = raw_part.strip()
        if not part:
            continue
        if "[" in part and "*" not in part and "?" not in part:
            try:
                patterns += _expand_range(part)
            except ValueError as exc:
                raise HostfileError(f"{flag}: bad range {part!r}: {exc}") from None
        else:
            patterns.append(part)
    return patterns


def _matches(host: Host, patterns: Sequence[str]) -> bool:
    if not patterns:
        return False
    import fnmatch  # --include/--exclude only

    for pattern in patterns:
        for name in (host.host, host.label):
            if fnmatch.fnmatchcase(name, pattern):
                return True
    return False
