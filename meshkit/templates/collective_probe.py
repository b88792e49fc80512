"""meshkit's collective probe: one all_reduce over every process of every node, bounded in time.

Run it under torchrun (``torchrun collective_probe.py``; RANK/WORLD_SIZE come from torchrun) or
once per node under ``meshkit run`` (NODE_RANK/NNODES). Each process prints one line that
``meshkit doctor`` and the tests read, and exits 0 only if the sum is right:

    meshkit-probe rank=R world_size=W import=T backend=B ifname=I host=H sum=S expected=E ok=True

With ``--bytes N`` it then times one all_reduce of N bytes (after one untimed warm-up) and adds
``bytes=N seconds=T busbw=B`` (bits/s, as nccl-tests count it: N/T x 2(W-1)/W) before ``sum=``.
    meshkit-probe rank=R import=T error=...   (exit 3: wrong sum, 4: could not connect/reduce in time)

``import=T``: the seconds its ``import torch`` took. Every rank must reach the rendezvous within
``--timeout`` of the first, so a slow import (a busy node, a venv on a shared filesystem) shows.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time
from datetime import timedelta


def say(text: str) -> None:
    # One write per line: the node's processes share one pipe, and a single small write is atomic.
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--timeout", type=float, default=30.0, help="seconds for init and reduce")
    parser.add_argument("--backend", default="auto", help="gloo, nccl or auto (nccl with GPUs)")
    parser.add_argument("--bytes", type=int, default=0, help="then time an all_reduce this big")
    args = parser.parse_args()
    env = os.environ
    under_torchrun = "RANK" in env and "LOCAL_RANK" in env
    rank = int(env["RANK"] if under_torchrun else env.get("NODE_RANK", "0"))
    world = int(env["WORLD_SIZE"] if under_torchrun else env.get("NNODES", "1"))
    started, loaded = time.monotonic(), ""
    try:
        import torch
        import torch.distributed as dist

        loaded = f"import={time.monotonic() - started:.1f}s "
        backend = args.backend
        if backend == "auto":
            backend = "nccl" if torch.cuda.is_available() else "gloo"
        device = f"cuda:{int(env.get('LOCAL_RANK', '0'))}" if backend == "nccl" else "cpu"
        if device != "cpu":
            torch.cuda.set_device(device)
        ifname = env.get("NCCL_SOCKET_IFNAME" if backend == "nccl" else "GLOO_SOCKET_IFNAME", "-")
        init = "env://" if under_torchrun else f"tcp://{env['MASTER_ADDR']}:{env['MASTER_PORT']}"
        limit = timedelta(seconds=args.timeout)
        dist.init_process_group(backend, init, rank=rank, world_size=world, timeout=limit)
        value = torch.tensor([float(rank + 1)], device=device)
        dist.all_reduce(value)
        total = int(value.item())
        timed = ""
        if args.bytes > 0:
            data = torch.ones(max(args.bytes // 4, 1), device=device)
            dist.all_reduce(data)  # warm-up: connections and buffers
            dist.barrier()
            if device != "cpu":
                torch.cuda.synchronize()
            started = time.monotonic()
            dist.all_reduce(data)
            if device != "cpu":
                torch.cuda.synchronize()
            took = time.monotonic() - started
            busbw = data.numel() * 4 * 8 / took * 2 * (world - 1) / world
            timed = f"bytes={data.numel() * 4} seconds={took:.4f} busbw={busbw:.4g} "
        dist.destroy_process_group()
    except Exception as exc:  # any failure is the probe's answer, on one line
        detail = " ".join(str(exc).split())[:300]
        say(f"meshkit-probe rank={rank} {loaded}error={type(exc).__name__}: {detail}")
        return 4
    expected = world * (world + 1) // 2
    say(
        f"meshkit-probe rank={rank} world_size={world} {loaded}backend={backend} ifname={ifname} "
        f"host={socket.gethostname()} {timed}sum={total} expected={expected} ok={total == expected}"
    )
    return 0 if total == expected else 3


if __name__ == "__main__":
    sys.exit(main())
