"""``init_distributed``: torch.distributed from whatever launched us (torchrun, SLURM, OpenMPI, or
the hostfile), like Colossal-AI's ``launch_from_*``. The only meshkit module that imports torch."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from .discovery import discover
from .distenv import ProcessPlace, process_place


def init_distributed(
    backend: str | None = None, hostfile: str = "hostfile", **discover_args: Any
) -> ProcessPlace:
    """Initialise the default process group and return this process's place in it.

    ``backend`` defaults to nccl when CUDA GPUs are present, else gloo.
    """
    import torch
    import torch.distributed as dist

    node = discover(hostfile if Path(hostfile).exists() else None, **discover_args)
    place = process_place(node, os.environ)
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(place.local_rank % torch.cuda.device_count())
    if "RANK" in os.environ and "MASTER_ADDR" in os.environ:
        init_method = "env://"  # torchrun already hosts the store on MASTER_ADDR:MASTER_PORT
    else:
        host = f"[{node.master_addr}]" if ":" in node.master_addr else node.master_addr
        init_method = f"tcp://{host}:{node.master_port}"
    dist.init_process_group(
        backend or ("nccl" if cuda else "gloo"),
        init_method=init_method,
        rank=place.rank,
        world_size=place.world_size,
    )
    return place
