"""Issue 45 on the sandbox (3 real sshd nodes): the bundled example tells its steps
(``meshkit.progress``) under torchrun and under ``--spawn``, and ``status --json`` shows every
rank's step rising and, once the window (config ``straggler_window: 20s``) has filled, its rates;
``top --once --json`` shows the steps; a job that tells no steps (``sleep``) shows empty progress
and is shown as before. The pure parts are tests/test_progress_files.py and
tests/test_progress_display.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import meshkit
from helpers import sandbox_jobs
from helpers.sandbox_jobs import wait_for

SANDBOX_NODES = 3
# fixed work inside the compute section and a pause after each step: a few steps a second
EXAMPLE = "example_train.py --steps 1000000 --checkpoint-every 1000000 --step-seconds 0.2 --work 20"


@pytest.fixture(scope="module")
def meshed(cluster):
    """The sandbox meshed, the example in its workdir, and a short straggler window there."""
    out = meshkit("mesh", "--hostfile", str(cluster.hostfile), "--no-verify")
    assert out.returncode == 0, out.stdout + out.stderr
    workdir = sandbox_jobs.example_workdir(cluster)
    (workdir / "meshkit.yaml").write_text("straggler_window: 20s\n")
    return cluster, workdir


def status_json(lay, workdir: Path, session: str) -> list[dict]:
    out = meshkit("status", "--hostfile", str(lay.hostfile), "--session", session, "--json")
    assert out.returncode == 0, out.stdout + out.stderr
    return json.loads(out.stdout)


def steps(rows: list[dict]) -> dict[int, int]:
    """Each rank's step, over every node."""
    return {rank["rank"]: rank["step"] for row in rows for rank in row["progress"]}


@pytest.mark.parametrize("spawn", [False, True], ids=["torchrun", "spawn"])
def test_the_example_shows_its_steps_and_rates(meshed, spawn):
    lay, workdir = meshed
    session = "spawned" if spawn else "torchrun"
    nproc = 2 if spawn else 1
    launcher = "python" if spawn else "torchrun"
    flags = ["--hostfile", str(lay.hostfile), "--session", session]
    flags += ["--nproc-per-node", str(nproc)]
    if spawn:
        flags.append("--spawn")
    out = meshkit("train", *flags, "--cmd", f"{launcher} {EXAMPLE}", cwd=workdir)
    assert out.returncode == 0, out.stdout + out.stderr
    world = len(lay.nodes) * nproc
    try:

        def every_rank_steps() -> list[dict] | None:
            rows = status_json(lay, workdir, session)
            return rows if len(steps(rows)) == world else None

        first = steps(wait_for(every_rank_steps, timeout=120))
        assert sorted(first) == list(range(world))

        def rated() -> list[dict] | None:
            rows = status_json(lay, workdir, session)
            ranks = [rank for row in rows for rank in row["progress"]]
            if len(ranks) == world and all(rank["rate"] for rank in ranks):
                return rows
            return None

        rows = wait_for(rated, timeout=120)
        later = steps(rows)
        assert all(later[rank] > first[rank] for rank in first), (first, later)
        for row in rows:
            assert row["state"] == "running"
            assert [rank["rank"] for rank in row["progress"]] == [
                row["node_rank"] * nproc + local for local in range(nproc)
            ]
            for rank in row["progress"]:
                # at most about 5 steps a second (the pause), and a step written lately
                assert 0 < rank["rate"] < 6, rank
                assert rank["age"] < 10, rank
                assert rank["compute_s"] is not None and rank["compute_s"] > 0, rank
            assert row["straggler"] is None or set(row["straggler"]) >= {"ratio"}

        text = meshkit("status", "--hostfile", str(lay.hostfile), "--session", session)
        assert text.returncode == 0, text.stdout + text.stderr
        header = text.stdout.splitlines()[1].split()
        assert "step" in header, text.stdout
        assert "/s " in text.stdout

        top = meshkit(
            "top", "--hostfile", str(lay.hostfile), "--session", session, "--once", "--json"
        )
        assert top.stdout, top.stderr
        nodes = json.loads(top.stdout)["nodes"]
        told = [rank for node in nodes for rank in node["ranks"] if rank["step"] is not None]
        assert len(told) == world, nodes
        assert all(rank["step"] > 0 and rank["age"] is not None for rank in told)
    finally:
        meshkit("stop", "--hostfile", str(lay.hostfile), "--session", session, cwd=workdir)


def test_a_job_that_tells_no_steps_is_shown_as_before(meshed):
    lay, workdir = meshed
    flags = ["--hostfile", str(lay.hostfile), "--session", "plain"]
    out = meshkit("train", *flags, "--cmd", "echo up; sleep 30", cwd=workdir)
    assert out.returncode == 0, out.stdout + out.stderr
    try:

        def running() -> list[dict] | None:
            rows = status_json(lay, workdir, "plain")
            return rows if all(row["state"] == "running" for row in rows) else None

        rows = wait_for(running, timeout=60)
        assert [(row["progress"], row["straggler"]) for row in rows] == [([], None)] * len(rows)
        text = meshkit("status", *flags)
        assert text.returncode == 0, text.stdout + text.stderr
        assert "step" not in text.stdout.splitlines()[1].split()
        assert "straggler" not in text.stdout
        top = meshkit("top", *flags, "--once", "--json")
        nodes = json.loads(top.stdout)["nodes"]
        assert all(node["straggler"] is None for node in nodes)
        assert all(rank["step"] is None for node in nodes for rank in node["ranks"])
    finally:
        meshkit("stop", *flags, cwd=workdir)
