"""One throughput test on the wire, both sides: the listener's (``serve_test``, run by the
doctor's bandwidth listeners) and the client's (``run_test``). Standard library only; every read
and send is bounded in time and bytes.
"""

from __future__ import annotations

import contextlib
import socket
import time

from .. import protocol as p

CHUNK = 256 * 1024
HEADER = 32  # "sink" or "send SECONDS BYTES", padded: a fixed size, so no data is read with it
MAX_TEST_SECONDS = 10.0
MAX_TEST_BYTES = 1 << 30
# Send buffers bounded: what sits in them when a try ends still has to arrive before it counts,
# which on a slow link is seconds at the kernel's autotuned 4 MiB (and 256 KiB still carries
# tens of Gbit/s at LAN round trips).
SNDBUF = 256 * 1024


def pump(connection: socket.socket, seconds: float, max_bytes: int) -> None:
    """Send zeros for ``seconds`` or ``max_bytes``, whichever ends first."""
    zeros = memoryview(bytes(CHUNK))
    sent = 0
    end = time.monotonic() + min(seconds, MAX_TEST_SECONDS)
    while sent < min(max_bytes, MAX_TEST_BYTES) and time.monotonic() < end:
        sent += connection.send(zeros[: min(CHUNK, max_bytes - sent)])


def drain(connection: socket.socket) -> int:
    """Read until the peer's EOF; how many bytes came."""
    buffer = bytearray(CHUNK)
    total = 0
    while True:
        count = connection.recv_into(buffer)
        if not count:
            return total
        total += count


def serve_test(connection: socket.socket) -> None:
    """The listener's side of one test: ``sink`` counts what arrives until the peer's EOF and
    answers the count; ``send`` sends for the time and bytes asked, then closes. A peer that
    breaks off, or sends a bad header, ends only its own test."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        connection.settimeout(MAX_TEST_SECONDS + 5)
        connection.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SNDBUF)
        header = b""
        while len(header) < HEADER:
            more = connection.recv(HEADER - len(header))
            if not more:
                break
            header += more
        words = header.split()
        if words[0] == b"sink":
            connection.sendall(b"%d\n" % drain(connection))
        elif words[0] == b"send":
            pump(connection, float(words[1]), int(words[2]))


def run_test(target: p.BandwidthTarget, seconds: float, max_bytes: int) -> tuple[float, float]:
    """One try each way, in bytes/s, each timed by the side that knows when the data arrived:
    what is still in buffers when sending stops counts until the peer has it."""
    address = (target.host, target.port)
    with socket.create_connection(address, timeout=MAX_TEST_SECONDS + 5) as connection:
        connection.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SNDBUF)
        started = time.monotonic()
        connection.sendall(b"sink".ljust(HEADER))
        pump(connection, seconds, max_bytes)
        connection.shutdown(socket.SHUT_WR)
        count = int(connection.makefile("rb").readline(32))
        sent = count / (time.monotonic() - started)
    with socket.create_connection(address, timeout=MAX_TEST_SECONDS + 5) as connection:
        started = time.monotonic()
        connection.sendall(f"send {seconds} {max_bytes}".encode().ljust(HEADER))
        received = drain(connection) / (time.monotonic() - started)
    return sent, received
