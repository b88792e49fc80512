"""The doctor's bandwidth listener on this machine's loopback: it serves only peers that present
the round's token first, each peer in a thread of its own up to an absolute deadline (a slow peer
delays nobody and is cut off at it), and ``done`` closes every peer still open. The sandbox test
(the listener bound to the tested address, a tokenless and a slow peer during a real round) is
in test_bandwidth.py."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest

from meshkit.node import doctor, listeners, throughput
from meshkit.protocol import BandwidthTarget, DoneRequest, ListenRequest

TOKEN = "0123456789abcdef" * 2


def test_only_this_rounds_token_is_accepted():
    assert throughput.token_matches(TOKEN.encode(), TOKEN)
    assert not throughput.token_matches(b"f" * 32, TOKEN)
    assert not throughput.token_matches(b"sink".ljust(32), TOKEN)
    assert not throughput.token_matches(TOKEN.encode()[:5], TOKEN)
    assert not throughput.token_matches(b"".ljust(32), "")  # no token: nobody is served


@pytest.fixture
def listener() -> Iterator[tuple[str, int]]:
    request = ListenRequest(None, 0, 60, bandwidth=True, addresses=["127.0.0.1"], token=TOKEN)
    reply = listeners.listen(request)
    assert reply.error is None
    try:
        yield reply.address, reply.port
    finally:
        doctor.done(DoneRequest())


def test_a_bandwidth_listener_binds_only_the_addresses_asked():
    refused = listeners.listen(ListenRequest(None, 0, 5, bandwidth=True, token=TOKEN))
    assert refused.error == "no address to listen on was given"
    reply = listeners.listen(
        ListenRequest(None, 0, 5, bandwidth=True, addresses=["127.0.0.1"], token=TOKEN)
    )
    try:
        assert reply.address == "127.0.0.1"
        assert [sock.getsockname() for sock in listeners._listeners[reply.port].socks] == [
            ("127.0.0.1", reply.port)
        ]
    finally:
        doctor.done(DoneRequest())


def answer(address: str, port: int, sent: bytes) -> bytes:
    """What the listener sends back to a peer that sends ``sent`` (a reset, for data the listener
    never read, is nothing)."""
    with socket.create_connection((address, port), timeout=10) as peer:
        try:
            peer.sendall(sent)
            return peer.recv(64)
        except (ConnectionResetError, BrokenPipeError):
            return b""


def test_a_peer_without_the_token_gets_nothing(listener):
    address, port = listener
    sink = b"sink".ljust(throughput.HEADER) + bytes(4096)
    assert answer(address, port, sink) == b""  # closed unserved: no count comes back
    send = b"send 0.1 1000000".ljust(throughput.HEADER)
    assert answer(address, port, send) == b""  # no data either
    target = BandwidthTarget("me", address, port, "lo")
    sent, received = throughput.run_test(target, 0.1, 1 << 20, TOKEN)
    assert sent > 0 and received > 0
    with pytest.raises((OSError, ValueError)):
        throughput.run_test(target, 0.1, 1 << 20, "f" * 32)  # a wrong token is no token


def trickle(address: str, port: int, first: bytes, seconds: float, ends: list[float]) -> None:
    """A slow peer: ``first``, then a byte every half second for ``seconds`` at most; when the
    listener closed it is appended to ``ends``."""
    started = time.monotonic()
    with socket.create_connection((address, port), timeout=10) as peer:
        peer.sendall(first)
        try:
            while time.monotonic() - started < seconds:
                peer.settimeout(0.5)
                try:
                    if peer.recv(64) == b"":
                        break
                except TimeoutError:
                    pass
                peer.sendall(b"x")
        except OSError:
            pass
    ends.append(time.monotonic() - started)


def test_a_slow_peer_delays_nobody_and_is_cut_off_at_its_deadline(listener, monkeypatch):
    address, port = listener
    monkeypatch.setattr(throughput, "PEER_SECONDS", 3.0)
    ends: list[float] = []
    header = TOKEN.encode() + b"sink".ljust(throughput.HEADER)
    peers = [
        threading.Thread(target=trickle, args=(address, port, header, 20, ends)),
        threading.Thread(target=trickle, args=(address, port, b"", 20, ends)),  # no token
    ]
    for peer in peers:
        peer.start()
    time.sleep(0.3)
    target = BandwidthTarget("me", address, port, "lo")
    started = time.monotonic()
    sent, received = throughput.run_test(target, 0.1, 1 << 20, TOKEN)
    assert sent > 0 and received > 0
    assert time.monotonic() - started < 2.5  # not after the slow peers
    for peer in peers:
        peer.join(timeout=20)
    assert sorted(ends)[0] < throughput.TOKEN_SECONDS + 1.5  # the tokenless one
    assert sorted(ends)[1] < 3.0 + 1.5  # the slow one, at its deadline


def test_done_closes_every_peer_still_open(listener):
    address, port = listener
    ends: list[float] = []
    header = TOKEN.encode() + b"sink".ljust(throughput.HEADER)
    peer = threading.Thread(target=trickle, args=(address, port, header, 20, ends))
    peer.start()
    time.sleep(1.0)
    assert doctor.done(DoneRequest()).closed == 1
    peer.join(timeout=20)
    assert ends and ends[0] < 3.0
