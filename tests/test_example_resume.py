"""The bundled example checkpoints and, relaunched, resumes from its last checkpoint: a supervised
job on the sandbox (real sshd, tmux, gloo) whose first attempt trains to step 10 and fails, and
whose relaunch (told MESHKIT_RESTART_COUNT=1, reason ``failure``, by the supervisor) resumes at
step 10 instead of 0 and completes; under torchrun and under ``--spawn``."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import sandbox_jobs
from helpers.sandbox_jobs import RESULT, on_node, supervisor_said, wait_for

SANDBOX_NODES = 2
NPROC = 1  # one rank a node: several local ranks are test_train's part (sandbox_jobs.NPROC)
# Each attempt trains 10 steps further than the last; the first one then fails, so that the
# supervisor relaunches the job, and the relaunch succeeds.
STEPS = "--steps $((MESHKIT_RESTART_COUNT * 10 + 10)) --checkpoint-every 5"
FAIL_FIRST = '[ "$MESHKIT_RESTART_COUNT" -gt 0 ]'


meshed = sandbox_jobs.meshed  # the fixture: this module's sandbox, meshed, with the example


def log_text(workdir: Path, session: str, rank: int) -> str:
    log = workdir / ".meshkit" / session / f"node{rank}.log"
    if not log.exists():
        return ""
    return log.read_text(errors="replace")


@pytest.mark.parametrize("spawn", [False, True], ids=["torchrun", "spawn"])
def test_a_relaunch_resumes_from_the_last_checkpoint(meshed, spawn):
    lay, workdir = meshed
    session = "spawned" if spawn else "torchrun"
    flags = ["--hostfile", str(lay.hostfile), "--session", session, "--restarts", "1"]
    flags += ["--nproc-per-node", str(NPROC)]
    launcher = "torchrun"
    if spawn:
        flags.append("--spawn")
        launcher = "python"
    command = f"{launcher} example_train.py {STEPS} && {FAIL_FIRST}"
    out = on_node(lay, 0, workdir, "train", *flags, "--cmd", command)
    assert out.returncode == 0, out.stdout + out.stderr
    wait_for(lambda: supervisor_said(workdir, session, " done: "), timeout=180)

    said = log_text(workdir, session, 0)  # rank 0 (node 0) says where it starts from
    first, _, second = said.partition("restart_count=1")
    assert "attempt: restart_count=0 reason=start generation=1" in first, said
    assert f"no checkpoint at checkpoints/{session}.pt: starting at step 0" in first
    assert "checkpoint at step 10 " in first
    assert "reason=failure" in second.splitlines()[0], said
    assert f"resumed from step 10 (checkpoints/{session}.pt)" in second
    assert "starting at step 0" not in second
    assert "checkpoint at step 15 " in second
    assert "checkpoint at step 20 " in second
    assert "checkpoint at step 5 " not in second
    # Both attempts reduced across every rank of both nodes.
    world = len(lay.nodes) * NPROC
    results = []
    for rank in range(len(lay.nodes)):
        results += [match for match in RESULT.finditer(log_text(workdir, session, rank))]
    assert len(results) == 2 * world
    assert {int(match.group(2)) for match in results} == {world}
    assert all(match.group(5) == match.group(6) for match in results)
