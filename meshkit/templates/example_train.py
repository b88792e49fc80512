"""meshkit's example job: a small model trained across every process of every node, which
checkpoints every few steps and, started again (a relaunch of a supervised job, or simply a
checkpoint present), resumes from its last checkpoint; then a real all_reduce whose sum it checks.

Run by torchrun (``torchrun example_train.py`` needs no flags under ``meshkit run``: the PET_*
variables carry them) or by ``meshkit run --spawn`` (``python example_train.py``). Rank 0 says
what meshkit told it of this attempt (``MESHKIT_RESTART_COUNT``, ``MESHKIT_RESTART_REASON``,
``MESHKIT_GENERATION``), where it starts from and each checkpoint; each process prints one
``meshkit-example`` result line that the demo and the tests read.

Each rank tells meshkit its steps (``meshkit.progress.step()``) and times its own computation
(``meshkit.progress.compute()``, not the all_reduce), so that meshkit watches the job by its
steps and names a node slower than the others; ``--work N`` adds N products of two 128x128
matrices to each step's computation: fixed work, which a node with less CPU takes longer over.

The checkpoint is rank 0's to write and read (``checkpoints/SESSION.pt`` in the workdir): it
sends what it read to the others, so a synced workdir works too as long as rank 0's node keeps
its copy; a shared workdir survives the loss of any node.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time
from typing import TypedDict

import torch
import torch.distributed as dist

import meshkit.progress


class Checkpoint(TypedDict):
    step: int  # the steps done
    model: dict[str, torch.Tensor]


def say(line: str) -> None:
    # One write per line: the node's processes share one pipe, and a single small write is atomic.
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def checkpoint_path(given: str | None) -> str:
    if given:
        return given
    session = os.environ.get("MESHKIT_SESSION", "example")
    return os.path.join("checkpoints", f"{session}.pt")


def load(path: str, rank: int, model: torch.nn.Module, device: str) -> int | None:
    """Rank 0 reads the last checkpoint into ``model`` and sends its weights and step to every
    rank; the step it resumes from (None when there is no checkpoint). Tensors only: torch's
    object broadcast needs numpy, which a torch-only venv lacks."""
    step = torch.tensor([-1], dtype=torch.long, device=device)
    if rank == 0 and os.path.exists(path):
        checkpoint: Checkpoint = torch.load(path, weights_only=True)
        model.load_state_dict(checkpoint["model"])
        step[0] = checkpoint["step"]
    dist.broadcast(step, src=0)
    found = int(step.item())
    if found < 0:
        return None
    with torch.no_grad():
        for parameter in model.parameters():
            dist.broadcast(parameter.data, src=0)
    return found


def save(path: str, step: int, model: torch.nn.Module) -> None:
    """Written aside, then renamed: a node lost mid-write leaves the previous checkpoint whole."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    state = Checkpoint(step=step, model=model.state_dict())
    torch.save(state, path + ".tmp")
    os.replace(path + ".tmp", path)


def work(products: int, device: str) -> None:
    """``products`` products of two 128x128 matrices: a fixed amount of computation per step."""
    if products <= 0:
        return
    matrix = torch.ones(128, 128, device=device) / 128
    for _ in range(products):
        matrix = matrix @ matrix
    if device == "cuda":
        torch.cuda.synchronize()  # the time is the work's, not its queueing


def train(args: argparse.Namespace, rank: int, device: str) -> None:
    torch.manual_seed(0)  # every rank starts from the same weights
    model = torch.nn.Linear(8, 1).to(device)
    path = checkpoint_path(args.checkpoint)
    first_step = 0
    resumed = load(path, rank, model, device)
    if resumed is not None:
        first_step = resumed
    if rank == 0 and resumed is not None:
        say(f"resumed from step {first_step} ({path})")
    elif rank == 0:
        say(f"no checkpoint at {path}: starting at step 0")
    world = dist.get_world_size()
    target = torch.arange(8.0, device=device)
    for step in range(first_step, args.steps):
        # Each rank its own batch of each step, the same on a relaunch.
        generator = torch.Generator().manual_seed(step * 1000 + rank)
        inputs = torch.randn(16, 8, generator=generator).to(device)
        parameters = list(model.parameters())
        with meshkit.progress.compute():  # this rank's own work, not the wait in all_reduce
            work(args.work, device)
            loss = torch.nn.functional.mse_loss(model(inputs).squeeze(1), inputs @ target)
            gradients = torch.autograd.grad(loss, parameters)
        # Plain SGD on the gradient averaged over every rank: what DistributedDataParallel
        # does, without the seconds its import costs each process.
        with torch.no_grad():
            for parameter, gradient in zip(parameters, gradients, strict=True):
                dist.all_reduce(gradient)
                parameter.sub_(0.05 * gradient / world)
        done = step + 1
        due = done % args.checkpoint_every == 0 or done == args.steps
        if due and rank == 0:
            save(path, done, model)
            say(f"checkpoint at step {done} loss={loss.item():.4f}")
        meshkit.progress.step()
        time.sleep(args.step_seconds)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20, help="train up to this step")
    parser.add_argument("--checkpoint-every", type=int, default=5, help="steps between saves")
    parser.add_argument("--checkpoint", help="the file (default: checkpoints/SESSION.pt)")
    parser.add_argument("--step-seconds", type=float, default=0.0, help="pause after a step")
    parser.add_argument(
        "--work", type=int, default=0, help="products of two 128x128 matrices per step"
    )
    parser.add_argument("--sleep", type=float, default=0.0, help="keep running this long")
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
    if rank == 0:
        # What meshkit's supervisor told this attempt (the defaults: a first start).
        restarts = os.environ.get("MESHKIT_RESTART_COUNT", "0")
        reason = os.environ.get("MESHKIT_RESTART_REASON", "start")
        generation = os.environ.get("MESHKIT_GENERATION", "1")
        said = f"restart_count={restarts} reason={reason} generation={generation}"
        say(f"attempt: {said} world_size={world}")
    train(args, rank, device)
    value = torch.tensor([float(rank + 1)], device=device)
    dist.all_reduce(value)
    expected = world * (world + 1) // 2
    total = int(value.item())
    say(
        f"meshkit-example rank={rank} world_size={world} "
        f"node_rank={os.environ.get('GROUP_RANK')} "
        f"meshkit_node_rank={os.environ.get('NODE_RANK')} "
        f"local_rank={os.environ.get('LOCAL_RANK')} "
        f"host={socket.gethostname()} sum={total} expected={expected} "
        f"ok={total == expected}"
    )
    dist.barrier()
    dist.destroy_process_group()
    time.sleep(args.sleep)


if __name__ == "__main__":
    main()
