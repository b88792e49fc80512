"""The sandbox's one way to run a system command (ip, ssh-keygen, ...): argv only, bounded in time,
a failure as a ``SandboxError`` that says which command and why."""

from __future__ import annotations

import subprocess
from collections.abc import Sequence

from ..errors import SandboxError

COMMAND_TIMEOUT = 30.0


def run(
    argv: Sequence[str], *, check: bool = True, input: str | None = None
) -> subprocess.CompletedProcess[str]:
    try:
        done = subprocess.run(
            list(argv),
            capture_output=True,
            text=True,
            timeout=COMMAND_TIMEOUT,
            input=input,
            check=False,
        )
    except subprocess.TimeoutExpired:
        raise SandboxError(f"{' '.join(argv)}: no answer in {COMMAND_TIMEOUT:.0f}s") from None
    if check and done.returncode != 0:
        raise SandboxError(f"{' '.join(argv)} failed: {done.stderr.strip() or done.stdout.strip()}")
    return done
