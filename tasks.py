"""`invoke <task>` from the repository root: meshkit's tasks (as the `meshkit` script has them),
plus `bench`, which needs this checkout's benchmarks/ folder."""

import subprocess
import sys

from invoke.collection import Collection
from invoke.context import Context
from invoke.tasks import task

from meshkit.cli.tasks import ns as meshkit_tasks


@task(
    help={
        "nodes": "comma list of cluster sizes (default 2,4,8,16,32,64)",
        "repeats": "runs per size (default 3)",
        "peers_max": "largest N the peers run at (default 16)",
        "n2_max": "largest N for N x N operations (default 16)",
        "seed_max": "largest N the seed's sequential script runs at (default 8)",
        "launch_max": "largest N for launch until every rank is done (default 16)",
        "render_only": "redraw the table and plots from results.json; measure nothing",
    }
)
def bench(
    c: Context,
    nodes: str = "2,4,8,16,32,64",
    repeats: int = 3,
    peers_max: int = 16,
    n2_max: int = 16,
    seed_max: int = 8,
    launch_max: int = 16,
    render_only: bool = False,
) -> None:
    """Benchmarks on sandbox clusters (root): meshkit against the floor and its peers (the
    defaults are the committed run's settings)."""
    argv = [sys.executable, "-m", "benchmarks", "--nodes", nodes, "--repeats", str(repeats)]
    argv += ["--peers-max", str(peers_max), "--n2-max", str(n2_max)]
    argv += ["--seed-max", str(seed_max), "--launch-max", str(launch_max)]
    subprocess.run([*argv, "--render-only"] if render_only else argv, check=True)


ns = Collection.from_module(sys.modules[__name__], name="meshkit")
for name in meshkit_tasks.task_names:
    if "." not in name:
        ns.add_task(meshkit_tasks[name])
for child in meshkit_tasks.collections.values():
    ns.add_collection(child)
ns.configure(meshkit_tasks.configuration())
