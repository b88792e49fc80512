"""The node side of ``meshkit doctor``: facts about this node, short-lived TCP listeners, TCP
connect probes and throughput tests to the other nodes, and the collective probe. Standard library
only, and every call is bounded in time: the agent answers one request at a time, so listeners run
in background threads of the agent and close by themselves.

Versions come from package metadata and files, never from importing torch (seconds, and a GPU
context, on every node).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import importlib.util
import os
import re
import signal
import socket
import struct
import sys
import threading
import time

from .. import protocol as p
from .gpus import gpu_count

MAX_SECONDS = 120.0  # no doctor call holds a listener or retries longer than this
SIOCGIFADDR = 0x8915
SIOCGIFNETMASK = 0x891B


def _version(package: str) -> str | None:
    """The installed version of ``package``, as ``importlib.metadata.version`` finds it: the first
    ``.dist-info`` (or ``.egg-info``) of that name along ``sys.path``. Read here because importing
    importlib.metadata costs every node tens of ms at every doctor (a test compares the two on
    every distribution installed)."""
    want = _normalized(package)
    for entry in sys.path:
        with contextlib.suppress(OSError):
            for name in os.listdir(entry or "."):
                stem, _, kind = name.rpartition(".")
                if kind in ("dist-info", "egg-info") and _normalized(stem.split("-")[0]) == want:
                    path = os.path.join(entry or ".", name)
                    if os.path.isdir(path):
                        path = os.path.join(path, "METADATA" if kind == "dist-info" else "PKG-INFO")
                    found = _metadata_version(path)
                    if found is not None:
                        return found
    return None


def _normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def _metadata_version(path: str) -> str | None:
    """The ``Version:`` header of a core metadata file (headers end at the first blank line)."""
    with contextlib.suppress(OSError), open(path, encoding="utf-8", errors="replace") as handle:
        for line in handle:
            if not line.strip():
                break
            if line.startswith("Version:"):
                return line.partition(":")[2].strip() or None
    return None


def torch_cuda() -> str | None:
    """The CUDA version torch was built with, from torch/version.py (torch is not imported)."""
    spec = importlib.util.find_spec("torch")
    locations = spec.submodule_search_locations if spec else None
    for location in locations or []:
        with contextlib.suppress(OSError), open(os.path.join(location, "version.py")) as handle:
            found = re.search(r"^cuda\b[^=\n]*=\s*['\"]([^'\"]+)['\"]", handle.read(), re.MULTILINE)
            return found.group(1) if found else None
    return None


def nccl_version() -> str | None:
    return next(filter(None, (_version(f"nvidia-nccl-cu{cuda}") for cuda in (13, 12, 11))), None)


def _writable(workdir: str) -> str | None:
    # A file of our own (pid + time: unique among this node's doctors), created exclusively,
    # written and removed; not tempfile, whose import costs every node ms.
    path = os.path.join(workdir, f".meshkit-doctor-{os.getpid()}-{time.time_ns()}")
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, b"x")
        finally:
            os.close(fd)
            os.unlink(path)
    except OSError as exc:
        return f"{workdir}: {exc.strerror or exc}"
    return None


def _marker(request: p.FactsRequest) -> str:
    path = request.marker
    try:
        if request.write_marker:
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
            with open(path, "w") as handle:
                handle.write(request.token)
            return "written"
        with open(path) as handle:
            text = handle.read(4096)
    except FileNotFoundError:
        return f"{path} is not there"
    except OSError as exc:
        return f"{path}: {exc.strerror or exc}"
    return "seen" if text == request.token else f"{path} holds another run's token"


def facts(request: p.FactsRequest) -> p.FactsReply:
    from .. import __version__

    missing = None if os.path.isdir(request.workdir) else f"{request.workdir}: missing"
    return p.FactsReply(
        hostname=socket.gethostname(),
        python="{}.{}.{}".format(*sys.version_info[:3]),  # platform.python_version(), unimported
        meshkit=_version("meshkit") or __version__,
        torch=_version("torch"),
        cuda=torch_cuda(),
        nccl=nccl_version(),
        gpus=gpu_count(),
        writable=missing or _writable(request.workdir),
        marker=missing or _marker(request),
        clock=time.time(),
    )


_listeners: dict[int, tuple[socket.socket, threading.Event]] = {}


def interface_address(ifname: str, request: int = SIOCGIFADDR) -> str | None:
    """The IPv4 address of an interface (what gloo binds for GLOO_SOCKET_IFNAME), or its netmask."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            packed = fcntl.ioctl(sock.fileno(), request, struct.pack("256s", ifname.encode()[:15]))
        except OSError:
            return None
    return socket.inet_ntoa(packed[20:24])


