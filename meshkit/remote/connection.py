"""One node's single SSH connection (fabric over paramiko): strict host keys, a timeout on every
call, atomic SFTP writes (temp file + rename, explicit modes)."""

from __future__ import annotations

import base64
import contextlib
import hashlib
import os
import stat
import threading
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import paramiko
from fabric import Config as FabricConfig
from fabric import Connection

from ..hostfile import Host


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

    def makedirs(self, path: str, mode: int = 0o755) -> None:
        """``mkdir -p``: create the missing directories (existing ones keep their mode)."""
        missing = []
        current = path.rstrip("/") or "/"
        while current not in ("", "/") and not self._is_dir(current):
            missing.append(current)
            current = current.rsplit("/", 1)[0] or "/"
        for directory in reversed(missing):
            try:
                self.sftp.mkdir(directory, mode)
            except OSError:
                if not self._is_dir(directory):
                    raise

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
