"""The node's state files are named once, in node/files.py: the rank hook, which imports nothing
of meshkit into the user's ranks, builds the same paths; and what names a file reads back."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from meshkit.node import files

HOOK = Path(files.__file__).parent / "hook" / "sitecustomize.py"


def hook_paths(pid: int, errors: str, rank: str) -> dict[str, str]:
    """The hook's own paths, from a process of its own (loading it runs its chaining to the next
    sitecustomize, which this test process keeps out of)."""
    code = (
        "import json, runpy, sys\n"
        f"hook = runpy.run_path({str(HOOK)!r}, run_name='hook')\n"
        f"fifo = hook['fifo_path']({pid})\n"
        "paths = {'fifo': fifo, 'dump': hook['fifo_dump_path'](fifo),"
        f" 'error': hook['error_path']({errors!r}, {rank!r})}}\n"
        "print(json.dumps(paths))\n"
    )
    # outside a rank: the hook installs nothing
    env = {name: value for name, value in os.environ.items() if name != "RANK"}
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    paths: dict[str, str] = json.loads(done.stdout)
    return paths


def test_the_rank_hook_builds_the_paths_files_names(tmp_path):
    errors = files.errors_dir(str(tmp_path))
    paths = hook_paths(4321, errors, "3")
    assert paths["fifo"] == files.fifo(4321)
    assert paths["dump"] == files.fifo_dump(files.fifo(4321))
    assert paths["error"] == files.rank_error_file(errors, 3)


def test_a_flight_file_name_gives_back_its_pid():
    fifo = files.fifo(4321)
    assert os.path.dirname(fifo) == files.state_root()
    assert files.flight_file_pid(os.path.basename(fifo)) == "4321"
    assert files.flight_file_pid(os.path.basename(files.fifo_dump(fifo))) == "4321"
    assert files.flight_file_pid("fr-") == ""
    assert files.flight_file_pid("jobs") is None


def test_an_error_file_name_gives_back_its_rank(tmp_path):
    path = files.rank_error_file(str(tmp_path), 12)
    assert files.error_file_rank(os.path.basename(path)) == "12"
    assert files.error_file_rank("rank3.json.123") is None  # the hook's half-written file
    assert files.error_file_rank("notes.json") is None


def test_a_job_id_becomes_a_path():
    assert files.job_dir("ab" * 8) == f"{files.jobs_root()}/{'ab' * 8}"


@pytest.mark.parametrize("bad", ["../x", "AB" * 8, "ab", "a" * 65])
def test_anything_else_never_becomes_a_path(bad):
    with pytest.raises(ValueError, match="bad job id"):
        files.job_dir(bad)
    with pytest.raises(ValueError, match="bad job id"):
        files.supervisor_pid_file(bad)
