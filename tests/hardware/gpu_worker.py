"""One process of the GPU check: ``init_distributed`` (nccl when CUDA is there), then an
all_reduce of a CUDA tensor; prints one line the check reads."""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

from meshkit.torch import init_distributed

place = init_distributed(hostfile=sys.argv[1], timeout=60)
value = torch.tensor([float(place.rank + 1)], device="cuda")
dist.all_reduce(value)
print(
    f"gpu-worker rank={place.rank} world={place.world_size} backend={dist.get_backend()} "
    f"device={torch.cuda.current_device()} sum={int(value.item())} "
    f"torchrun={'TORCHELASTIC_RUN_ID' in os.environ}",
    flush=True,
)
dist.destroy_process_group()
