"""The node shell: one exec channel per node running a small POSIX sh loop (``node_shell.sh``,
a package data file), through which mesh and unmesh do every file read, key, lock, write and
rename on that node.

Why one shell: every other channel (and SFTP, whose subsystem starts the user's shell too) would
start the user's login shell and its ~/.bashrc (conda or pyenv init, 0.1 s of CPU on many ML
nodes) again; this way they start once per node.

The protocol: the shell answers one request per line, in order; every answer is a status line
("=ok", "=none", "=denied", "=err ...", "=changed"), data lines (base64, or text lines each after
a "|"), and a line ".". Request data (paths, sizes) is read with ``read``, never evaluated; file
contents travel as counted bytes; each request line starts with this run's token, so a shell that
ever lost count of the bytes ends (releasing its lock) instead of reading data as requests. Text
files are read with shell builtins and most answers need no fork: the node's CPU goes to sshd and
the user's shell, as for any login.
"""

from __future__ import annotations

import base64
import contextlib
import shlex
import uuid
from dataclasses import dataclass
from importlib import resources

from ..errors import MeshkitError
from .connection import Remote

NODE_SHELL = resources.files("meshkit.remote").joinpath("node_shell.sh").read_text()
MAX_NOISE = 1 << 20  # what a chatty ~/.bashrc may print before the node shell starts
MAX_READ = 4 << 20  # a node's file meshkit reads (authorized_keys, known_hosts, /proc/...)
READY = b"=meshkit-ready"  # the shell's first line, after whatever the user's shell printed
END = b"."  # the line that ends every answer

EXIT_STATUS_WAIT = 1.0  # how long the shell's exit status may follow the end of its output
MAX_STDERR = 1 << 16  # of the shell's error output, what is read when it ended
NOT_FOUND = 127  # sh's exit status for a command it cannot find

Request = str | tuple[str, bytes]  # a request line, or a line and the bytes it announces


def shell_ended(connected: bool, status: int | None, stderr: str) -> str:
    """Why the node shell stopped answering, from what was seen: the connection closed (a reboot
    first: it ends every session), or the shell exited (``status``; None: it was killed by a
    signal), with its last line of error output. Missing tools are named only when that is what
    was seen: exit status 127, or the shell's last words saying "not found"."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    last_error = lines[-1][:200] if lines else ""
    if not connected:
        seen = "the connection to the node closed while its shell was answering"
    elif status is None:
        seen = "the node's shell ended without an exit status (killed by a signal)"
    else:
        seen = f"the node's shell exited with status {status}"
    if last_error:
        seen += f", saying {last_error!r}"
    # a tool the shell could not run ends it, over a connection that stays up; its complaint is
    # the last thing it says (a ~/.bashrc's own "not found" comes before)
    tool_missing = status == NOT_FOUND or "not found" in last_error.lower()
    if connected and tool_missing:
        likely = (
            "a tool it needs is missing: sh, head, base64, stat and flock are needed on the node"
        )
    else:
        likely = (
            "likely the node rebooting, or its sshd restarting, or the network or something on "
            "the node ending the session; try again once the node is back"
        )
    return f"{seen}: {likely}"


@dataclass(frozen=True)
class ShellReply:
    """One answer of the node shell: its status, the rest of the status line, the data."""

    status: str
    text: str
    body: bytes


class NodeShell:
    """One exec channel on a node's connection, running ``NODE_SHELL``. Requests are pipelined:
    ``ask`` sends them all, then reads every answer in order. Every wait is bounded by the
    Remote's phase deadline."""

    def __init__(self, remote: Remote, *first: Request) -> None:
        """Start the node shell and send it the ``first`` requests at once, without waiting
        (their replies are ``receive``'s): started as each connection opens, the shell's
        start-up and that first round overlap the other nodes' connects."""
        self.remote = remote
        self.channel = remote.conn.transport.open_session(timeout=remote.remaining())
        self._buffer = b""
        self._ready = False
        self.token = uuid.uuid4().hex
        self.channel.settimeout(remote.remaining())
        self.channel.exec_command(f"exec sh -c {shlex.quote(NODE_SHELL)} meshkit {self.token}")
        if first:
            self.send(*first)

    def _line(self) -> bytes:
        while b"\n" not in self._buffer:
            self.channel.settimeout(self.remote.remaining())
            chunk = self.channel.recv(1 << 16)
            if not chunk:
                raise MeshkitError(self._ended())
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        return line

    def _ended(self) -> str:
        """What was seen when the shell stopped answering: whether the connection is still up,
        the shell's exit status (waited for briefly: it follows the output), its last error
        output."""
        wait = 0.0
        with contextlib.suppress(TimeoutError):
            wait = min(EXIT_STATUS_WAIT, self.remote.remaining())
        self.channel.status_event.wait(wait)
        status = None
        if self.channel.exit_status != -1:  # paramiko's "none came" (a signal, or no exit)
            status = self.channel.exit_status
        stderr = b""
        with contextlib.suppress(Exception):
            while self.channel.recv_stderr_ready() and len(stderr) < MAX_STDERR:
                stderr += self.channel.recv_stderr(MAX_STDERR)
        transport = self.channel.get_transport()
        connected = transport is not None and transport.is_active()
        return shell_ended(connected, status, stderr.decode(errors="replace"))

    def send(self, *requests: Request) -> None:
        """Send each request (a line, or a line and the bytes it announces)."""
        out = b""
        for request in requests:
            if isinstance(request, str):
                line = request
                data = b""
            else:
                line, data = request
            if "\n" in line:
                raise ValueError(f"a request is one line: {line!r}")
            out += f"{self.token} {line}\n".encode() + data
        self.channel.settimeout(self.remote.remaining())
        try:
            self.channel.sendall(out)
        except OSError:
            if not self.channel.closed:
                raise  # a timeout: the phase's to report
            raise MeshkitError(self._ended()) from None

    def _skip_noise(self) -> None:
        """Read past what the user's shell printed before the node shell started."""
        seen = 0
        while not self._ready:
            line = self._line()
            if line == READY:
                self._ready = True
                return
            seen += len(line)
            if seen > MAX_NOISE:
                raise MeshkitError("the node's shell printed too much before starting")

    def receive(self, count: int) -> list[ShellReply]:
        """The replies to the next ``count`` requests sent, in order."""
        self._skip_noise()
        replies = []
        for _ in range(count):
            head = self._line().decode(errors="replace")
            if not head.startswith("="):
                raise MeshkitError(f"the node's shell answered {head[:80]!r}")
            status, _, text = head[1:].partition(" ")
            body = list(iter(self._line, END))  # up to the line "."
            text_lines = b"".join(line[1:] + b"\n" for line in body if line.startswith(b"|"))
            encoded = b"".join(line for line in body if not line.startswith(b"|"))
            replies.append(ShellReply(status, text, text_lines + base64.b64decode(encoded)))
        return replies

    def ask(self, *requests: Request) -> list[ShellReply]:
        """Send the requests, then read every reply in order (pipelined: one round trip)."""
        self.send(*requests)
        return self.receive(len(requests))

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.channel.shutdown_write()  # the node shell reads EOF, lets go of a lock, ends
            self.channel.close()
