"""meshkit's example job: a real all_reduce across every process of every node.

Run by torchrun (``torchrun example_train.py`` needs no flags under ``meshkit run``: the PET_*
variables carry them). Each process prints one line that the demo and the tests read.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time

import torch
import torch.distributed as dist


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sleep", type=float, default=0.0, help="keep running this long after")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    if cuda:  # nccl reduces only CUDA tensors, each process on its own GPU
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        dist.init_process_group("nccl")
    else:
        dist.init_process_group("gloo")
    rank = dist.get_rank()
    world = dist.get_world_size()
    device = "cuda" if cuda else "cpu"
    value = torch.tensor([float(rank + 1)], device=device)
    dist.all_reduce(value)
    expected = world * (world + 1) // 2
    total = int(value.item())
    line = (
        f"meshkit-example rank={rank} world_size={world} "
        f"node_rank={os.environ.get('GROUP_RANK')} "
        f"meshkit_node_rank={os.environ.get('NODE_RANK')} "
        f"local_rank={os.environ.get('LOCAL_RANK')} "
        f"host={socket.gethostname()} sum={total} expected={expected} "
        f"ok={total == expected}\n"
    )
    # One write per line: the node's processes share one pipe, and a single small write is atomic.
    sys.stdout.write(line)
    sys.stdout.flush()
    dist.barrier()
    dist.destroy_process_group()
    time.sleep(args.sleep)


if __name__ == "__main__":
    main()