def port_holder(port: int) -> str | None:
    """Which process listens on TCP ``port`` here (from /proc; None when it cannot be told)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            with open(table) as handle:
                text = handle.read()
            for line in text.splitlines()[1:]:
                fields = line.split()
                listening = len(fields) > 9 and fields[3] == "0A"  # 0A: TCP_LISTEN
                if listening and int(fields[1].rsplit(":", 1)[1], 16) == port:
                    inodes.add(f"socket:[{fields[9]}]")
    if not inodes:
        return None
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    if os.readlink(f"/proc/{pid}/fd/{fd}") in inodes:
                        with open(f"/proc/{pid}/comm") as handle:
                            comm = handle.read().strip()
                        return f"pid {pid} ({comm})"
    return None


def _serve(sock: socket.socket, stop: threading.Event, deadline: float, bandwidth: bool) -> None:
    sock.settimeout(0.2)
    while not stop.is_set() and time.monotonic() < deadline:
        try:
            conn, _ = sock.accept()
        except (TimeoutError, socket.timeout):
            continue
        except OSError:
            break
        if bandwidth:  # one peer per round, its tests one after the other: served in turn
            _bandwidth_peer(conn)
        conn.close()
    sock.close()
    stop.set()


def listen(request: p.ListenRequest) -> p.ListenReply:
    port, address = request.port, interface_address(request.ifname) if request.ifname else ""
    if address is None:
        return p.ListenReply("", port, f"interface {request.ifname} has no IPv4 address here")
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    # as torchrun's store does: a port in TIME_WAIT is free, one with a listener is not
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((address, port))
        sock.listen(64)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            holder = port_holder(port)
            held = f" (held by {holder})" if holder else ""
            return p.ListenReply(address, port, f"port {port} is busy{held}")
        why = f"cannot listen on {address or '*'}:{port}: {exc.strerror or exc}"
        return p.ListenReply(address, port, why)
    port, stop = int(sock.getsockname()[1]), threading.Event()
    deadline = time.monotonic() + min(max(request.seconds, 0.1), MAX_SECONDS)
    serve = (sock, stop, deadline, request.bandwidth)
    threading.Thread(target=_serve, args=serve, daemon=True).start()
    _listeners[port] = (sock, stop)
    return p.ListenReply(address or "*", port, None)


def done(request: p.DoneRequest) -> p.DoneReply:
    closed = len(_listeners)
    for sock, stop in _listeners.values():
        stop.set()
        sock.close()  # now, not at the thread's next tick: a job may bind this port next
    _listeners.clear()
    if request.marker:
        with contextlib.suppress(OSError):
            os.unlink(request.marker)
    return p.DoneReply(closed)


ATTEMPT = 2.0  # seconds one connect attempt may take


def _connect(target: p.ProbeTarget, deadline: float) -> p.ConnectResult:
    """Retry until the deadline: the peer's listener may open a moment after we start. At least
    one attempt is made (of up to ATTEMPT seconds), even when this thread started after the
    deadline: on a loaded node, with hundreds of peers, a probe that never tried is no verdict."""
    started, last, where = time.monotonic(), "", f"{target.host}:{target.port}"
    while True:
        left = deadline - time.monotonic()
        if left <= 0 and last:
            return p.ConnectResult(target.label, target.port, False, f"{where}: {last}")
        try:
            timeout = min(left, ATTEMPT) if left > 0 else ATTEMPT
            socket.create_connection((target.host, target.port), timeout=timeout).close()
            took = (time.monotonic() - started) * 1000
            return p.ConnectResult(target.label, target.port, True, f"{where} in {took:.0f} ms")
        except (TimeoutError, socket.timeout):
            last = "no answer (timeout)"
        except OSError as exc:
            last = exc.strerror or str(exc)
        time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))


def connect(request: p.ConnectRequest) -> p.ConnectReply:
    deadline = time.monotonic() + min(max(request.seconds, 0.1), MAX_SECONDS)
    targets = request.targets
    results = [p.ConnectResult(t.label, t.port, False, "probe did not finish") for t in targets]

    def one(i: int, target: p.ProbeTarget) -> None:
        results[i] = _connect(target, deadline)

    tried = enumerate(targets[:1024])  # bounded threads: the rest are said not to have finished
    threads = [threading.Thread(target=one, args=it, daemon=True) for it in tried]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()) + 3.0)
    return p.ConnectReply(results)


CHUNK = 256 * 1024
HEADER = 32  # "sink" or "send SECONDS BYTES", padded: a fixed size, so no data is read with it
MAX_TEST_SECONDS = 10.0
MAX_TEST_BYTES = 1 << 30
# Send buffers bounded: what sits in them when a try ends still has to arrive before it counts,
# which on a slow link is seconds at the kernel's autotuned 4 MiB (and 256 KiB still carries
# tens of Gbit/s at LAN round trips).
SNDBUF = 256 * 1024


def _pump(conn: socket.socket, seconds: float, max_bytes: int) -> None:
    """Send zeros for ``seconds`` or ``max_bytes``, whichever ends first."""
    data, sent = memoryview(bytes(CHUNK)), 0
    end = time.monotonic() + min(seconds, MAX_TEST_SECONDS)
    while sent < min(max_bytes, MAX_TEST_BYTES) and time.monotonic() < end:
        sent += conn.send(data[: min(CHUNK, max_bytes - sent)])


def _drain(conn: socket.socket) -> int:
    buf, total = bytearray(CHUNK), 0
    while n := conn.recv_into(buf):
        total += n
    return total


def _bandwidth_peer(conn: socket.socket) -> None:
    """The listener's side of one test: ``sink`` counts what arrives until the peer's EOF and
    answers the count; ``send`` sends for the time and bytes asked, then closes."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        conn.settimeout(MAX_TEST_SECONDS + 5)
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SNDBUF)
        header = b""
        while len(header) < HEADER and (more := conn.recv(HEADER - len(header))):
            header += more
        words = header.split()
        if words[0] == b"sink":
            conn.sendall(b"%d\n" % _drain(conn))
        elif words[0] == b"send":
            _pump(conn, float(words[1]), int(words[2]))


