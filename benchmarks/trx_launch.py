"""torchrunx's launch of the example all_reduce, run inside node0 with the torchrunx venv's python:
``python trx_launch.py NODES PER_NODE``. Prints each worker's result line (the same line as
meshkit/templates/example_train.py) so the benchmark checks it with the same parser."""

from __future__ import annotations

import sys


def work() -> str:
    import os
    import socket

    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    world = dist.get_world_size()
    value = torch.tensor([float(rank + 1)])
    dist.all_reduce(value)
    expected = world * (world + 1) // 2
    return (
        f"meshkit-example rank={rank} world_size={world} node_rank={os.environ.get('GROUP_RANK')} "
        f"meshkit_node_rank=None local_rank={os.environ.get('LOCAL_RANK')} "
        f"host={socket.gethostname()} sum={int(value.item())} expected={expected} "
        f"ok={int(value.item()) == expected}"
    )


def main() -> None:
    import torchrunx  # type: ignore[import-not-found]  # only in the torchrunx venv

    nodes = int(sys.argv[1])
    per_node = int(sys.argv[2])
    launcher = torchrunx.Launcher(
        hostnames=[f"node{i}" for i in range(nodes)],
        workers_per_host=per_node,
        backend="gloo",
        agent_timeout=60,
        worker_timeout=120,
    )
    launcher.set_logging_handlers(None)
    result = launcher.run(work)
    for lines in result.results.values():
        for line in lines:
            print(line, flush=True)


if __name__ == "__main__":
    main()
