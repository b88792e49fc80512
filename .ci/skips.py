"""pytest plugin for .ci/run: writes the id of every skipped test (one per line) to the file named
by MESHKIT_CI_SKIPS, so CI can fail on any skip not allowed by name in .ci/allowed-skips.

Loaded with ``-p skips`` (``.ci`` on PYTHONPATH). Under pytest-xdist the workers' reports reach
the controller, which alone writes the file."""

from __future__ import annotations

import os

import pytest

_skipped: list[str] = []


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.skipped and not hasattr(report, "wasxfail") and report.nodeid not in _skipped:
        _skipped.append(report.nodeid)


def pytest_sessionfinish(session: pytest.Session) -> None:
    out = os.environ.get("MESHKIT_CI_SKIPS")
    if out and not hasattr(session.config, "workerinput"):
        with open(out, "w") as handle:
            handle.writelines(f"{nodeid}\n" for nodeid in _skipped)
