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
        "nodes": "comma list of cluster sizes (default 2,4,8,16)",
        "repeats": "runs per size (default 3)",
    }
)
def bench(c: Context, nodes: str = "2,4,8,16", repeats: int = 3) -> None:
    """Benchmarks on sandbox clusters (root): mesh vs the seed's algorithm and the floor, launch, env."""
    subprocess.run(
        [sys.executable, "-m", "benchmarks", "--nodes", nodes, "--repeats", str(repeats)],
        check=True,
    )


ns = Collection.from_module(sys.modules[__name__], name="meshkit")
for name in meshkit_tasks.task_names:
    if "." not in name:
        ns.add_task(meshkit_tasks[name])
for child in meshkit_tasks.collections.values():
    ns.add_collection(child)
ns.configure(meshkit_tasks.configuration())
