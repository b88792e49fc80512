"""The client of the node agent (``python -m meshkit.node serve``): typed requests over one exec
channel per node, each reply read with a bound on its size and on the time it takes."""

from __future__ import annotations

import base64
import contextlib
import shlex
import socket
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TypeVar

import paramiko

from .. import protocol
from ..errors import AgentGone, MeshkitError, NodeFailed, ProtocolError, RemoteError
from ..hostfile import Host
from ..outcome import Outcome, ProgressFn
from ..protocol import MAX_LINE, PUT_CHUNK, PutReply, PutRequest, Reply, Request
from .connection import Remote, Settings
from .describe import describe
from .group import SshGroup

R = TypeVar("R", bound=Reply)
T = TypeVar("T")

GONE_WAIT = 5.0  # seconds for a gone agent's stderr and exit status


class Agent:
    """One node agent; ``call`` sends a request and returns its typed reply."""

    def __init__(self, remote: Remote, python: str) -> None:
        self.remote = remote
        self.python = python
        self.broken: BaseException | None = None
        transport = remote.conn.client.get_transport()
        if transport is None:
            raise RemoteError("the connection is closed")
        settings = remote.settings
        self.channel: paramiko.Channel = transport.open_session(timeout=settings.connect_timeout)
        self.channel.settimeout(settings.command_timeout)
        self.channel.exec_command(shlex.join([python, "-m", "meshkit.node", "serve"]))
        self._unread = b""  # what the agent sent past the last reply line read

    def call(self, request: Request, expect: type[R], timeout: float | None = None) -> R:
        """The reply to ``request`` (``RemoteError`` if the node says it failed, the agent is
        gone, or no reply came within ``timeout``, default the command timeout). After the agent
        is gone, or its stream can no longer be trusted (a timeout, a malformed reply), every
        later call raises that same first reason: it is the node's outcome, not "socket closed"."""
        if self.broken is not None:
            raise self.broken
        try:
            return self._call(request, expect, timeout)
        except (AgentGone, ProtocolError, OSError, EOFError) as exc:
            self.broken = exc
            raise
        except RemoteError as exc:
            if not isinstance(exc, (NodeFailed, _NotSent)):
                self.broken = exc  # a timeout: a late reply would answer the next request
            raise

    def _call(self, request: Request, expect: type[R], timeout: float | None) -> R:
        op = type(request).__name__
        limit = timeout or self.remote.settings.command_timeout
        deadline = time.monotonic() + limit
        self.channel.settimeout(limit)
        try:
            line = protocol.encode_request(request)
        except protocol.ProtocolViolation as exc:  # too long, say: the caller's to handle
            raise _NotSent(f"{op} was not sent to the node agent: {exc}") from None
        raw = b""
        try:
            # sendall, not a buffered stdin file: paramiko's file objects flush again when they
            # are garbage-collected and print a traceback if the agent is already gone.
            self.channel.sendall(line.encode())
            raw = self._read_line(deadline)
        except (socket.timeout, TimeoutError):
            raise RemoteError(f"the node agent did not answer {op} within {limit:.0f}s") from None
        except OSError:
            # Started as its node connected, an agent that could not run (no interpreter
            # there, say) may be gone before the first request: say why it ended, below.
            if not self.channel.exit_status_ready():
                raise
        if not raw:
            # its last words and exit status come right after its stdout closed: a few seconds
            # of their own, so that an agent gone at the call's deadline still says why
            gone = time.monotonic() + GONE_WAIT
            err = self._read_stderr(gone).decode(errors="replace")
            raise AgentGone(self._exit_status(gone), self._explain(err))
        return read_reply(request, raw, expect)

    def _read_line(self, deadline: float) -> bytes:
        """The agent's next line, newline included, read by ``deadline`` (``time.monotonic``)
        in all: a channel's timeout bounds each wait alone, so a node that sent a byte now and
        then would hold the call for as long as it liked. At most ``MAX_LINE`` + 1 bytes are
        kept: a longer line comes back cut, without its newline (``read_reply`` refuses it);
        the end of the stream returns what came before it (nothing: the agent is gone)."""
        pending = bytearray(self._unread)
        end = pending.find(b"\n")
        while end < 0 and len(pending) <= MAX_LINE:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError
            self.channel.settimeout(left)
            chunk = self.channel.recv(65536)
            if not chunk:
                break
            searched = len(pending)
            pending += chunk
            end = pending.find(b"\n", searched)
        if end < 0:
            self._unread = b""
            return bytes(pending[: MAX_LINE + 1])
        self._unread = bytes(pending[end + 1 :])
        return bytes(pending[: end + 1])

    def _read_stderr(self, deadline: float) -> bytes:
        """What the gone agent wrote on stderr: at most 64 KiB, by ``deadline``."""
        err = b""
        while len(err) < 65536:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            self.channel.settimeout(left)
            try:
                chunk = self.channel.recv_stderr(65536 - len(err))
            except (socket.timeout, TimeoutError):
                break
            if not chunk:
                break
            err += chunk
        return err

    def _exit_status(self, deadline: float) -> int:
        """The gone agent's exit status, or -1 when none came by ``deadline``."""
        left = max(0.0, deadline - time.monotonic())
        if not self.channel.status_event.wait(left):
            return -1
        return self.channel.recv_exit_status()

    def _explain(self, err: str) -> str:
        """Why the agent is gone, as the fix: mostly a missing interpreter or meshkit."""
        if "No module named meshkit" in err or "No module named 'meshkit" in err:
            return f"meshkit is not installed for {self.python} on the node; install it there"
        if self.python in err and ("No such file" in err or "not found" in err):
            return (
                f"interpreter {self.python} not found on the node; install meshkit at the same "
                "path there or set meshkit.python"
            )
        return err

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.channel.shutdown_write()
            self.channel.close()


