"""The node side of ``meshkit doctor``: facts about this node, TCP connect probes and throughput
tests to the other nodes, and the collective probe (the short-lived listeners they connect to are
``listeners.py``'s). Standard library only, and every call is bounded in time.

Versions come from package metadata and files, never from importing torch (seconds, and a GPU
context, on every node).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import signal
import socket
import sys
import threading
import time

from .. import protocol as p
from ..health import NodeHealth
from . import listeners, throughput
from .gpus import gpu_count
from .infiniband import INFINIBAND, ports
from .listeners import MAX_SECONDS, SIOCGIFNETMASK, interface_address

# torch/version.py's line ``cuda = '12.1'`` (or ``cuda: Optional[str] = None``: no CUDA build)
CUDA_LINE = re.compile(r"^cuda\b[^=\n]*=\s*['\"]([^'\"]+)['\"]", re.MULTILINE)
NCCL_BUILDS = (13, 12, 11)  # the CUDA majors of the nvidia-nccl-cuNN wheels, newest first


def _version(package: str) -> str | None:
    """The installed version of ``package``, as ``importlib.metadata.version`` finds it: the first
    ``.dist-info`` (or ``.egg-info``) of that name along ``sys.path``. Read here because importing
    importlib.metadata would slow every node at every doctor (a test compares the two on every
    distribution installed)."""
    want = _normalized(package)
    for entry in sys.path:
        directory = entry or "."
        try:
            names = os.listdir(directory)
        except OSError:
            continue  # not a directory (a zip) or gone
        for name in names:
            stem, _, kind = name.rpartition(".")
            if kind not in ("dist-info", "egg-info"):
                continue
            if _normalized(stem.split("-")[0]) != want:
                continue
            path = os.path.join(directory, name)
            if os.path.isdir(path):
                metadata = "METADATA" if kind == "dist-info" else "PKG-INFO"
                path = os.path.join(path, metadata)
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
                version = line.partition(":")[2].strip()
                return version if version else None
    return None


def torch_cuda() -> str | None:
    """The CUDA version torch was built with, from torch/version.py (torch is not imported)."""
    spec = importlib.util.find_spec("torch")
    if spec is None or spec.submodule_search_locations is None:
        return None
    for location in spec.submodule_search_locations:
        try:
            with open(os.path.join(location, "version.py")) as handle:
                text = handle.read()
        except OSError:
            continue
        found = CUDA_LINE.search(text)
        return found.group(1) if found else None
    return None


def nccl_version() -> str | None:
    """The version of the NCCL wheel torch uses (the newest CUDA build's that is installed)."""
    for cuda in NCCL_BUILDS:
        found = _version(f"nvidia-nccl-cu{cuda}")
        if found:
            return found
    return None


def _writable(workdir: str) -> str | None:
    # A file of our own (pid + time: unique among this node's doctors), created exclusively,
    # written and removed; not tempfile, whose import would slow every node.
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

    if os.path.isdir(request.workdir):
        writable = _writable(request.workdir)
        marker = _marker(request)
    else:
        writable = f"{request.workdir}: missing"
        marker = writable
    major, minor, micro = sys.version_info[:3]
    return p.FactsReply(
        hostname=socket.gethostname(),
        python=f"{major}.{minor}.{micro}",  # platform.python_version(), without importing it
        meshkit=_version("meshkit") or __version__,
        torch=_version("torch"),
        cuda=torch_cuda(),
        nccl=nccl_version(),
        gpus=gpu_count(),
        writable=writable,
        marker=marker,
        health=_health(request),
        clock=time.time(),  # last: the controller compares it with the round trip's middle
    )


def _health(request: p.FactsRequest) -> NodeHealth | None:
    if request.health is None:
        return None
    from .health import read_health

    return read_health(request.health)


def done(request: p.DoneRequest) -> p.DoneReply:
    closed = listeners.close_all()
    if request.marker:
        with contextlib.suppress(OSError):
            os.unlink(request.marker)
    return p.DoneReply(closed)


ATTEMPT = 2.0  # seconds one connect attempt may take
MAX_PROBES = 1024  # connect threads at once


def _connect(target: p.ProbeTarget, deadline: float) -> p.ConnectResult:
    """Retry until the deadline: the peer's listener may open a moment after we start. At least
    one attempt is made (of up to ATTEMPT seconds), even when this thread started after the
    deadline: on a loaded node, with hundreds of peers, a probe that never tried is no verdict."""
    started = time.monotonic()
    last = ""  # why the last attempt failed
    where = f"{target.host}:{target.port}"
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
    results = []
    for target in targets:
        results.append(p.ConnectResult(target.label, target.port, False, "probe did not finish"))

    def one(index: int, target: p.ProbeTarget) -> None:
        results[index] = _connect(target, deadline)

    # bounded threads: the targets past MAX_PROBES are said not to have finished
    threads = []
    for index, target in enumerate(targets[:MAX_PROBES]):
        threads.append(threading.Thread(target=one, args=(index, target), daemon=True))
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()) + 3.0)
    return p.ConnectReply(results)


