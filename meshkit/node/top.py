"""A node's side of ``meshkit top``: one sample of this machine and of the job's ranks here.
Standard library only.

Everything is read from the kernel's counters (``/proc/stat``, ``/proc/meminfo``,
``/proc/net/dev``, InfiniBand port counters, ``/proc/PID/stat`` and ``statm``) and the GPUs'
driver; rates are the counters' change since this agent's previous sample, kept in this process
between requests. Nothing runs between requests, and nothing is left when the agent ends with its
connection. The first request samples twice, ``settle`` seconds apart, so even one snapshot has
rates.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass, field

from ..protocol import JobState, PortRate, RankSample, TopReply, TopRequest
from . import files, jobs
from .gpu_readings import read_gpus

INFINIBAND = "/sys/class/infiniband"
IB_WORD = 4  # port_rcv_data and port_xmit_data count 4-byte words
MAX_PORTS = 32  # InfiniBand ports one reply carries
MAX_RANKS = 256  # ranks of the job on one node
MAX_SETTLE = 5.0  # seconds, whatever the request says
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
PAGE = os.sysconf("SC_PAGE_SIZE")


@dataclass(frozen=True)
class Port:
    """A port's byte counters at one moment."""

    name: str
    received: int
    sent: int


@dataclass(frozen=True)
class Counters:
    """The counters one sample reads; rates come from two of them."""

    time: float  # monotonic seconds
    cpu_busy: int  # clock ticks of all cores, not idle
    cpu_total: int
    ports: list[Port] = field(default_factory=list)
    rank_ticks: dict[int, int] = field(default_factory=dict)  # pid -> its user+system ticks


_previous: Counters | None = None  # this agent's last sample


def cpu_ticks(text: str) -> tuple[int, int]:
    """Pure: (busy, total) clock ticks from ``/proc/stat``'s first line (guest time is already
    in user time, so only the first eight columns count; idle and iowait are not busy)."""
    columns = text.split("\n", 1)[0].split()[1:9]
    ticks = [int(column) for column in columns]
    total = sum(ticks)
    idle = sum(ticks[3:5])
    return total - idle, total


def memory(text: str) -> tuple[int, int]:
    """Pure: (used, total) bytes from ``/proc/meminfo``: used is total less available."""
    found = {}
    for line in text.splitlines():
        name, _, rest = line.partition(":")
        if name in ("MemTotal", "MemAvailable"):
            found[name] = int(rest.split()[0]) * 1024
    total = found.get("MemTotal", 0)
    return total - found.get("MemAvailable", total), total


def net_dev(text: str) -> dict[str, Port]:
    """Pure: interface -> its byte counters, from ``/proc/net/dev`` (this network namespace's)."""
    found = {}
    for line in text.splitlines()[2:]:
        name, _, rest = line.partition(":")
        columns = rest.split()
        if len(columns) >= 9:
            found[name.strip()] = Port(name.strip(), int(columns[0]), int(columns[8]))
    return found


def process_ticks(stat: str) -> int:
    """Pure: a process's user+system clock ticks from its ``/proc/PID/stat``. The command name may
    hold spaces and parentheses: the fields start after the last ')'."""
    columns = stat[stat.rfind(")") + 2 :].split()
    return int(columns[11]) + int(columns[12])  # utime and stime (fields 14 and 15)


def resident_bytes(statm: str) -> int:
    """Pure: a process's resident memory from its ``/proc/PID/statm`` (pages, second column)."""
    return int(statm.split()[1]) * PAGE


def _read(path: str) -> str:
    with open(path) as handle:
        return handle.read()


def job_interface(address: str) -> str | None:
    """The interface holding the address the hostfile names this node by, else the one the
    controller's connection came in on (``SSH_CONNECTION``: a hostfile name, not an address)."""
    from .listeners import interface_address  # fcntl and struct: only top and the doctor

    connection = os.environ.get("SSH_CONNECTION", "").split()
    wanted = [address]
    if len(connection) == 4:
        wanted.append(connection[2])
    import socket

    names = [name for _, name in socket.if_nameindex()]
    for candidate in wanted:
        for name in names:
            if interface_address(name) == candidate:
                return name
    busiest = None  # neither: the interface that has received the most
    for port in net_dev(_read("/proc/net/dev")).values():
        if port.name != "lo" and (busiest is None or port.received > busiest.received):
            busiest = port
    return None if busiest is None else busiest.name


