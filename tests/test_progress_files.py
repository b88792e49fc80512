"""Issue 45's progress files, no nodes: what a rank writes (``meshkit.progress``) and what the
node's agent reads of it (``meshkit.node.progress``), hostile files included."""

from __future__ import annotations

import json
import math
import os
import stat
import time
from pathlib import Path

import pytest

from meshkit import progress
from meshkit.node import progress as reader
from meshkit.node.progress import figures, read_progress


@pytest.fixture
def in_job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A rank 3 of a meshkit job whose progress directory is ``tmp_path``; the module's
    state made afresh from that environment."""
    monkeypatch.setenv("MESHKIT_PROGRESS", str(tmp_path))
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setattr(progress, "_progress", None)
    return tmp_path


def test_outside_a_job_step_and_compute_do_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("MESHKIT_PROGRESS", raising=False)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr(progress, "_progress", None)
    monkeypatch.chdir(tmp_path)
    with progress.compute():
        pass
    progress.step()
    assert progress._state().path is None
    assert progress._state().steps == 0
    assert os.listdir(tmp_path) == []
    # a directory but no rank: not a rank of a meshkit job either
    monkeypatch.setenv("MESHKIT_PROGRESS", str(tmp_path))
    monkeypatch.delenv("RANK")
    monkeypatch.setattr(progress, "_progress", None)
    progress.step()
    assert os.listdir(tmp_path) == []


def test_a_rank_writes_its_file_private_at_the_first_step_then_about_once_a_second(
    in_job: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    writes = []
    original = progress._Progress.write

    def counted(self: progress._Progress) -> None:
        writes.append(self.steps)
        original(self)

    monkeypatch.setattr(progress._Progress, "write", counted)
    for _ in range(1000):
        with progress.compute():
            pass
        progress.step()
    assert writes == [1]  # the first step, then nothing within the second
    path = in_job / "rank3.json"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    data = json.loads(path.read_text())
    assert (data["rank"], data["step"], data["sections"]) == (3, 1, 1)
    assert os.listdir(in_job) == ["rank3.json"]  # no temporary left
    progress._state().next_write = 0.0  # a second later
    progress.step()
    assert writes == [1, 1001]
    data = json.loads(path.read_text())
    assert data["step"] == 1001
    assert data["sections"] == 1000
    assert data["compute"] >= 0


def test_no_write_goes_through_a_planted_symlink(in_job: Path, tmp_path_factory) -> None:
    elsewhere = tmp_path_factory.mktemp("victim") / "victim"
    elsewhere.write_text("keep me")
    (in_job / "rank3.json").symlink_to(elsewhere)
    progress.step()
    assert elsewhere.read_text() == "keep me"
    # the link itself was replaced by the rank's own file
    assert not (in_job / "rank3.json").is_symlink()
    assert json.loads((in_job / "rank3.json").read_text())["step"] == 1


def test_a_failing_write_never_raises_in_the_training_loop(in_job: Path) -> None:
    os.rmdir(in_job)  # the directory is gone (a reboot's /tmp, a stop)
    for _ in range(3):
        progress.step()
        progress._state().next_write = 0.0
    assert progress._state().steps == 3
    in_job.write_text("not a directory")
    progress.step()
    assert in_job.read_text() == "not a directory"


# ---- the node's reader ---------------------------------------------------------------------


def told(
    step: int = 100,
    last: float = 1000.0,
    compute: float = 5.0,
    sections: int = 100,
    ring: list[list[float]] | None = None,
) -> dict[str, object]:
    """A rank's file: by default 100 steps, the last at t=1000, a checkpoint every 5 s from
    t=960 at 2 steps a second and 0.05 s of compute a step."""
    if ring is None:
        ring = [[960.0 + 5 * i, 20.0 + 10 * i, 1.0 + 0.5 * i] for i in range(9)]
    return {
        "rank": 0,
        "step": step,
        "time": last,
        "compute": compute,
        "sections": sections,
        "first": [900.0, 1.0],
        "early": None,
        "ring": ring,
    }


def test_figures_take_the_rates_over_the_window() -> None:
    shown = figures(told(), 0, 20.0, 1002.0)
    assert shown is not None
    assert (shown.rank, shown.step, shown.age) == (0, 100, 2.0)
    # from the checkpoint at t=980 (60 steps, 3.0 s of compute) to the last step
    assert shown.rate == pytest.approx(2.0)
    assert shown.step_s == pytest.approx(0.5)
    assert shown.compute_s == pytest.approx(0.05)
    assert shown.early_step_s is None


def test_figures_wait_for_half_a_window_and_leave_compute_out_without_sections() -> None:
    young = told(ring=[[995.0, 90.0, 4.5]])
    shown = figures(young, 0, 20.0, 1000.0)
    assert shown is not None and shown.step == 100
    assert (shown.rate, shown.step_s, shown.compute_s) == (None, None, None)
    bare = figures(told(compute=0.0, sections=0), 0, 20.0, 1000.0)
    assert bare is not None and bare.rate == pytest.approx(2.0)
    assert bare.compute_s is None


def test_figures_of_the_first_minutes() -> None:
    data = told()
    data["early"] = [1020.0, 241.0]
    shown = figures(data, 0, 20.0, 1000.0)
    assert shown is not None
    assert shown.early_step_s == pytest.approx(0.5)


@pytest.mark.parametrize(
    "change",
    [
        {"step": -1},
        {"step": math.nan},
        {"time": math.inf},
        {"compute": -0.5},
        {"sections": "many"},
        {"step": True},
        {"step": 2**60},
        {"time": 5000.0},  # beyond the node's clock
    ],
)
def test_a_file_whose_fields_do_not_fit_is_left_out(change: dict[str, object]) -> None:
    assert figures({**told(), **change}, 0, 20.0, 1000.0) is None


def test_bad_checkpoints_are_left_out_not_the_file() -> None:
    ring: list[object] = [[980.0, -1.0, 0.0], "x", [math.nan, 1, 2], [980.0, 60.0]]
    shown = figures({**told(), "ring": ring}, 0, 20.0, 1000.0)
    assert shown is not None and shown.step == 100
    assert shown.rate is None


def state_dir(tmp_path: Path) -> Path:
    """A job's state directory with its progress directory, as the keeper makes them."""
    directory = tmp_path / "job"
    (directory / "progress").mkdir(parents=True, mode=0o700)
    os.chmod(directory / "progress", 0o700)
    return directory


