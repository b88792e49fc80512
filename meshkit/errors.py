"""The root of meshkit's user-facing errors.

Each module raises its own subclass (one type per kind of failure, as libtmux does); tasks turn any
of them into ``invoke.Exit`` so users get the message and a non-zero code, never a traceback.
"""

from __future__ import annotations


class MeshkitError(Exception):
    """A problem the user can fix; ``str()`` is one line per problem, each naming where and how."""

    def __init__(self, problems: str | list[str]) -> None:
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        super().__init__("\n".join(self.problems))
