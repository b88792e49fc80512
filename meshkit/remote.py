"""SSH to the nodes: one connection per node (fabric over paramiko), opened in parallel and reused
for every phase; strict host keys; a timeout on every call; per-host outcomes, never one exception
that hides the rest; atomic SFTP writes (temp file + rename, explicit modes)."""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import os
import shlex
import socket
import stat
import sys
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, TextIO, TypeVar

import paramiko
from fabric import Config as FabricConfig
from fabric import Connection
from invoke.exceptions import CommandTimedOut

from .errors import MeshkitError
from .hostfile import Host

K = TypeVar("K")
T = TypeVar("T")


class RemoteError(MeshkitError):
    """A node cannot be reached or used; the message names the node and what to do."""


class UnknownHostKey(paramiko.SSHException):
    def __init__(self, hostname: str, kind: str, fingerprint: str) -> None:
        self.hostname, self.kind, self.fingerprint = hostname, kind, fingerprint
        super().__init__(f"unknown host key for {hostname}")


def fingerprint(key: paramiko.PKey) -> str:
    return "SHA256:" + base64.b64encode(hashlib.sha256(key.asbytes()).digest()).decode().rstrip("=")


class StrictPolicy(paramiko.MissingHostKeyPolicy):
    """Refuse unknown host keys (naming the fingerprint), or with ``accept_new`` trust them on first
    use and record them, as OpenSSH's StrictHostKeyChecking=accept-new does. A *changed* key is
    refused by paramiko itself (BadHostKeyException), always."""

    _lock = threading.Lock()

    def __init__(self, accept_new: bool, store: Path) -> None:
        self.accept_new, self.store = accept_new, store

    def missing_host_key(
        self, client: paramiko.SSHClient, hostname: str, key: paramiko.PKey
    ) -> None:
        if not self.accept_new:
            raise UnknownHostKey(hostname, key.get_name(), fingerprint(key))
        client.get_host_keys().add(hostname, key.get_name(), key)
        with self._lock:
            self.store.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            fd = os.open(self.store, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            with os.fdopen(fd, "a") as out:
                out.write(f"{hostname} {key.get_name()} {key.get_base64()}\n")


@dataclass(frozen=True)
class Settings:
    connect_timeout: float = 10.0
    command_timeout: float = 120.0
    identity: str | None = None
    password: str | None = None
    accept_new: bool = False
    ssh_configs: tuple[str, ...] = ()
    user: str | None = None
    port: int | None = None
    parallel: int = 32
    known_hosts_store: Path = field(default_factory=lambda: Path("~/.ssh/known_hosts").expanduser())


@dataclass(frozen=True)
class Outcome(Generic[T]):
    value: T | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


def succeeded(results: dict[K, Outcome[T]]) -> dict[K, T]:
    """The items whose call returned, with their values."""
    return {k: o.value for k, o in results.items() if o.error is None}  # type: ignore[misc]


def failed(results: dict[K, Outcome[T]]) -> dict[K, str]:
    """The items whose call failed, with the readable reason."""
    return {k: o.error for k, o in results.items() if o.error is not None}


class Progress:
    """``phase  done/total`` on stderr: redrawn in place on a terminal, one line when done."""

    def __init__(self, phase: str, total: int, stream: TextIO | None = None) -> None:
        self.phase, self.total, self.done = phase, total, 0
        self.stream = stream or sys.stderr
        self.started = time.monotonic()
        self._lock = threading.Lock()

    def tick(self) -> None:
        with self._lock:
            self.done += 1
            if self.stream.isatty():
                self.stream.write(f"\r  {self.phase:<9} {self.done}/{self.total}")
                self.stream.flush()

    def finish(self, failed: int = 0) -> None:
        tail = f", {failed} failed" if failed else ""
        lead = "\r" if self.stream.isatty() else ""
        self.stream.write(
            f"{lead}  {self.phase:<9} {self.done}/{self.total}{tail}  ({time.monotonic() - self.started:.2f}s)\n"
        )
        self.stream.flush()


def describe(exc: BaseException, host: Host, settings: Settings) -> str:
    """One line: what went wrong with this node and how to fix it."""
    port = host.port or settings.port or 22
    if isinstance(exc, UnknownHostKey):
        return (
            f"unknown host key {exc.kind} {exc.fingerprint}; verify it (ssh-keygen -lf on the node), "
            "then rerun with --accept-new-host-keys"
        )
    if isinstance(exc, paramiko.BadHostKeyException):
        return (
            f"HOST KEY CHANGED: expected {fingerprint(exc.expected_key)}, got {fingerprint(exc.key)}; "
            f"refused. If the node was reinstalled, remove the old key: ssh-keygen -R {host.known_hosts_name()}"
        )
    if isinstance(exc, paramiko.AuthenticationException):
        return "authentication failed: pass --identity KEY (a key the node accepts) or --password"
    if isinstance(exc, (socket.timeout, TimeoutError)):
        return f"no answer within {settings.connect_timeout:.0f}s on port {port}: is the node up and reachable?"
    if isinstance(exc, CommandTimedOut):
        return f"a remote command took longer than {exc.timeout}s; the node may be overloaded"
    if isinstance(exc, (paramiko.ssh_exception.NoValidConnectionsError, ConnectionRefusedError)):
        return f"connection refused on port {port}: is sshd running?"
    if isinstance(exc, socket.gaierror):
        return f"cannot resolve {host.host}: check the name or use an address"
    if isinstance(exc, MeshkitError):
        return str(exc)
    if isinstance(exc, (paramiko.SSHException, OSError, EOFError)):
        return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    # Still one host's result: a surprise on one node must not hide what happened on the others.
    return f"unexpected {type(exc).__name__}: {exc}"


def fan_out(
    fn: Callable[[K], T],
    items: Sequence[K],
    settings: Settings,
    host_of: Callable[[K], Host],
    progress: Progress | None = None,
) -> dict[K, Outcome[T]]:
    """``fn`` on every item at once (bounded pool); each item's result or readable error."""

    def one(item: K) -> Outcome[T]:
        try:
            return Outcome(fn(item))
        except Exception as exc:
            return Outcome(error=describe(exc, host_of(item), settings))
        finally:
            if progress:
                progress.tick()

    if not items:
        return {}
    with ThreadPoolExecutor(max_workers=max(1, min(settings.parallel, len(items)))) as pool:
        results = dict(zip(items, pool.map(one, items)))
    if progress:
        progress.finish(sum(not r.ok for r in results.values()))
    return results


def ssh_config(paths: Sequence[str]) -> paramiko.SSHConfig:
    """~/.ssh/config plus extra files, parsed like OpenSSH (first value found wins)."""
    config = paramiko.SSHConfig()
    for path in [str(Path("~/.ssh/config").expanduser()), *paths]:
        if Path(path).is_file():
            with open(path) as handle:
                config.parse(handle)
    return config


class Remote:
    """One node's single SSH connection, with the operations the phases need."""

    def __init__(self, host: Host, settings: Settings, config: paramiko.SSHConfig) -> None:
        self.host, self.settings = host, settings
        kwargs: dict[str, Any] = {
            "banner_timeout": settings.connect_timeout,
            "auth_timeout": settings.connect_timeout,
            "channel_timeout": settings.command_timeout,
        }
        if settings.identity:
            kwargs["key_filename"] = [str(Path(settings.identity).expanduser())]
        if settings.password is not None:
            kwargs["password"] = settings.password
        self.conn = Connection(
            host.host,
            user=host.user or settings.user,
            port=host.port or settings.port,
            config=FabricConfig(ssh_config=config),
            connect_timeout=settings.connect_timeout,
            connect_kwargs=kwargs,
        )
        # An IdentityFile that does not exist here (e.g. a controller's key named in a shared
        # ssh_config, seen from a node) is skipped, as OpenSSH does.
        listed = self.conn.connect_kwargs.get("key_filename") or []
        self.conn.connect_kwargs["key_filename"] = [
            k for k in listed if Path(k).expanduser().is_file()
        ]
        client = self.conn.client
        client.set_missing_host_key_policy(
            StrictPolicy(settings.accept_new, settings.known_hosts_store)
        )
        for path in self._known_hosts_files():
            client.get_host_keys().load(path)
        self._sftp: paramiko.SFTPClient | None = None

    def _known_hosts_files(self) -> list[str]:
        listed = str(self.conn.ssh_config.get("userknownhostsfile", "~/.ssh/known_hosts")).split()
        candidates = ["/etc/ssh/ssh_known_hosts", "~/.ssh/known_hosts", *listed]
        return [
            p
            for p in dict.fromkeys(str(Path(c).expanduser()) for c in candidates)
            if Path(p).is_file()
        ]

    def open(self) -> Remote:
        self.conn.open()
        return self

    @property
    def server_key(self) -> tuple[str, str]:
        key = self.conn.transport.get_remote_server_key()
        return key.get_name(), key.get_base64()

    def run(
        self, command: str, timeout: float | None = None, out: TextIO | None = None
    ) -> tuple[int, str, str]:
        """A command line (built with shlex.join by the caller); its exit code, stdout and stderr.
        With ``out``, both streams are written there as they arrive instead (and no timeout
        applies unless given: for --follow)."""
        result = self.conn.run(
            command,
            hide=out is None,
            warn=True,
            in_stream=False,
            pty=False,
            timeout=timeout or (None if out else self.settings.command_timeout),
            **({"out_stream": out, "err_stream": out} if out else {}),
        )
        return result.exited, result.stdout, result.stderr

    @property
    def sftp(self) -> paramiko.SFTPClient:
        if self._sftp is None:
            self._sftp = self.conn.sftp()
            channel = self._sftp.get_channel()
            if channel is not None:
                channel.settimeout(self.settings.command_timeout)
        return self._sftp

    def read_text(self, path: str) -> str | None:
        """A file's text, or None when it does not exist (paths are relative to the login home)."""
        try:
            with self.sftp.open(path, "r") as handle:
                return handle.read().decode()
        except FileNotFoundError:
            return None

    def exists(self, path: str) -> bool:
        try:
            self.sftp.stat(path)
            return True
        except FileNotFoundError:
            return False

    def listdir(self, path: str) -> list[str]:
        return list(self.sftp.listdir(path))

    def ensure_dir(self, path: str, mode: int = 0o700) -> None:
        try:
            self.sftp.mkdir(path, mode)
        except OSError:
            if not self._is_dir(path):
                raise
        self.sftp.chmod(path, mode)

    def _is_dir(self, path: str) -> bool:
        try:
            return stat.S_ISDIR(self.sftp.stat(path).st_mode or 0)
        except OSError:
            return False

    def write_atomic(self, path: str, text: str, mode: int = 0o600) -> None:
        """Write a temp file beside ``path`` (mode set before any data), then rename over it."""
        head, _, name = path.rpartition("/")
        tmp = (
            f"{head}/.{name}.meshkit-{uuid.uuid4().hex[:12]}"
            if head
            else f".{name}.meshkit-{uuid.uuid4().hex[:12]}"
        )
        try:
            with self.sftp.open(tmp, "w") as handle:
                self.sftp.chmod(tmp, mode)
                handle.write(text.encode())
            self.sftp.posix_rename(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                self.sftp.remove(tmp)
            raise

    def remove(self, path: str) -> bool:
        try:
            self.sftp.remove(path)
            return True
        except FileNotFoundError:
            return False

    def close(self) -> None:
        if self._sftp is not None:
            self._sftp.close()
        self.conn.close()


class Agent:
    """A node-side ``meshkit.node serve`` over one exec channel: several requests, one shell start.
    Requests and replies are JSON lines on the channel's stdin/stdout."""

    def __init__(self, remote: Remote, python: str) -> None:
        self.remote = remote
        transport = remote.conn.client.get_transport()
        self.channel = transport.open_session(timeout=remote.settings.connect_timeout)
        self.channel.settimeout(remote.settings.command_timeout)
        self.channel.exec_command(shlex.join([python, "-m", "meshkit.node", "serve"]))
        self._out = self.channel.makefile("r")
        self._in = self.channel.makefile_stdin("w")

    def call(self, op: str, **args: Any) -> Any:
        """One request's result; RemoteError when the node says it failed or the agent is gone."""
        try:
            self._in.write(json.dumps({"op": op, "args": args}) + "\n")
            self._in.flush()
            line = self._out.readline()
        except (socket.timeout, TimeoutError):
            raise RemoteError(
                f"the node agent did not answer {op!r} within "
                f"{self.remote.settings.command_timeout:.0f}s"
            ) from None
        if not line:
            err = self.channel.makefile_stderr("r").read().strip()
            raise AgentGone(
                self.channel.recv_exit_status(), err.decode() if isinstance(err, bytes) else err
            )
        reply = json.loads(line)
        if not reply["ok"]:
            raise RemoteError(f"{op} failed on the node: {reply['error']}")
        return reply["result"]

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.channel.shutdown_write()
            self.channel.close()


class AgentGone(RemoteError):
    """The node agent exited (e.g. its interpreter is missing): its exit code and stderr."""

    def __init__(self, code: int, err: str) -> None:
        self.code, self.err = code, err
        super().__init__(err.splitlines()[-1] if err.strip() else f"node agent exited {code}")


class Cluster:
    """Connections to the reachable nodes, and why the others failed; closes everything on exit."""

    def __init__(
        self, hosts: Sequence[Host], settings: Settings, extra_ssh_configs: Sequence[str] = ()
    ) -> None:
        self.hosts, self.settings = list(hosts), settings
        self._config = ssh_config([*settings.ssh_configs, *extra_ssh_configs])
        self.remotes: dict[Host, Remote] = {}
        self.failures: dict[Host, str] = {}
        self._open(self.hosts, "connect")

    def _open(self, hosts: Sequence[Host], phase: str) -> None:
        opened = fan_out(
            lambda h: Remote(h, self.settings, self._config).open(),
            hosts,
            self.settings,
            lambda h: h,
            Progress(phase, len(hosts)),
        )
        self.remotes.update(succeeded(opened))
        self.failures = {
            h: e for h, e in {**self.failures, **failed(opened)}.items() if h not in self.remotes
        }

    def wait_for(self, seconds: float, interval: float = 1.0) -> None:
        """Retry the nodes that failed to connect (rebooting, say) until they answer or time runs out."""
        deadline = time.monotonic() + seconds
        while self.failures and time.monotonic() < deadline:
            time.sleep(min(interval, max(0.0, deadline - time.monotonic())))
            self._open(list(self.failures), "reconnect")

    def each(
        self,
        phase: str,
        fn: Callable[[Remote], T],
        hosts: Sequence[Host] | None = None,
        quiet: bool = False,
    ) -> dict[Host, Outcome[T]]:
        """``fn`` over the open connection of every (or the given) reachable node, in parallel."""
        chosen = [h for h in (hosts if hosts is not None else self.hosts) if h in self.remotes]
        progress = None if quiet else Progress(phase, len(chosen))
        return fan_out(lambda h: fn(self.remotes[h]), chosen, self.settings, lambda h: h, progress)

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        for remote in self.remotes.values():
            with contextlib.suppress(Exception):
                remote.close()
