"""Shared fixtures. Sandbox tests run against real sshd nodes in network namespaces (root only);
without root they skip, and .ci/run fails a CI run in which they skipped."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from meshkit import sandbox

SANDBOX_DIR = "/var/tmp/meshkit-test-sandbox"
SUBNET = "10.77.0.0/24"
MESHKIT = [sys.executable, "-m", "meshkit"]


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "sandbox: needs root; runs against a real local cluster")


@pytest.fixture(scope="module")
def cluster(request: pytest.FixtureRequest) -> Iterator[sandbox.Layout]:
    """A fresh sandbox per test module (bringing one up takes well under a second)."""
    if os.geteuid() != 0:
        pytest.skip("sandbox tests need root (network namespaces, sshd)")
    lay = sandbox.up(SANDBOX_DIR, SUBNET, getattr(request.module, "SANDBOX_NODES", 4))
    yield lay
    sandbox.down(SANDBOX_DIR)


def ssh(
    lay: sandbox.Layout, node: str, command: str, timeout: float = 30
) -> subprocess.CompletedProcess[str]:
    """Plain OpenSSH from the controller with the sandbox's bootstrap key and known_hosts."""
    return subprocess.run(
        ["ssh", "-F", str(lay.ssh_config), "-o", "BatchMode=yes", node, command],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def meshkit(
    *args: str,
    cwd: str | Path | None = None,
    timeout: float = 180,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*MESHKIT, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
        env={**os.environ, **(env or {})},
        check=False,
    )
