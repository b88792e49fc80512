"""The doctor's short-lived TCP listeners, each run by a background thread of the node agent
(which answers one request at a time) and closed by ``doctor_done`` or at its own deadline. A
plain listener only accepts (the reach probes); a bandwidth listener listens on the tested
addresses only and serves each peer that presents the round's token its throughput test
(``throughput.serve_test``), in a thread of its own. Standard library only.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import select
import socket
import struct
import threading
import time

from .. import protocol as p
from . import throughput

MAX_SECONDS = 120.0  # no doctor call holds a listener or retries longer than this
SIOCGIFADDR = 0x8915  # the ioctl that reads an interface's IPv4 address
SIOCGIFNETMASK = 0x891B  # ... and its netmask


class Listener:
    """The listening sockets of one listen request (one per address, on one port), the event that
    stops the thread serving them, and the peers being served (closed with the listener)."""

    def __init__(self, socks: list[socket.socket], stop: threading.Event) -> None:
        self.socks = socks
        self.stop = stop
        self.peers: set[socket.socket] = set()
        self.lock = threading.Lock()

    def close(self) -> None:
        """Close the sockets now, not at the serving thread's next tick (a job may bind this port
        next), and cut off every peer still being served (its thread closes it)."""
        self.stop.set()
        for sock in self.socks:
            # shut down first: the serving thread's select holds the socket's file until it wakes,
            # and a socket is out of LISTEN only once its file is released or it is shut down
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()
        with self.lock:
            for peer in self.peers:
                with contextlib.suppress(OSError):
                    peer.shutdown(socket.SHUT_RDWR)


_listeners: dict[int, Listener] = {}  # port -> this agent's listener on it
MAX_PEERS = 16  # peers a bandwidth listener serves at once; one more is closed unserved


def interface_address(ifname: str, request: int = SIOCGIFADDR) -> str | None:
    """The IPv4 address of an interface (what gloo binds for GLOO_SOCKET_IFNAME), or its netmask."""
    asked = struct.pack("256s", ifname.encode()[:15])  # a struct ifreq: the name (15 bytes at most)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            answer = fcntl.ioctl(sock.fileno(), request, asked)
        except OSError:
            return None
    return socket.inet_ntoa(answer[20:24])  # the address bytes of the answer's sockaddr_in


def port_holder(port: int) -> str | None:
    """Which process listens on TCP ``port`` here (from /proc; None when it cannot be told)."""
    inodes = _listening_sockets(port)
    if not inodes:
        return None
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            descriptors = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue  # gone, or not ours to look at
        for fd in descriptors:
            with contextlib.suppress(OSError):
                if os.readlink(f"/proc/{pid}/fd/{fd}") in inodes:
                    with open(f"/proc/{pid}/comm") as handle:
                        command = handle.read().strip()
                    return f"pid {pid} ({command})"
    return None


def _listening_sockets(port: int) -> set[str]:
    """The sockets listening on TCP ``port``, as /proc/PID/fd links name them."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as handle:
                text = handle.read()
        except OSError:
            continue
        for line in text.splitlines()[1:]:
            fields = line.split()
            listening = len(fields) > 9 and fields[3] == "0A"  # 0A: TCP_LISTEN
            if listening and int(fields[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(f"socket:[{fields[9]}]")
    return inodes


def _serve(listener: Listener, deadline: float, token: str | None) -> None:
    """Accept until stopped or ``deadline``; with a ``token`` (a bandwidth listener), serve each
    peer its throughput test in a thread of its own, so that a slow peer delays nobody else."""
    while not listener.stop.is_set() and time.monotonic() < deadline:
        try:
            ready, _, _ = select.select(listener.socks, [], [], 0.2)
        except (OSError, ValueError):
            break  # closed by ``done``
        for sock in ready:
            try:
                connection, _ = sock.accept()
            except OSError:
                continue
            if token is None:
                connection.close()
            else:
                _serve_peer_in_thread(listener, connection, token)
    listener.close()


def _serve_peer_in_thread(listener: Listener, connection: socket.socket, token: str) -> None:
    with listener.lock:
        if len(listener.peers) >= MAX_PEERS:
            connection.close()
            return
        listener.peers.add(connection)
    thread = threading.Thread(target=_serve_peer, args=(listener, connection, token), daemon=True)
    thread.start()


def _serve_peer(listener: Listener, connection: socket.socket, token: str) -> None:
    try:
        throughput.serve_test(connection, token)
    finally:
        with listener.lock:
            listener.peers.discard(connection)
        connection.close()


def listen_addresses(request: p.ListenRequest) -> list[str] | p.ListenReply:
    """Where to listen: a bandwidth listener on the tested addresses only, never every
    address; another on ``ifname``'s address, or on every address ("")."""
    if request.bandwidth:
        if not request.addresses:
            return p.ListenReply("", request.port, "no address to listen on was given")
        return request.addresses
    if not request.ifname:
        return [""]
    address = interface_address(request.ifname)
    if address is None:
        why = f"interface {request.ifname} has no IPv4 address here"
        return p.ListenReply("", request.port, why)
    return [address]


def _bound(address: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    # as torchrun's store does: a port in TIME_WAIT is free, one with a listener is not
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((address, port))
        sock.listen(64)
    except OSError:
        sock.close()
        raise
    return sock


def _cannot_listen(address: str, port: int, exc: OSError) -> p.ListenReply:
    if exc.errno == errno.EADDRINUSE:
        holder = port_holder(port)
        held = f" (held by {holder})" if holder else ""
        return p.ListenReply(address, port, f"port {port} is busy{held}")
    why = f"cannot listen on {address or '*'}:{port}: {exc.strerror or exc}"
    return p.ListenReply(address, port, why)


def listen(request: p.ListenRequest) -> p.ListenReply:
    """Listen on each address, all on one port (the first's, when ``request.port`` is 0)."""
    addresses = listen_addresses(request)
    if isinstance(addresses, p.ListenReply):
        return addresses
    port = request.port
    socks: list[socket.socket] = []
    for address in addresses:
        try:
            socks.append(_bound(address, port))
        except OSError as exc:
            for sock in socks:
                sock.close()
            return _cannot_listen(address, port, exc)
        port = int(socks[0].getsockname()[1])
    stop = threading.Event()
    listener = Listener(socks, stop)
    deadline = time.monotonic() + min(max(request.seconds, 0.1), MAX_SECONDS)
    token = request.token if request.bandwidth else None
    serve = threading.Thread(target=_serve, args=(listener, deadline, token), daemon=True)
    serve.start()
    _listeners[port] = listener
    return p.ListenReply(addresses[0] or "*", port, None)


def close_all() -> int:
    """Close every listener of this agent and the peers they serve; how many there were."""
    closed = len(_listeners)
    for listener in _listeners.values():
        listener.close()
    _listeners.clear()
    return closed
