"""Files meshkit ships as package data: the example job, ``run.sh`` and the example configs.

Read through ``importlib.resources``, so they work from an installed wheel, not only a checkout."""

from __future__ import annotations

from importlib import resources
from pathlib import Path


def copy_to(name: str, directory: Path) -> Path:
    """Write a bundled file into ``directory`` (e.g. a job's workdir) and return its path."""
    target = directory / name
    target.write_text(resources.files(__name__).joinpath(name).read_text())
    target.chmod(0o644)
    return target