def write(directory: Path, name: str, data: object) -> Path:
    path = directory / "progress" / name
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return path


def test_the_reader_gives_each_ranks_progress_by_rank(tmp_path: Path) -> None:
    directory = state_dir(tmp_path)
    write(directory, "rank1.json", told())
    write(directory, "rank0.json", told(step=90))
    write(directory, "notes.txt", "not a rank's")
    write(directory, "rankx.json", told())
    found = read_progress(str(directory), 900.0, 20.0, 1000.0)
    assert [(rank.rank, rank.step) for rank in found] == [(0, 90), (1, 100)]


def test_the_reader_leaves_out_hostile_and_stale_files(tmp_path: Path) -> None:
    directory = state_dir(tmp_path)
    elsewhere = tmp_path / "elsewhere.json"
    elsewhere.write_text(json.dumps(told()))
    (directory / "progress" / "rank0.json").symlink_to(elsewhere)
    write(directory, "rank1.json", "{not json")
    write(directory, "rank2.json", " " * (reader.MAX_FILE + 10) + json.dumps(told()))
    write(directory, "rank3.json", json.dumps(told()).replace("100,", "NaN,", 1))
    write(directory, "rank4.json", [1, 2, 3])
    write(directory, "rank5.json", told(last=800.0))  # before this attempt started
    os.mkfifo(directory / "progress" / "rank6.json")
    write(directory, "rank7.json", told())
    found = read_progress(str(directory), 900.0, 20.0, 1000.0)
    assert [rank.rank for rank in found] == [7]


@pytest.mark.skipif(os.getuid() != 0, reason="giving a file to another user needs root")
def test_the_reader_leaves_out_a_file_of_another_user(tmp_path: Path) -> None:
    directory = state_dir(tmp_path)
    path = write(directory, "rank0.json", told())
    os.chown(path, 65534, 65534)
    write(directory, "rank1.json", told())
    assert [rank.rank for rank in read_progress(str(directory), None, 20.0, 1000.0)] == [1]


def test_the_reader_trusts_no_progress_directory_others_could_write(tmp_path: Path) -> None:
    directory = state_dir(tmp_path)
    write(directory, "rank0.json", told())
    os.chmod(directory / "progress", 0o777)
    assert read_progress(str(directory), None, 20.0, 1000.0) == []
    assert read_progress(str(tmp_path / "absent"), None, 20.0, 1000.0) == []


def test_a_rank_and_the_reader_agree(in_job: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What ``meshkit.progress`` writes, ``read_progress`` reads: the keeper's layout."""
    directory = in_job / "job"
    (directory / "progress").mkdir(parents=True, mode=0o700)
    monkeypatch.setenv("MESHKIT_PROGRESS", str(directory / "progress"))
    monkeypatch.setattr(progress, "_progress", None)
    started = time.time() - 1
    for _ in range(5):
        progress.step()
    found = read_progress(str(directory), started, 60.0)
    assert [(rank.rank, rank.step) for rank in found] == [(3, 1)]
    assert found[0].age < 5