def infiniband_ports(root: str = INFINIBAND) -> list[Port]:
    """Each InfiniBand/RoCE port's data counters (``mlx5_0:1``), in bytes."""
    found = []
    with contextlib.suppress(OSError):
        for device in sorted(os.listdir(root)):
            for port in sorted(os.listdir(f"{root}/{device}/ports")):
                counters = f"{root}/{device}/ports/{port}/counters"
                with contextlib.suppress(OSError, ValueError):
                    received = int(_read(f"{counters}/port_rcv_data")) * IB_WORD
                    sent = int(_read(f"{counters}/port_xmit_data")) * IB_WORD
                    found.append(Port(f"{device}:{port}", received, sent))
    return found[:MAX_PORTS]


def ranks_here(job_id: str) -> dict[int, int]:
    """rank -> pid of the job's ranks on this node (as ``diagnose`` finds them)."""
    if not job_id:
        return {}
    keeper = jobs.keeper_pid(job_id)
    if keeper is None:
        return {}
    from .diagnose import rank_processes

    return dict(list(rank_processes(keeper).items())[:MAX_RANKS])


def read_counters(interface: str | None, rank_pids: dict[int, int]) -> Counters:
    busy, total = cpu_ticks(_read("/proc/stat"))
    ports = []
    if interface is not None:
        found = net_dev(_read("/proc/net/dev")).get(interface)
        if found is not None:
            ports.append(found)
    ports += infiniband_ports()
    rank_ticks = {}
    for pid in rank_pids.values():
        with contextlib.suppress(OSError, ValueError, IndexError):
            rank_ticks[pid] = process_ticks(_read(f"/proc/{pid}/stat"))
    return Counters(time.monotonic(), busy, total, ports, rank_ticks)


def _rate(now: int, before: int | None, seconds: float) -> float | None:
    if before is None or seconds <= 0 or now < before:  # a counter reset: no rate this time
        return None
    return (now - before) / seconds


def sample(request: TopRequest) -> TopReply:
    global _previous
    interface = job_interface(request.address)
    rank_pids = ranks_here(request.job_id)
    previous = _previous
    if previous is None:
        previous = read_counters(interface, rank_pids)
        time.sleep(max(0.0, min(request.settle, MAX_SETTLE)))
    now = read_counters(interface, rank_pids)
    _previous = now
    seconds = now.time - previous.time
    cpu = None
    if now.cpu_total > previous.cpu_total:
        busy_share = (now.cpu_busy - previous.cpu_busy) / (now.cpu_total - previous.cpu_total)
        cpu = 100.0 * max(0.0, busy_share)
    before = {port.name: port for port in previous.ports}
    ports = []
    for port in now.ports:
        old = before.get(port.name)
        receive_rate = _rate(port.received, old.received if old else None, seconds)
        send_rate = _rate(port.sent, old.sent if old else None, seconds)
        ports.append(PortRate(port.name, port.received, port.sent, receive_rate, send_rate))
    ranks = []
    for rank, pid in rank_pids.items():
        try:
            ticks = process_ticks(_read(f"/proc/{pid}/stat"))
            rss = resident_bytes(_read(f"/proc/{pid}/statm"))
        except (OSError, ValueError, IndexError):
            continue  # gone since it was found
        rank_cpu = _rate(ticks, previous.rank_ticks.get(pid), seconds)
        if rank_cpu is not None:
            rank_cpu = 100.0 * rank_cpu / CLOCK_TICKS
        ranks.append(RankSample(rank, pid, rank_cpu, rss))
    used, total = memory(_read("/proc/meminfo"))
    gpus = read_gpus()
    reply = TopReply(
        hostname=os.uname().nodename,
        cpus=os.cpu_count() or 1,
        cpu=cpu,
        memory_used=used,
        memory_total=total,
        load=list(os.getloadavg()),
        interface=interface,
        ports=ports,
        gpus=gpus.gpus,
        gpu_source=gpus.source,
        ranks=ranks,
        gpu_error=gpus.error,
    )
    if request.health is not None:
        from dataclasses import replace

        from .health import read_health

        reply = replace(reply, health=read_health(request.health))
    if not request.job_id:
        return reply
    return _with_job(reply, request)


def _with_job(reply: TopReply, request: TopRequest) -> TopReply:
    """The job's state here and how long its log has been quiet; why not, when it cannot be
    looked at (an unsafe state directory, a damaged state file): the node's figures stay."""
    from dataclasses import replace

    try:
        files.check_dir(files.job_dir(request.job_id))
        state, _ = jobs.job_state(request.job_id)
        started = None
        if state != JobState.ABSENT:
            started = jobs.started_at(request.job_id)
        idle = jobs.idle(request.log, started) if request.log else None
        progress = []
        if state == JobState.RUNNING:
            from .progress import read_progress

            progress = read_progress(files.job_dir(request.job_id), started, request.window)
    except Exception as exc:
        return replace(reply, job_error=f"{type(exc).__name__}: {exc}"[:300])
    return replace(reply, job_state=state, idle=idle, progress=progress)
