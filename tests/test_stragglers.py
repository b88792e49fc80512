"""A job watched by its steps, on the sandbox (real sshd, tmux, torch with gloo, 4 active nodes
and 1 spare, the bundled example calling ``meshkit.progress``): a rank hung by SIGSTOP is a stall
within the configured no-step bound (config ``step_stall_after``), restarted with its diagnosis
saved, and the job completes; a node capped at a third of a CPU (``sandbox.slow``) is named a
straggler within the window in status, top and the events, and with ``--evict-stragglers`` the
spare takes its rank, the job's step time back within 10% of before."""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

from conftest import meshkit
from helpers import spares
from helpers.sandbox_jobs import on_node, supervisor_said, wait_for

from meshkit import sandbox

SANDBOX_NODES = 5

meshed = spares.meshed

WINDOW = "20s"  # config straggler_window: the rates' and the comparison's window
WINDOW_S = 20.0
WORK = 150  # 128x128 matrix products per step, inside meshkit.progress.compute(): 10 ms alone
# One intra-op thread per rank: with torch's default (one per core) a rank's matrix products wait
# on each other's threads, spinning, whenever the 2 shared cores are oversubscribed (CI's other
# sandboxes): 40 products then took 0.02 to 1.5 s here, and an uncapped node was named a
# straggler at twice the median. With one thread the four nodes' compute per step is within 8%
# of each other under the same load.
# The capped job's steps are mostly a sleep: the computation takes 5 to 7 times as long under
# CI's load as alone, and the load comes and goes between the step time before the cap and after
# the eviction; a step that is all computation was 48% slower after (0.16 s, then 0.24 s). With
# the sleep, the same swing moves the step time by about 5%.
STEP_SECONDS = 0.5
THREADS = "OMP_NUM_THREADS=1"


def example(session: str, steps: int, step_seconds: float, spawn: bool) -> str:
    """The example, long enough to be watched: each attempt says what it was told first."""
    said = "echo attempt=$((MESHKIT_RESTART_COUNT + 1)) reason=$MESHKIT_RESTART_REASON"
    said += " generation=$MESHKIT_GENERATION master=$MASTER_ADDR"
    launcher = "python" if spawn else "torchrun"
    flags = f"--steps {steps} --work {WORK} --step-seconds {step_seconds} --checkpoint-every 20"
    return f"{said}; {THREADS} {launcher} example_train.py {flags}"


def events(lay, workdir: Path, session: str, node: int) -> list[dict[str, object]]:
    out = on_node(lay, node, workdir, "events", "--session", session, "--json")
    assert out.stdout.strip(), out.stderr
    return json.loads(out.stdout)


def step_time(rows: list[dict[str, object]]) -> float | None:
    """The median rank's seconds per step over the window (None: not known yet)."""
    times = []
    for row in rows:
        for rank in row.get("progress") or []:  # type: ignore[union-attr]
            if rank.get("step_s") is not None:
                times.append(float(rank["step_s"]))
    if len(times) < spares.ACTIVE:
        return None
    return statistics.median(times)


def steady_step_time(lay, workdir: Path, session: str) -> float:
    """The job's step time once its ranks have stepped for a whole window (no start-up steps
    in it): the median of three looks."""
    wait_for(lambda: step_time(spares.status(lay, workdir, session, node=1)), 240, interval=2)
    time.sleep(WINDOW_S + 2)
    looks = []
    for _ in range(10):  # a loaded node may miss a look (its ranks' window not yet full)
        found = step_time(spares.status(lay, workdir, session, node=1))
        if found is not None:
            looks.append(found)
        if len(looks) == 3:
            break
        time.sleep(2)
    assert looks, "the ranks' step time went away"
    return statistics.median(looks)


def rank_pids(lay, node: int) -> list[int]:
    """The example's rank processes on ``node`` (not torchrun, not bash)."""
    out = sandbox.node_exec(lay.nodes[node], ["pgrep", "-f", "python[^ ]* .*example_train.py"])
    found = []
    for pid in out.stdout.split():
        line = sandbox.node_exec(lay.nodes[node], ["cat", f"/proc/{pid}/cmdline"]).stdout
        if "torchrun" not in line and "example_train.py" in line:
            found.append(int(pid))
    return found


def stop(lay, workdir: Path, hostfile: Path, session: str) -> None:
    out = meshkit("stop", "--hostfile", str(hostfile), "--session", session, cwd=workdir)
    assert out.returncode == 0, out.stdout + out.stderr


