"""Shared fixtures. Sandbox tests run against real sshd nodes in network namespaces (root only);
without root they skip, and .ci/run fails a CI run in which they skipped.

Each test module gets its own named sandbox (bridge, namespaces, subnet, directory), so modules run
in parallel under pytest-xdist (``--dist loadfile``) without touching each other's nodes. The
longest modules run first (``SECONDS``), so that no long one starts last."""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from meshkit import sandbox
from meshkit.errors import SandboxError
from meshkit.sandbox import slurm as private_slurm

MESHKIT = [sys.executable, "-m", "meshkit"]


# Seconds each long module took, run alone on a shared 2-core machine under load (--durations;
# their sizes against each other are what counts). Modules run longest first: under xdist's
# --dist loadfile (.ci/run) a worker takes the next module when it is nearly done, and a long
# module started last leaves the other worker idle meanwhile. A module not listed counts as
# UNLISTED if it brings up a sandbox (the ``cluster`` fixture), else as 0.
SECONDS = {
    "test_diagnose": 510,
    "test_supervised": 490,
    "test_train": 370,
    "test_network_train": 300,
    "test_mesh": 300,
    "test_bandwidth": 190,
    "test_openmpi": 160,
    "test_jobctl": 160,
    "test_doctor": 130,
    "test_sync": 120,
    "test_slurm": 85,
    "test_fastcli": 60,
    # this round's sandbox modules, from their authors' runs under load
    "test_nonroot": 185,
    "test_sync_scale": 140,
    "test_stop_partition": 140,
    "test_top": 70,
    "test_exec": 16,
    "test_untrusted_replies": 60,
    "test_terminal_safety": 20,  # its author's run alone: 17 s
    # the spare scenarios: a module each, split for the workers (each takes minutes)
    "test_spares_shrink": 330,
    "test_spares_master": 290,
    "test_spares": 240,
    "test_spares_giveup": 190,
    "test_spares_no_restarts": 240,  # test_spares's scenario with --restarts 0: CI 193 s and 197 s
    # issue 43's membership proofs, from their author's runs alone: 62 s and 133 s
    "test_launches": 160,
    "test_partition_membership": 80,
    # issue 44's history: train, stop, node 0 off, events from node 2
    "test_events_history": 25,  # its author's run alone: 16 s
    "test_faults": 40,  # issue 44's sandbox faults, from their author's run
    # issue 44's broken nodes, in CI: 97+72+52+30 s and 128+74 s
    "test_broken_nodes": 260,
    "test_health_eviction": 210,
    # issue 45's slow sandbox node (sandbox.slow), its author's run under load: 25 s
    "test_slow": 40,
    "test_stragglers": 300,
    # issue 45: the example's steps under torchrun and --spawn, and a job without them
    "test_progress": 190,  # its author's run alone: 185 s
}
UNLISTED = 60


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "sandbox: needs root; runs against a real local cluster")
    # xdist would otherwise run the modules with the most tests first (unit-test modules, the
    # quick ones), whatever the order below
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The longest modules' tests first; a module's tests keep their order (a stable sort)."""
    expected: dict[Path, int] = {}
    for item in items:
        guess = SECONDS.get(item.path.stem)
        if guess is None:
            guess = UNLISTED if "cluster" in getattr(item, "fixturenames", ()) else 0
        expected[item.path] = max(expected.get(item.path, 0), guess)
    items.sort(key=lambda item: -expected[item.path])


# One letter that starts every test sandbox's name: two checkouts (git worktrees) running the suite
# at once on one machine set different ones, so their sandboxes never share a name.
PREFIX = os.environ.get("MESHKIT_TEST_PREFIX", "t")
if not re.fullmatch(r"[a-z]", PREFIX):
    raise SystemExit(f"MESHKIT_TEST_PREFIX={PREFIX!r}: one lowercase letter")


def named(base: str) -> str:
    """A test's own sandbox name: the prefix, then ``base`` (at most 8 characters in all)."""
    return (PREFIX + base)[:8]


def sandbox_name(module: str) -> str:
    """``tests/test_mesh.py`` -> ``tmesh``: a valid sandbox name per test module. A stem too
    long for the 8 characters ends in 2 hex digits of its whole (``test_untrusted`` and
    ``test_untrusted_replies`` ran in parallel as one sandbox, each taking the other down)."""
    stem = module.rsplit(".", 1)[-1].removeprefix("test_")
    base = re.sub(r"[^a-z0-9]", "", stem.lower())
    if len(PREFIX + base) <= 8:
        return named(base)
    digest = hashlib.sha256(base.encode()).hexdigest()[:2]
    return named(base[: 8 - len(PREFIX) - 2] + digest)


def sandbox_dir(name: str) -> str:
    return f"/var/tmp/meshkit-test-{name}"


def need_root() -> None:
    if os.geteuid() != 0:
        pytest.skip("sandbox tests need root (network namespaces, sshd)")


@contextmanager
def fresh_sandbox(
    name: str,
    nodes: int,
    user: bool = False,
    slurm: bool = False,
    networks: sandbox.NetworkOptions | None = None,
) -> Iterator[sandbox.Layout]:
    """A sandbox of its own, taken down after; ``slurm``: with the private SLURM (skipped where
    its Debian packages are missing, which .ci/run fails under CI: it installs them)."""
    need_root()
    if slurm:
        try:
            private_slurm.preflight()
        except SandboxError as exc:
            pytest.skip(f"sandbox SLURM: {exc}")
    subnet = sandbox.default_subnet("", name)
    lay = sandbox.up(
        sandbox_dir(name), subnet, nodes, name, networks=networks, slurm=slurm, user=user
    )
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
