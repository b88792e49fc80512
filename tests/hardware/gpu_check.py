"""meshkit on a real NVIDIA GPU node (not part of the suite: CI has no GPU). Run on a GPU
machine from the repository root: ``python3 tests/hardware/gpu_check.py``. Checks GPU counting
(each way ``gpu_count`` can learn it), ``top``'s GPU readings (NVML and nvidia-smi), the doctor's
CUDA and NCCL versions, the node's health readers (NVML's health fields, nvidia-smi's health query,
the kernel log), ``meshkit env --nproc-per-node auto``, and ``init_distributed``'s nccl
path under torchrun, without it, and under ``meshkit run --spawn``, all started by ``meshkit
run``; then the example job (under torchrun and spawned), the doctor's collective probe, and
``diagnose`` on GPU ranks (their stacks through py-spy and the last NCCL collective from torch's
flight recorder), started and read through the node agent as ``meshkit train``/``diagnose`` do.
Exit 0 only if every check passed."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

import meshkit as package
from meshkit.hostfile import Host
from meshkit.job import Job
from meshkit.node import doctor, gpu_readings, gpus
from meshkit.outcome import Outcome
from meshkit.protocol import (
    DiagnoseReply,
    DiagnoseRequest,
    Reply,
    Request,
    StartReply,
    StartRequest,
    StopRequest,
    decode_reply,
    encode_request,
    op_of,
)

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
PACKAGE = Path(package.__file__).resolve().parent
# The meshkit under test is the one this check imported: this checkout's source (its
# subprocesses then get the checkout on PYTHONPATH too), or an installed wheel.
FROM_CHECKOUT = PACKAGE.parent == ROOT
failed: list[str] = []


def check(name: str, ok: bool, detail: object = "") -> None:
    print(f"{'ok  ' if ok else 'FAIL'} {name}: {detail}", flush=True)
    if not ok:
        failed.append(name)


def meshkit(*args: str, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    if FROM_CHECKOUT:
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    return subprocess.run(
        [sys.executable, "-m", "meshkit", *args],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, check=False,
    )  # fmt: skip


def main() -> int:
    cuda = torch.cuda.device_count()
    smi = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, check=False)
    where = "this checkout" if FROM_CHECKOUT else "installed"
    print(f"meshkit {package.__version__} from {PACKAGE} ({where})")
    print(f"torch {torch.__version__}, cuda {torch.version.cuda}, devices {cuda}")
    print(smi.stdout.strip())
    check("torch sees a GPU", cuda >= 1, cuda)
    if not FROM_CHECKOUT:
        script = shutil.which("meshkit")
        if script is None:
            check("the installed console script runs", False, "no meshkit on PATH")
        else:
            out = subprocess.run([script, "--version"], capture_output=True, text=True)
            check("the installed console script runs", out.returncode == 0, out.stdout.strip())

    # --- counting: /proc/driver/nvidia, nvidia-smi, CUDA_VISIBLE_DEVICES
    saved = os.environ.pop("CUDA_VISIBLE_DEVICES", None)
    check("gpu_count() (driver's /proc entries, else nvidia-smi)", gpus.gpu_count() == cuda,
          gpus.gpu_count())  # fmt: skip
    listdir = os.listdir

    def no_proc(path: str) -> list[str]:
        if str(path).startswith("/proc/driver/nvidia"):
            raise FileNotFoundError(path)
        return listdir(path)

    os.listdir = no_proc  # type: ignore[assignment]
    try:
        check("gpu_count() through nvidia-smi -L", gpus.gpu_count() == cuda, gpus.gpu_count())
    finally:
        os.listdir = listdir
    for visible, want in (("", 0), ("-1", 0), ("0", 1), ("0,1", 2)):
        os.environ["CUDA_VISIBLE_DEVICES"] = visible
        check(f"gpu_count() with CUDA_VISIBLE_DEVICES={visible!r}", gpus.gpu_count() == want,
              gpus.gpu_count())  # fmt: skip
    os.environ.pop("CUDA_VISIBLE_DEVICES")
    if saved is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = saved

    # --- top's GPU fields: NVML (through ctypes) and nvidia-smi agree, and read plausibly
    library = gpu_readings.nvml()
    raw = gpu_readings.read_nvml(library) if library else []
    by_nvml = [gpu_readings.decode_nvml(readings) for readings in raw]
    by_smi = gpu_readings.read_smi() or []
    check("top: NVML and nvidia-smi read the same GPUs", len(by_nvml) == len(by_smi) >= 1,
          f"{len(by_nvml)} through NVML, {len(by_smi)} through nvidia-smi")  # fmt: skip
    check("top: read_gpus() reads through NVML", gpu_readings.read_gpus().source == "nvml")
    totals = []
    for through_nvml, through_smi in zip(by_nvml, by_smi):
        totals.append(
            ((through_nvml.memory_total or 0) >> 20, (through_smi.memory_total or 0) >> 20)
        )
    check("top: NVML and nvidia-smi give each GPU's memory alike (MiB)",
          all(nvml_mib == smi_mib for nvml_mib, smi_mib in totals), totals)  # fmt: skip
    for way, readings in (("NVML", by_nvml), ("nvidia-smi", by_smi)):
        check(f"top: {way} gives every GPU's memory, utilisation and power plausibly",
              all((gpu.memory_total or 0) > 0 and 0 <= (gpu.utilization or 0) <= 100
                  and (gpu.power or 0) > 0 for gpu in readings), readings)  # fmt: skip

    check_health(cuda)

    # --- the doctor's versions, read from dist-info without importing torch
    check("doctor torch_cuda() == torch.version.cuda", doctor.torch_cuda() == torch.version.cuda,
          doctor.torch_cuda())  # fmt: skip
    nccl = ".".join(map(str, torch.cuda.nccl.version()))
    found = doctor.nccl_version()
    check("doctor nccl_version() matches torch's NCCL", bool(found) and found.startswith(nccl),
          f"{found} (torch: {nccl})")  # fmt: skip

    # --- discovery and init_distributed on this node, as a one-node hostfile
    address = subprocess.run(["hostname", "-I"], capture_output=True, text=True).stdout.split()
    work = Path(tempfile.mkdtemp(prefix="meshkit-gpu-"))
    hostfile = work / "hostfile"
    hostfile.write_text(f"{address[0] if address else '127.0.0.1'}\n")
    shutil.copy(HERE / "gpu_worker.py", work / "gpu_worker.py")
    shutil.copy(PACKAGE / "templates" / "example_train.py", work / "example_train.py")
    out = meshkit(
        "env", "--hostfile", str(hostfile), "--nproc-per-node", "auto", "--json", cwd=work
    )
    env = json.loads(out.stdout) if out.returncode == 0 else {}
    check(
        "meshkit env --nproc-per-node auto gives the GPU count",
        str(env.get("NPROC_PER_NODE")) == str(cuda),
        out.stdout.strip() or out.stderr.strip(),
    )
    torchrun = shutil.which("torchrun") or f"{sys.executable} -m torch.distributed.run"
    worker = f"{sys.executable} gpu_worker.py {hostfile}"
    for label, cmd, spawn in (
        ("under torchrun", f"{torchrun} gpu_worker.py {hostfile}", []),
        ("without torchrun (meshkit's own store)", worker, []),
        ("spawned by meshkit run --spawn (a process per GPU, no torchrun)", worker, ["--spawn"]),
    ):
        out = meshkit("run", *spawn, "--hostfile", str(hostfile), "--nproc-per-node", "auto",
                      "--cmd", cmd, cwd=work)  # fmt: skip
        lines = [x for x in out.stdout.splitlines() if x.startswith("gpu-worker")]
        # nproc auto: a process per GPU under torchrun and --spawn; one process without
        world = cuda if "torchrun" in label or spawn else 1
        want = f"world={world} backend=nccl"
        good = out.returncode == 0 and len(lines) == world and all(want in x for x in lines)
        good = good and all(f"sum={world * (world + 1) // 2} " in x for x in lines)
        check(f"init_distributed nccl {label}", good,
              "; ".join(lines) or out.stdout[-600:] + out.stderr[-1500:])  # fmt: skip
    out = meshkit("run", "--hostfile", str(hostfile), "--cmd", f"{torchrun} example_train.py",
                  cwd=work)  # fmt: skip
    check("the example job on a GPU node", out.returncode == 0 and "ok=True" in out.stdout,
          (out.stdout[-400:] + out.stderr[-1500:]).strip())  # fmt: skip
    out = meshkit("run", "--spawn", "--hostfile", str(hostfile), "--nproc-per-node", "auto",
                  "--cmd", f"{sys.executable} example_train.py", cwd=work)  # fmt: skip
    check("the example job spawned (train --spawn's node side), a rank per GPU",
          out.returncode == 0 and out.stdout.count("ok=True") == cuda,
          (out.stdout[-400:] + out.stderr[-1500:]).strip())  # fmt: skip
    probe = PACKAGE / "templates" / "collective_probe.py"
    out = meshkit(
        "run", "--hostfile", str(hostfile), "--cmd", f"{sys.executable} {probe}", cwd=work
    )
    check("the doctor's collective probe picks nccl and sums right",
          out.returncode == 0 and "backend=nccl" in out.stdout and "ok=True" in out.stdout,
          (out.stdout[-400:] + out.stderr[-1500:]).strip())  # fmt: skip
    check_diagnose(cuda, work, hostfile)
    show_top(cuda, work, hostfile, address[0] if address else "127.0.0.1")
    print(f"\n{'all checks passed' if not failed else 'FAILED: ' + ', '.join(failed)}")
    return 1 if failed else 0


# A rank that enters three NCCL all_reduces, then waits in time.sleep (line 9): diagnose must
# read its stack there and its flight recorder's last collective.
def check_health(cuda: int) -> None:
    """Issue 44: the node's health readers on a real GPU host: NVML's health fields (and
    nvidia-smi's, with the fixed query), and the kernel log as root."""
    from meshkit.node import gpu_health, kernel_log
    from meshkit.node.health import read_health
    from meshkit.protocol import HealthRequest

    with tempfile.TemporaryDirectory() as work:
        verdict = read_health(HealthRequest(work, gpus=cuda))
    sources = {read.source: read for read in verdict.sources}
    gpu = sources["gpu"]
    check("health: GPUs read through NVML, no error", (gpu.via, gpu.error) == ("nvml", None),
          gpu)  # fmt: skip
    read = gpu_health.read_gpu_health()
    check("health: NVML reads every GPU's health fields", len(read.gpus) == cuda > 0
          and all(item.width is not None and item.width_max is not None for item in read.gpus),
          read.gpus)  # fmt: skip
    by_smi = gpu_health.read_smi_health() or []
    check("health: nvidia-smi answers SMI_HEALTH_QUERY for every GPU", len(by_smi) == cuda,
          by_smi)  # fmt: skip
    kernel = sources["kernel"]
    as_root = os.getuid() == 0
    check("health: the kernel log (/dev/kmsg) read as root, no error",
          not as_root or kernel.error is None, kernel)  # fmt: skip
    lines = kernel_log.read_kernel_log()
    check("health: /dev/kmsg gives records", not as_root or
          len(kernel_log.parse_records(lines.lines)) > 0, len(lines.lines))  # fmt: skip
    check("health: no GPU fault found on this host", verdict.state != "unhealthy",
          verdict.as_json())  # fmt: skip


HANG = """import sys, time
import torch
import torch.distributed as dist
from meshkit.torch import init_distributed
place = init_distributed(hostfile=sys.argv[1], timeout=60)
for _ in range(3):
    dist.all_reduce(torch.ones(1, device="cuda"))
torch.cuda.synchronize(); print("entered", flush=True)
time.sleep(120)
"""


def start_agent(work: Path) -> tuple[subprocess.Popen[str], Callable[[Request], Reply]]:
    """A node agent, as the controller's SSH login starts one, and a function that asks it."""
    env = dict(os.environ)
    if FROM_CHECKOUT:
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    agent = subprocess.Popen(
        [sys.executable, "-m", "meshkit.node", "serve"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=work,
    )  # fmt: skip

    def ask(request: Request) -> Reply:
        assert agent.stdin is not None and agent.stdout is not None
        agent.stdin.write(encode_request(request))
        agent.stdin.flush()
        return decode_reply(op_of(request), agent.stdout.readline())

    return agent, ask


def stop_agent(agent: subprocess.Popen[str]) -> None:
    assert agent.stdin is not None
    agent.stdin.close()
    agent.wait(10)


def check_diagnose(cuda: int, work: Path, hostfile: Path) -> None:
    """The node agent starts a spawned NCCL job (a rank per GPU) and diagnoses it: every rank's
    stack read by py-spy, waiting in the script's sleep, and the flight recorder's last
    collective an nccl all_reduce, sequence 3 or more."""
    (work / "gpu_hang.py").write_text(HANG)
    job = Job(
        f"{sys.executable} gpu_hang.py {hostfile}",
        str(work),
        "meshkit-gpu-diagnose",
        str(hostfile),
        sys.executable,
        29531,
        nproc_per_node=cuda,
        spawn=True,
        env={"MESHKIT_NODE_RANK": "0"},
    )
    agent, ask = start_agent(work)
    found: DiagnoseReply | None = None
    try:
        started = ask(StartRequest(job.node_job()))
        check("the agent starts a spawned NCCL job", isinstance(started, StartReply)
              and started.started, started)  # fmt: skip
        request = DiagnoseRequest(job.id, str(job.home), job.log(0), seconds=20.0)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            reply = ask(request)
            assert isinstance(reply, DiagnoseReply), reply
            found = reply
            ready = len(reply.ranks) == cuda and all(
                rank.frames and rank.frames[-1].endswith("gpu_hang.py:9)") and rank.seq
                for rank in reply.ranks
            )  # fmt: skip
            if ready or reply.state in ("exited", "failed"):
                break
            time.sleep(1)
        ranks = found.ranks if found is not None else []
        stacks = [(rank.rank, rank.frames[-1:] or rank.error) for rank in ranks]
        check("diagnose reads every GPU rank's stack (py-spy)", len(ranks) == cuda and all(
            rank.error is None and rank.frames[-1].endswith("gpu_hang.py:9)") for rank in ranks
        ), stacks or found)  # fmt: skip
        recorded = [(rank.rank, rank.seq, rank.collective) for rank in ranks]
        check("the flight recorder names each rank's last NCCL collective", bool(ranks) and all(
            (rank.seq or 0) >= 3 and "nccl:all_reduce" in (rank.collective or "")
            for rank in ranks
        ), recorded)  # fmt: skip
    finally:
        with_stop = ask(StopRequest(job.id))
        print(f"stopped: {with_stop}")
        stop_agent(agent)


# Every GPU busy with matrix products for BUSY_SECONDS, a rank per GPU: what top's screen shows.
BUSY_SECONDS = 40
BUSY = f"""import sys, time
import torch
from meshkit.torch import init_distributed
init_distributed(hostfile=sys.argv[1], timeout=60)
a = torch.randn(8192, 8192, device="cuda")
end = time.monotonic() + {BUSY_SECONDS}
while time.monotonic() < end:
    a = (a @ a).clamp_(-1, 1)
    torch.cuda.synchronize()
print("busy done", flush=True)
"""


class AgentPool:
    """One node's agent as ``ops.top.Watch``'s pool: the node side answers for real, over the
    real protocol, without an SSH login (the GPU machine has no sshd)."""

    def __init__(self, ask: Callable[[Request], Reply]) -> None:
        self.ask = ask
        self.failures: dict[Host, str] = {}

    def call_all(
        self,
        phase: str,
        request_for: Callable[[Host], Request | None],
        expect: type[Reply],
        hosts: Sequence[Host] | None = None,
        timeout: float | None = None,
    ) -> dict[Host, Outcome[Reply]]:
        outcomes: dict[Host, Outcome[Reply]] = {}
        for host in hosts or []:
            request = request_for(host)
            if request is not None:
                outcomes[host] = Outcome(self.ask(request))
        return outcomes


def show_top(cuda: int, work: Path, hostfile: Path, address: str) -> None:
    """``meshkit top --gpus``'s screen of this node while a job keeps every GPU busy: the real
    screen in DESIGN.md's top section. The samples come from the node agent (NVML through
    ctypes); the table is the CLI's own plain text."""
    from meshkit.cli.tasks.top import plain
    from meshkit.ops.top import Watch

    (work / "gpu_busy.py").write_text(BUSY)
    job = Job(
        f"{sys.executable} gpu_busy.py {hostfile}",
        str(work),
        "meshkit-gpu-top",
        str(hostfile),
        sys.executable,
        29541,
        nproc_per_node=cuda,
        spawn=True,
    )
    agent, ask = start_agent(work)
    try:
        started = ask(StartRequest(job.node_job()))
        check("the agent starts a GPU-busy job for top", isinstance(started, StartReply)
              and started.started, started)  # fmt: skip
        time.sleep(15)  # CUDA start-up and the first products
        watch = Watch(AgentPool(ask), [Host(address, slots=cuda)], job, interval=2.0,  # type: ignore[arg-type]
                      reconnect_down=False)  # fmt: skip
        snapshot = watch.snapshot()
        for _ in range(5):
            time.sleep(2)
            snapshot = watch.snapshot()
        print("\n--- meshkit top --gpus (this node; a job keeps every GPU busy)")
        print(plain(snapshot, per_gpu=True))
        print("---")
        view = snapshot.nodes[0]
        sample = view.sample
        gpus = sample.gpus if sample is not None else []
        busy = [gpu.utilization for gpu in gpus]
        check("top: every GPU busy under the job", len(gpus) >= cuda and all(
            (value or 0) > 50 for value in busy[:cuda]), busy)  # fmt: skip
        ranks = sample.ranks if sample is not None else []
        check("top: the job's ranks with their CPU and memory", len(ranks) == cuda, ranks)
    finally:
        print(f"stopped: {ask(StopRequest(job.id))}")
        stop_agent(agent)


if __name__ == "__main__":
    sys.exit(main())