def read_reply(request: Request, raw: bytes, expect: type[R]) -> R:
    """The node agent's reply line to ``request``, checked: anything malformed in it (a field
    of the wrong type, a number JSON does not allow, a time no clock shows) is the node's
    ``ProtocolError``; the node's own failure is a ``RemoteError``, the agent still usable."""
    op = type(request).__name__
    if not raw.endswith(b"\n"):
        raise ProtocolError(f"the node agent's reply to {op} exceeds {MAX_LINE} bytes")
    try:
        reply = protocol.decode_reply(protocol.op_of(request), raw.decode(errors="replace"))
    except protocol.NodeFailure as exc:
        raise NodeFailed(f"{op} failed on the node: {exc}") from None
    except protocol.ProtocolViolation as exc:
        raise ProtocolError(f"malformed reply to {op} from the node agent: {exc}") from None
    if not isinstance(reply, expect):
        raise ProtocolError(f"the node agent answered {op} with {type(reply).__name__}")
    return reply


class AgentPool:
    """One node agent per reachable node, opened on first use (or already started by ``start`` as
    the node connected) and reused by every later call of the same command; what the ops layer
    talks to (a test double replaces it). Its SSH connections (``each``) serve the ops that run a
    command over SSH itself (mesh's N x N ``verify``)."""

    def __init__(self, group: SshGroup, python: str) -> None:
        self.group = group
        self.python = python
        self._agents: dict[Host, Agent] = {}

    @classmethod
    @contextlib.contextmanager
    def connect(
        cls,
        hosts: Sequence[Host],
        settings: Settings,
        python: str,
        progress: ProgressFn | None = None,
        wait: float = 0.0,
    ) -> Iterator[AgentPool]:
        """Connect to every node and start its agent as soon as that node's connection is up:
        the agent's interpreter then starts on the nodes already connected while the CLI is
        still connecting to the others, instead of in a phase of its own after every connect.
        ``wait``: seconds to keep retrying unreachable nodes."""
        started: dict[Host, Agent] = {}

        def start(remote: Remote) -> None:
            # A start that fails is tried again by the node's first call, which reports why.
            with contextlib.suppress(Exception):
                started[remote.host] = Agent(remote, python)

        with SshGroup(hosts, settings, progress=progress, on_open=start) as group:
            if wait:
                group.wait_for(wait)
            pool = cls(group, python)
            pool._agents.update(started)
            try:
                yield pool
            finally:
                for agent in pool._agents.values():
                    agent.close()

    @property
    def failures(self) -> dict[Host, str]:
        """Nodes that could not be connected to, with why."""
        return dict(self.group.failures)

    @property
    def settings(self) -> Settings:
        """The SSH settings every connection was opened with."""
        return self.group.settings

    def each(
        self,
        phase: str,
        fn: Callable[[Remote], T],
        hosts: Sequence[Host] | None = None,
        quiet: bool = False,
    ) -> dict[Host, Outcome[T]]:
        """``fn`` over the open SSH connection of every (or the given) reachable node, in
        parallel (``SshGroup.each``)."""
        return self.group.each(phase, fn, hosts, quiet)

    def call_all(
        self,
        phase: str,
        request_for: Callable[[Host], Request | None],
        expect: type[R],
        hosts: Sequence[Host] | None = None,
        timeout: float | None = None,
    ) -> dict[Host, Outcome[R]]:
        """``request_for(host)`` on every (or the given) reachable node at once; ``None`` skips."""

        def one(remote: Remote) -> R:
            request = request_for(remote.host)
            if request is None:
                raise _Skipped
            return self._agent(remote).call(request, expect, timeout)

        results = self.group.each(phase, one, hosts)
        answered = {}
        for host, outcome in results.items():
            if not isinstance(outcome.exc, _Skipped):
                answered[host] = outcome
        return answered

    def reconnect(self, host: Host) -> None:
        """Open ``host``'s connection and agent again, after the node went down (``top`` watching
        it come back); raises, with the node among ``failures``, while it is still down."""
        old = self._agents.pop(host, None)
        if old is not None:
            old.close()
        remote = self.group.reopen(host)
        self._agents[host] = Agent(remote, self.python)

    def write_file(
        self, host: Host, path: str, text: str, mode: int = 0o644, root: str = ""
    ) -> None:
        """Write a file on ``host`` through its agent (parents created, a temporary beside it,
        then renamed): no SFTP subsystem, which would start the user's shell once more. It
        goes in ``PUT_CHUNK`` pieces, so no line exceeds the protocol's limit whatever the
        size, and only one piece is encoded at a time."""
        remote = self.group.remotes.get(host)
        if remote is None:
            raise RemoteError(f"{host.label}: not connected: {self.failures.get(host, '?')}")
        try:
            self._put(remote, path, text.encode(), mode, root)
        except MeshkitError:
            raise
        except Exception as exc:  # the link or the agent failed: the node's outcome
            why = describe(exc, host, self.settings)
            raise RemoteError(f"{host.label}: writing {path}: {why}") from None

    def _put(self, remote: Remote, path: str, data: bytes, mode: int, root: str) -> None:
        agent = self._agent(remote)
        whole = memoryview(data)
        stamp = time.time()
        offset = 0
        while True:
            piece = whole[offset : offset + PUT_CHUNK]
            last = offset + len(piece) >= len(whole)
            encoded = base64.b64encode(piece).decode()
            agent.call(PutRequest(path, encoded, offset, last, mode, stamp, root), PutReply)
            if last:
                return
            offset += len(piece)

    def _agent(self, remote: Remote) -> Agent:
        agent = self._agents.get(remote.host)
        if agent is None:
            agent = Agent(remote, self.python)
            self._agents[remote.host] = agent
        return agent


class _NotSent(RemoteError):
    """The request could not be encoded (too long, say): nothing went out; the agent is
    fine."""


class _Skipped(Exception):
    """``request_for`` returned None for this node."""