def test_a_rank_hung_by_sigstop_stalls_by_its_steps_and_is_restarted_with_its_diagnosis(meshed):
    lay, workdir, hostfile = meshed
    session = "sigstop"
    env = f"MESHKIT_STEP_STALL_AFTER=20s MESHKIT_STRAGGLER_WINDOW={WINDOW}"
    cmd = example(session, steps=150, step_seconds=0.2, spawn=False)
    spares.train(lay, workdir, hostfile, session, "--restart-on-stall", cmd=cmd, env=env)
    try:

        def stepping():
            rows = spares.status(lay, workdir, session, node=1)
            told = [rank for row in rows for rank in row.get("progress") or []]
            # past the first checkpoint (every 20 steps), which the relaunch resumes from
            return (
                rows if len(told) == spares.ACTIVE and min(r["step"] for r in told) > 25 else None
            )

        wait_for(stepping, timeout=240, interval=2)
        pids = rank_pids(lay, 2)
        assert pids, "no rank process on node 2"
        stopped = time.time()
        for pid in pids:
            sandbox.node_exec(lay.nodes[2], ["kill", "-STOP", str(pid)])

        def restarted():
            rows = spares.status(lay, workdir, session, node=1)
            return rows if rows[0]["restarts_left"] == 1 else None

        rows = wait_for(restarted, timeout=120, interval=1)
        took = time.time() - stopped
        assert took < 20 + 40, took  # the no-step bound, then a poll and the diagnosis
        reason = str(rows[0]["last_restart_reason"])
        assert "no step for" in reason and "stalled" in reason, reason
        saved = Path(str(rows[0]["diagnosis"]))
        assert json.loads(saved.read_text())["state"] == "stalled"
        stalls = [event for event in events(lay, workdir, session, node=3)]
        stalls = [event for event in stalls if event["kind"] == "stalled"]
        assert stalls and stalls[0]["node"] == lay.nodes[2].address, stalls  # the hung rank's
        # the relaunch resumes from the checkpoint and completes
        wait_for(lambda: supervisor_said(workdir, session, " done: "), timeout=300, interval=2)
        assert "resumed from step" in spares.last_attempt(workdir, session, 0)
    finally:
        stop(lay, workdir, hostfile, session)


def test_a_node_capped_to_a_third_is_a_straggler_and_the_spare_takes_its_rank(meshed):
    lay, workdir, hostfile = meshed
    session = "slow"
    env = f"MESHKIT_STRAGGLER_WINDOW={WINDOW}"
    cmd = example(session, steps=100000, step_seconds=STEP_SECONDS, spawn=True)
    # a ratio of 1.5, between the uncapped nodes' spread under load (12% at most seen) and the
    # capped node's slowdown (3x under contention, where its weight binds, more where its quota
    # does)
    flags = ("--evict-stragglers", "--straggler-ratio", "1.5")
    spares.train(lay, workdir, hostfile, session, *flags, cmd=cmd, env=env, spawn=True)
    try:
        before = steady_step_time(lay, workdir, session)
        capped = time.time()
        sandbox.slow(lay, 2, cpu=0.33)

        def named():
            found = events(lay, workdir, session, node=1)
            return [event for event in found if event["kind"] == "straggler"]

        said = wait_for(named, timeout=60, interval=1)
        # the window's average crosses the ratio once most of the window is slow: on a quiet
        # machine within the window (the goodput benchmark: 14.5 s of 20 s), under CI's four
        # sandbox modules at once on 2 cores later (41 s seen)
        assert time.time() - capped < 3 * WINDOW_S, "not named within three windows"
        assert said[0]["node"] == lay.nodes[2].address, said
        assert "x the nodes' median compute per step" in str(said[0]["detail"]), said
        # evicted: the spare runs rank 2, told "evicted", no restart used
        rows = wait_for(
            lambda: spares.moved_to(lay, workdir, session, 2, 4), timeout=120, interval=1
        )
        assert rows[0]["restarts_left"] == 2
        assert any("straggler" in line for line in rows[0]["evicted"]), rows[0]
        told = spares.ATTEMPT.search(spares.last_attempt(workdir, session, 2))
        assert told is not None and told.group(2) == "evicted"
        # the step time, once the window is past the relaunch's first steps, is back within
        # 10% of before (looked at again a window later, up to twice, should a neighbour's load
        # have come and gone: CI runs other sandboxes beside this one on the same cores)
        looks = []
        for _ in range(3):
            looks.append(steady_step_time(lay, workdir, session))
            if looks[-1] <= before * 1.10:
                break
        rows = spares.status(lay, workdir, session, node=1)
        paces = {row["host"]: row.get("progress") for row in rows}
        load = sandbox.node_exec(lay.nodes[0], ["cat", "/proc/loadavg"]).stdout
        assert min(looks) <= before * 1.10, (before, looks, paces, load)
    finally:
        sandbox.slow(lay, 2, cpu=1.0)
        stop(lay, workdir, hostfile, session)
