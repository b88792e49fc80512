"""``init_distributed``: torch.distributed from whatever launched us (torchrun, SLURM, OpenMPI, or
the hostfile), like Colossal-AI's ``launch_from_*``. The only meshkit module that imports torch."""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path
from typing import Any

from .discovery import discover
from .distenv import ProcessPlace, process_place


def init_distributed(
    backend: str | None = None,
    hostfile: str = "hostfile",
    timeout: float = 300.0,
    **discover_args: Any,
) -> ProcessPlace:
    """Initialise the default process group and return this process's place in it.

    ``backend`` defaults to nccl when CUDA GPUs are present, else gloo. ``timeout`` (seconds)
    bounds the rendezvous and every collective.
    """
    import torch
    import torch.distributed as dist
    from torch._C._distributed_c10d import TCPStore  # what torch.distributed re-exports

    node = discover(hostfile if Path(hostfile).exists() else None, **discover_args)
    place = process_place(node, os.environ)
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(place.local_rank % torch.cuda.device_count())
    chosen = backend or ("nccl" if cuda else "gloo")
    limit = timedelta(seconds=timeout)
    rendezvous: dict[str, Any] = {"init_method": "env://"}  # torchrun hosts the store already
    if node.source != "torchrun" and "TORCHELASTIC_RUN_ID" not in os.environ:
        # Hosted by node 0's first process: node 0 is the node MASTER_ADDR names (discovery
        # guarantees it), global rank 0 may not be (mpirun -H in another order).
        store = TCPStore(
            node.master_addr,
            node.master_port,
            place.world_size,
            is_master=node.node_rank == 0 and place.local_rank == 0,
            timeout=limit,
            wait_for_workers=False,
        )
        rendezvous = {"store": store}
    dist.init_process_group(
        chosen, rank=place.rank, world_size=place.world_size, timeout=limit, **rendezvous
    )
    return place
