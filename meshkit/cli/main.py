"""The ``meshkit`` console script: an invoke Program over the package's task collection.

``env`` and ``run`` take a fast path that never imports invoke (they run on every node at every
launch); everything else, and anything unusual about those two, goes to the Program.
"""

from __future__ import annotations

import sys
from typing import Any

from .. import __version__


def program() -> Any:
    from invoke.program import Program

    from ..config import MeshkitConfig
    from .tasks import ns

    return Program(
        namespace=ns,
        name="meshkit",
        binary="meshkit",
        binary_names=["meshkit"],
        version=__version__,
        config_class=MeshkitConfig,
    )


def main() -> None:
    from .fast import run_fast

    if not run_fast(sys.argv[1:]):
        program().run()
