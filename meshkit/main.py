"""The ``meshkit`` console script: an invoke Program over the package's task collection."""

from __future__ import annotations

from invoke.program import Program

from . import __version__
from .config import MeshkitConfig
from .tasks import ns

program = Program(
    namespace=ns,
    name="meshkit",
    binary="meshkit",
    binary_names=["meshkit"],
    version=__version__,
    config_class=MeshkitConfig,
)


def main() -> None:
    program.run()
