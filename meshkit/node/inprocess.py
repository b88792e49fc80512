"""meshkit's own entry point run in a fork of a node process (the agent, the keeper), instead of
in a new interpreter: the child starts with the interpreter up and the standard library it needs
largely imported, which spares every node tens of ms of CPU at every launch. Only for
``THIS_PYTHON -m meshkit ...``: another interpreter (another venv) is started as asked.
Standard library only."""

from __future__ import annotations

import os
import sys

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import NoReturn


def this_interpreter(argv: list[str]) -> bool:
    """``argv`` is ``THIS_PYTHON -m meshkit ...``: the very interpreter (venv) this process runs
    on. Paths are compared as given, not resolved: two venvs share one resolved interpreter."""
    return (
        len(argv) > 3
        and argv[1:3] == ["-m", "meshkit"]
        and os.path.isabs(argv[0])
        and os.path.normpath(argv[0]) == os.path.normpath(sys.executable)
    )


def run_meshkit(cwd: str, args: list[str], path0: str | None = None) -> NoReturn:
    """In a forked child: ``python -m meshkit ARGS`` as started in ``cwd`` (``cwd`` first on the
    module path, as ``-m`` puts it; or ``path0``, a console script's directory), then exit with
    its status. Never returns."""
    code = 1
    try:
        os.chdir(cwd)
        sys.path[0] = cwd if path0 is None else path0
        sys.argv = ["meshkit", *args]
        from meshkit.cli.main import main

        main()
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # reported on the child's stderr, as python would report it
        import traceback

        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:  # noqa: SIM105 - contextlib would be one more import in every keeper
                stream.flush()
            except Exception:  # the child is exiting; nothing is left to tell
                pass
        os._exit(code)