MAX_TARGETS = 64  # bandwidth tests in one request
MAX_REPEATS = 10  # tries of each
OUTPUT_TAIL = 65536  # characters of the probe's output kept


def networks() -> list[str]:
    """This node's IPv4 networks other nodes could use (neither loopback nor link-local)."""
    found = []
    for _, name in socket.if_nameindex():
        address = interface_address(name)
        mask = interface_address(name, SIOCGIFNETMASK)
        if address and mask and not address.startswith(("127.", "169.254.")):
            bits = bin(int.from_bytes(socket.inet_aton(mask), "big")).count("1")  # its prefix
            found.append(f"{name} {address}/{bits}")
    return found


def infiniband(root: str = INFINIBAND) -> list[str]:
    """Each InfiniBand/RoCE device port and its state (``mlx5_0:1 ACTIVE``)."""
    return [f"{port.name} {port.state}" for port in ports(root, counters=False)]


def bandwidth(request: p.BandwidthRequest) -> p.BandwidthReply:
    """Each try goes over every target in turn (a pair's networks interleaved, so that a busy
    moment weighs on all of them alike); the best try per target counts."""
    targets = request.targets[:MAX_TARGETS]
    seconds = min(max(request.seconds, 0.01), throughput.MAX_TEST_SECONDS)
    size = min(max(request.max_bytes, 1), throughput.MAX_TEST_BYTES)
    repeats = min(max(request.repeats, 1), MAX_REPEATS)
    errors: list[str | None] = [None] * len(targets)
    best_sent = [0.0] * len(targets)
    best_received = [0.0] * len(targets)
    for _ in range(repeats):
        for i, target in enumerate(targets):
            if errors[i] is not None:
                continue  # failed once: not tried again
            try:
                sent, received = throughput.run_test(target, seconds, size, request.token)
            except (OSError, ValueError) as exc:
                errors[i] = _test_error(target, exc)
                continue
            best_sent[i] = max(best_sent[i], sent)
            best_received[i] = max(best_received[i], received)
    found = []
    for i, target in enumerate(targets):
        result = p.BandwidthResult(
            target.label, target.network, best_sent[i], best_received[i], errors[i]
        )
        found.append(result)
    return p.BandwidthReply(found, networks(), infiniband(), _version("torch") is not None)


def _test_error(target: p.BandwidthTarget, exc: OSError | ValueError) -> str:
    """Why a test failed: the system's words for an OSError that has them, else the exception."""
    why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
    return f"{target.host}:{target.port}: {why}"


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
        return p.ProbeReply(124, out[-OUTPUT_TAIL:], took)
    return p.ProbeReply(child.returncode, out[-OUTPUT_TAIL:], err[-OUTPUT_TAIL:])
