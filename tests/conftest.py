"""Shared fixtures. Sandbox tests run against real sshd nodes in network namespaces (root only);
without root they skip, and .ci/run fails a CI run in which they skipped.

Each test module gets its own named sandbox (bridge, namespaces, subnet, directory), so modules run
in parallel under pytest-xdist (``--dist loadfile``) without touching each other's nodes."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from meshkit import sandbox

MESHKIT = [sys.executable, "-m", "meshkit"]


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "sandbox: needs root; runs against a real local cluster")


# One letter that starts every test sandbox's name: two checkouts (git worktrees) running the suite
# at once on one machine set different ones, so their sandboxes never share a name.
PREFIX = os.environ.get("MESHKIT_TEST_PREFIX", "t")
if not re.fullmatch(r"[a-z]", PREFIX):
    raise SystemExit(f"MESHKIT_TEST_PREFIX={PREFIX!r}: one lowercase letter")


def named(base: str) -> str:
    """A test's own sandbox name: the prefix, then ``base`` (at most 8 characters in all)."""
    return (PREFIX + base)[:8]


def sandbox_name(module: str) -> str:
    """``tests/test_mesh.py`` -> ``tmesh``: a valid sandbox name per test module."""
    stem = module.rsplit(".", 1)[-1].removeprefix("test_")
    return named(re.sub(r"[^a-z0-9]", "", stem.lower()))


def sandbox_dir(name: str) -> str:
    return f"/var/tmp/meshkit-test-{name}"


def need_root() -> None:
    if os.geteuid() != 0:
        pytest.skip("sandbox tests need root (network namespaces, sshd)")


@contextmanager
def fresh_sandbox(name: str, nodes: int, user: bool = False) -> Iterator[sandbox.Layout]:
    need_root()
    subnet = sandbox.default_subnet("", name)
    lay = sandbox.up(sandbox_dir(name), subnet, nodes, name, user=user)
    try:
        yield lay
    finally:
        sandbox.down(sandbox_dir(name), name)


@pytest.fixture(scope="module")
def cluster(request: pytest.FixtureRequest) -> Iterator[sandbox.Layout]:
    """A fresh sandbox per test module (bringing one up takes well under a second)."""
    name = sandbox_name(request.module.__name__)
    with fresh_sandbox(name, getattr(request.module, "SANDBOX_NODES", 4)) as lay:
        yield lay


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
