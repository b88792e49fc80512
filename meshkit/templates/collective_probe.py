"""meshkit's collective probe: one all_reduce over every process of every node, bounded in time.

Run it under torchrun (``torchrun collective_probe.py``; RANK/WORLD_SIZE come from torchrun) or
once per node under ``meshkit run`` (NODE_RANK/NNODES). Each process prints one line that
``meshkit doctor`` and the tests read, and exits 0 only if the sum is right:

    meshkit-probe rank=R world_size=W import=T backend=B ifname=I host=H sum=S expected=E ok=True

With ``--bytes N`` it then times one all_reduce of N bytes (after one untimed warm-up) and adds
``bytes=N seconds=T busbw=B`` (bits/s, as nccl-tests count it: N/T x 2(W-1)/W) before ``sum=``.
A process that could not connect or reduce in time prints instead (and exits 4; a wrong sum
exits 3):

    meshkit-probe rank=R import=T error=...

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
    # One write per line: the node's processes share one pipe, and a small write is atomic.
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
    if under_torchrun:
        rank = int(env["RANK"])
        world = int(env["WORLD_SIZE"])
    else:  # one process per node
        rank = int(env.get("NODE_RANK", "0"))
        world = int(env.get("NNODES", "1"))
    started = time.monotonic()
    loaded = ""  # "import=T " once torch is imported
    try:
        import torch
        import torch.distributed as dist

        loaded = f"import={time.monotonic() - started:.1f}s "
        backend = args.backend
        if backend == "auto":
            backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            device = f"cuda:{int(env.get('LOCAL_RANK', '0'))}"
            torch.cuda.set_device(device)
            ifname = env.get("NCCL_SOCKET_IFNAME", "-")
        else:
            device = "cpu"
            ifname = env.get("GLOO_SOCKET_IFNAME", "-")
        # torchrun's rendezvous reads the env itself; under meshkit run the master is named
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
            size = data.numel() * 4  # bytes of float32
            # the bus bandwidth, as nccl-tests count it: size/time in bits/s x 2(W-1)/W
            busbw = size * 8 / took * 2 * (world - 1) / world
            timed = f"bytes={size} seconds={took:.4f} busbw={busbw:.4g} "
        dist.destroy_process_group()
    except Exception as exc:  # any failure is the probe's answer, on one line
        detail = " ".join(str(exc).split())[:300]
        say(f"meshkit-probe rank={rank} {loaded}error={type(exc).__name__}: {detail}")
        return 4
    expected = world * (world + 1) // 2  # every rank adds rank + 1
    ok = total == expected
    where = f"{loaded}backend={backend} ifname={ifname} host={socket.gethostname()}"
    say(
        f"meshkit-probe rank={rank} world_size={world} {where} "
        f"{timed}sum={total} expected={expected} ok={ok}"
    )
    return 0 if ok else 3


if __name__ == "__main__":
    sys.exit(main())