def _measure(target: p.BandwidthTarget, seconds: float, max_bytes: int) -> tuple[float, float]:
    """One try each way, in bytes/s, each timed by the side that knows when the data arrived:
    what is still in buffers when sending stops counts until the peer has it."""
    address = (target.host, target.port)
    with socket.create_connection(address, timeout=MAX_TEST_SECONDS + 5) as conn:
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SNDBUF)
        started = time.monotonic()
        conn.sendall(b"sink".ljust(HEADER))
        _pump(conn, seconds, max_bytes)
        conn.shutdown(socket.SHUT_WR)
        count = int(conn.makefile("rb").readline(32))
        sent = count / (time.monotonic() - started)
    with socket.create_connection(address, timeout=MAX_TEST_SECONDS + 5) as conn:
        started = time.monotonic()
        conn.sendall(f"send {seconds} {max_bytes}".encode().ljust(HEADER))
        received = _drain(conn) / (time.monotonic() - started)
    return sent, received


def networks() -> list[str]:
    """This node's IPv4 networks other nodes could use (neither loopback nor link-local)."""
    found = []
    for _, name in socket.if_nameindex():
        address, mask = interface_address(name), interface_address(name, SIOCGIFNETMASK)
        if address and mask and not address.startswith(("127.", "169.254.")):
            bits = bin(int.from_bytes(socket.inet_aton(mask), "big")).count("1")
            found.append(f"{name} {address}/{bits}")
    return found


def infiniband(root: str = "/sys/class/infiniband") -> list[str]:
    """Each InfiniBand/RoCE device port and its state (``mlx5_0:1 ACTIVE``)."""
    found = []
    with contextlib.suppress(OSError):
        for device in sorted(os.listdir(root)):
            for port in sorted(os.listdir(f"{root}/{device}/ports")):
                with contextlib.suppress(OSError), open(f"{root}/{device}/ports/{port}/state") as f:
                    found.append(f"{device}:{port} {f.read().rpartition(':')[2].strip()}")
    return found


def bandwidth(request: p.BandwidthRequest) -> p.BandwidthReply:
    """Each try goes over every target in turn (a pair's networks interleaved, so that a busy
    moment weighs on all of them alike); the best try per target counts."""
    targets, seconds = request.targets[:64], min(max(request.seconds, 0.01), MAX_TEST_SECONDS)
    size = min(max(request.max_bytes, 1), MAX_TEST_BYTES)
    errors: list[str | None] = [None] * len(targets)
    best = [(0.0, 0.0)] * len(targets)
    for _ in range(min(max(request.repeats, 1), 10)):
        for i, target in enumerate(targets):
            try:
                if errors[i] is None:
                    sent, received = _measure(target, seconds, size)
                    best[i] = (max(best[i][0], sent), max(best[i][1], received))
            except (OSError, ValueError) as exc:
                why = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
                errors[i] = f"{target.host}:{target.port}: {why or type(exc).__name__}"
    found = [p.BandwidthResult(t.label, t.network, *b, e) for t, b, e in zip(targets, best, errors)]
    return p.BandwidthReply(found, networks(), infiniband(), _version("torch") is not None)


def probe(request: p.ProbeRequest) -> p.ProbeReply:
    if not os.path.isdir(request.cwd):
        return p.ProbeReply(1, "", f"cd: {request.cwd}: No such file or directory")
    import subprocess  # the full doctor's collective probe only

    seconds = min(max(request.seconds, 1.0), MAX_SECONDS * 2)
    try:
        # its own process group: on timeout, the probe and everything it started end together
        child = subprocess.Popen(
            request.argv,
            cwd=request.cwd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
    except FileNotFoundError:
        return p.ProbeReply(127, "", f"{request.argv[0]}: No such file or directory")
    try:
        out, err = child.communicate(timeout=seconds)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.pid, signal.SIGKILL)
        out, _ = child.communicate()
        took = f"the collective probe took longer than {seconds:.0f}s"
        return p.ProbeReply(124, out[-65536:], took)
    return p.ProbeReply(child.returncode, out[-65536:], err[-65536:])
