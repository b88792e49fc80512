"""One throughput test on the wire, both sides: the listener's (``serve_test``, run by the
doctor's bandwidth listeners) and the client's (``run_test``). Standard library only; every read
and send is bounded in time and bytes, and the listener's side serves only a peer that presents
the round's token, up to that peer's own absolute deadline.
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
# What a peer of a bandwidth listener must send first: this round's token (``secrets.token_hex``
# from the controller, padded to this size), within TOKEN_SECONDS of being accepted; and the most
# one peer's connection may last, whatever it sends: one test's worst case.
TOKEN_SIZE = 32
TOKEN_SECONDS = 2.0
PEER_SECONDS = MAX_TEST_SECONDS + 5


def pump(
    connection: socket.socket, seconds: float, max_bytes: int, deadline: float | None = None
) -> None:
    """Send zeros for ``seconds`` or ``max_bytes``, whichever ends first; past ``deadline`` (a
    monotonic time), a send that blocks raises ``TimeoutError``."""
    zeros = memoryview(bytes(CHUNK))
    sent = 0
    end = time.monotonic() + min(seconds, MAX_TEST_SECONDS)
    while sent < min(max_bytes, MAX_TEST_BYTES) and time.monotonic() < end:
        if deadline is not None:
            connection.settimeout(time_left(deadline))
        sent += connection.send(zeros[: min(CHUNK, max_bytes - sent)])


def drain(connection: socket.socket, deadline: float | None = None) -> int:
    """Read until the peer's EOF; how many bytes came. Past ``deadline`` (a monotonic time), a
    read raises ``TimeoutError``: a peer that sends a byte now and then is still cut off there."""
    buffer = bytearray(CHUNK)
    total = 0
    while True:
        if deadline is not None:
            connection.settimeout(time_left(deadline))
        count = connection.recv_into(buffer)
        if not count:
            return total
        total += count


def time_left(deadline: float) -> float:
    """Seconds until ``deadline`` (a monotonic time); ``TimeoutError`` once it has passed."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("the peer's time is up")
    return left


def read_exactly(connection: socket.socket, size: int, deadline: float) -> bytes:
    """``size`` bytes, or fewer when the peer ends first; ``TimeoutError`` past ``deadline``."""
    data = b""
    while len(data) < size:
        connection.settimeout(time_left(deadline))
        more = connection.recv(size - len(data))
        if not more:
            break
        data += more
    return data


def token_matches(presented: bytes, token: str) -> bool:
    """Whether a peer presented this round's token. A listener without a token serves nobody.
    (A plain comparison: hmac's constant-time one imports hashlib on every node, and a random
    token that lives one round cannot be guessed byte by byte from timings in that time.)"""
    if not token:
        return False
    return presented == token.encode().ljust(TOKEN_SIZE)[:TOKEN_SIZE]


def serve_test(connection: socket.socket, token: str) -> None:
    """The listener's side of one test: first the round's token, within ``TOKEN_SECONDS`` (a
    peer that does not present it is closed unserved); then ``sink`` counts what arrives until
    the peer's EOF and answers the count; ``send`` sends for the time and bytes asked, then
    closes. Every peer has an absolute deadline, so a slow or silent one ends at it; a peer that
    breaks off, or sends a bad header, ends only its own test."""
    accepted = time.monotonic()
    deadline = accepted + PEER_SECONDS
    with contextlib.suppress(OSError, ValueError, IndexError):
        connection.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SNDBUF)
        presented = read_exactly(connection, TOKEN_SIZE, accepted + TOKEN_SECONDS)
        if not token_matches(presented, token):
            return
        words = read_exactly(connection, HEADER, deadline).split()
        if words[0] == b"sink":
            count = drain(connection, deadline)
            connection.settimeout(time_left(deadline))
            connection.sendall(b"%d\n" % count)
        elif words[0] == b"send":
            pump(connection, float(words[1]), int(words[2]), deadline)


def run_test(
    target: p.BandwidthTarget, seconds: float, max_bytes: int, token: str
) -> tuple[float, float]:
    """One try each way, in bytes/s, each timed by the side that knows when the data arrived:
    what is still in buffers when sending stops counts until the peer has it. Each connection
    presents the round's ``token`` first."""
    presented = token.encode().ljust(TOKEN_SIZE)[:TOKEN_SIZE]
    address = (target.host, target.port)
    with socket.create_connection(address, timeout=MAX_TEST_SECONDS + 5) as connection:
        connection.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SNDBUF)
        started = time.monotonic()
        connection.sendall(presented + b"sink".ljust(HEADER))
        pump(connection, seconds, max_bytes)
        connection.shutdown(socket.SHUT_WR)
        count = int(connection.makefile("rb").readline(32))
        sent = count / (time.monotonic() - started)
    with socket.create_connection(address, timeout=MAX_TEST_SECONDS + 5) as connection:
        started = time.monotonic()
        header = f"send {seconds} {max_bytes}".encode().ljust(HEADER)
        connection.sendall(presented + header)
        received = drain(connection) / (time.monotonic() - started)
    return sent, received
