"""Files meshkit ships as package data: the example job, ``run.sh`` and the example configs.

Read through ``importlib.resources``, so they work from an installed wheel, not only a checkout."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

NAMES = (
    "example_train.py",
    "collective_probe.py",
    "run.sh",
    "hostfile.example",
    "meshkit.yaml",
)


def text(name: str) -> str:
    """A bundled file's text."""
    return resources.files(__name__).joinpath(name).read_text()


def copy_to(name: str, directory: Path, mode: int = 0o644) -> Path:
    """Write a bundled file into ``directory`` (e.g. a job's workdir) and return its path."""
    target = directory / name
    target.write_text(text(name))
    target.chmod(mode)
    return target
