"""The Python API (``meshkit.Cluster``) on the sandbox: mesh, train, status, logs, stop and
doctor from a script, returning the records the CLI renders and printing nothing."""

from __future__ import annotations

import re
import shutil
import time
from pathlib import Path

import pytest

from meshkit import Cluster
from meshkit.errors import JobError, UsageError

SANDBOX_NODES = 3
REPO = Path(__file__).resolve().parent.parent


def test_a_script_meshes_trains_watches_and_stops_a_job(cluster, capsys):
    api = Cluster(str(cluster.hostfile), session="api", workdir=str(cluster.shared / "api"))
    report = api.mesh(verify=False)
    assert report.ok
    assert len(report.nodes) == SANDBOX_NODES

    workdir = cluster.shared / "api"
    workdir.mkdir()
    shutil.copy(REPO / "meshkit" / "templates" / "example_train.py", workdir)
    started = api.train("torchrun example_train.py", nproc_per_node=1)
    assert started.ok
    assert started.launch is not None
    assert [row.state for row in started.launch.rows] in (["running"] * 3, ["exited"] * 3) or all(
        row.ok for row in started.launch.rows
    )
    deadline = time.monotonic() + 180
    while True:
        rows = api.status().rows
        if all(row.state == "exited" for row in rows) or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert [(row.node_rank, row.state, row.exit_code) for row in rows] == [
        (i, "exited", 0) for i in range(SANDBOX_NODES)
    ]
    chunks = api.logs(lines=50)
    assert [chunk.rank for chunk in chunks] == list(range(SANDBOX_NODES))
    assert all(any("ok=True" in line for line in chunk.lines) for chunk in chunks)
    stopped = api.stop()
    assert stopped.ok
    assert all(row.left == [] for row in stopped.rows)

    report = api.doctor(quick=True)
    assert report.ok, [check for check in report.checks if not check.ok]
    # every pair measured, both ways (rates on a shared 2-core machine are not asserted here)
    measured = api.doctor(bandwidth=True).checks
    pairs = {(check.node, check.peer) for check in measured if check.check == "bandwidth"}
    assert len(pairs) == SANDBOX_NODES * (SANDBOX_NODES - 1) // 2, measured
    assert capsys.readouterr().out == ""  # the API prints nothing


def test_bad_input_raises_the_clis_errors(cluster):
    with pytest.raises(JobError, match="no saved job 'nosuch'"):
        Cluster(str(cluster.hostfile), session="nosuch").status()
    with pytest.raises(UsageError, match="session name"):
        Cluster(str(cluster.hostfile), session="a.b").status()
    with pytest.raises(UsageError, match="nproc-per-node"):
        Cluster(str(cluster.hostfile), session="api2").train("true", nproc_per_node="²")
    with pytest.raises(UsageError, match="min_ratio"):
        Cluster(str(cluster.hostfile)).doctor(bandwidth=True, min_ratio=2)


def test_the_range_checks_are_the_clis_and_come_before_any_node(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    api = Cluster(str(tmp_path / "no-hostfile"))
    wait = "--wait 90000: expected seconds between 0 and 86400"
    with pytest.raises(UsageError, match=re.escape(wait)):
        api.train("true", wait=90000)
    restarts = "--restarts '1001': expected a whole number 0..1000"
    with pytest.raises(UsageError, match=re.escape(restarts)):
        api.train("true", restarts=1001)
