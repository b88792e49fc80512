"""The long run of the quorum simulation (issue 43): ``tests/test_quorum_sim.py``'s random
schedules, many more of them than CI runs.

``python -m benchmarks.quorum_sim [EXAMPLES]`` (default 20000; no root, no sandbox) runs the
simulation's property test with ``MESHKIT_SIM_EXAMPLES=EXAMPLES`` and prints the count of
schedules and the time taken (the test module's docstring says what one schedule is).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TEST = "tests/test_quorum_sim.py::test_random_schedules_keep_the_four_properties"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("examples", nargs="?", type=int, default=20000)
    args = parser.parse_args()
    env = {**os.environ, "MESHKIT_SIM_EXAMPLES": str(args.examples)}
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", TEST]
    started = time.monotonic()
    done = subprocess.run(command, cwd=ROOT, env=env, check=False)
    took = time.monotonic() - started
    verdict = "passed" if done.returncode == 0 else f"FAILED (pytest exit {done.returncode})"
    print(f"quorum simulation: {args.examples} schedules, {took:.1f}s, {verdict}")
    return done.returncode


if __name__ == "__main__":
    sys.exit(main())
