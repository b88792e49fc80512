"""``sandbox.fault``: a node made unhealthy through its own sources, and well again, node by node:
an XID or an OOM kill in its /dev/kmsg, GPUs lost or erroring through its nvidia-smi, its
InfiniBand port down, a full disk. The pure parts (the kernel log's records, the fake
nvidia-smi's answers) here; then on a sandbox of two nodes, each fault seen from inside node 1
through the real path, and not from node 0."""

from __future__ import annotations

import json
import shlex
import subprocess
import time
from collections.abc import Iterator

import pytest
from conftest import MESHKIT, fresh_sandbox, sandbox_dir, sandbox_name, ssh
from helpers.other_user import as_user

from meshkit import sandbox
from meshkit.errors import SandboxError
from meshkit.node.gpu_readings import SMI_FIELDS, parse_smi
from meshkit.sandbox import fake_smi, kmsg

SANDBOX_NODES = 2
HEALTH_QUERY = (
    "--query-gpu=index,pci.bus_id,ecc.errors.uncorrected.volatile.total,remapped_rows.pending,"
    "remapped_rows.failure,retired_pages.pending,pcie.link.width.current,pcie.link.width.max,"
    "pcie.link.gen.current,pcie.link.gen.max,clocks_throttle_reasons.hw_slowdown,"
    "clocks_throttle_reasons.hw_thermal_slowdown,clocks_throttle_reasons.sw_thermal_slowdown,"
    "utilization.gpu"
)
CSV = "--format=csv,noheader,nounits"
PORT = "/sys/class/infiniband/mlx5_0/ports/1"


# ---- pure: the kernel log's records --------------------------------------------------------------


def test_a_record_is_in_dev_kmsg_format():
    assert kmsg.record(4, 7, 123456, "hello") == "4,7,123456,-;hello\n"


def test_an_xid_line_is_the_drivers():
    line = kmsg.xid_message(79, "0000:3b:00", 1234, "python")
    assert (
        line == "NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, name=python, GPU has fallen off the bus."
    )
    assert kmsg.xid_message(999, "0000:3b:00", 1, "x").endswith(", Unknown error.")


def test_an_oom_line_names_the_process():
    assert kmsg.oom_message(4242, "python").startswith(
        "Out of memory: Killed process 4242 (python)"
    )


def test_sequence_numbers_follow_the_last_record():
    assert kmsg.next_sequence("") == 0
    log = "4,0,10,-;a\n SUBSYSTEM=pci\n3,5,20,-;b\n"
    assert kmsg.next_sequence(log) == 6


def test_records_are_appended_with_increasing_sequence_and_monotonic_time(tmp_path):
    path = tmp_path / "kmsg"
    kmsg.create(path)
    assert path.stat().st_mode & 0o777 == 0o600
    before = time.clock_gettime(time.CLOCK_MONOTONIC) * 1e6
    kmsg.append(path, kmsg.WARNING, "first")
    kmsg.append(path, kmsg.ERROR, "second")
    after = time.clock_gettime(time.CLOCK_MONOTONIC) * 1e6
    first, second = path.read_text().splitlines()
    assert first.startswith("4,0,") and first.endswith(",-;first")
    assert second.startswith("3,1,") and second.endswith(",-;second")
    assert before <= int(first.split(",")[2]) <= after


# ---- pure: the fake nvidia-smi's answers ---------------------------------------------------------


def gpus(count: int, ecc: int = 0) -> list[dict[str, str]]:
    return fake_smi.gpus_state("node1", count, ecc)["gpus"]


def test_list_gpus_names_each_with_its_own_uuid():
    out = fake_smi.answer(["-L"], gpus(2))
    lines = out.out.splitlines()
    assert out.code == 0 and len(lines) == 2
    assert lines[0].startswith("GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-")
    assert lines[0].split("UUID: ")[1] != lines[1].split("UUID: ")[1]
    # Each node's GPUs are its own.
    other = fake_smi.gpus_state("node0", 1, 0)["gpus"]
    assert fake_smi.list_gpus(other) != fake_smi.list_gpus(gpus(1))


def test_the_health_query_answers_each_field_in_order():
    out = fake_smi.answer([HEALTH_QUERY, CSV], gpus(2, ecc=3))
    rows = [line.split(", ") for line in out.out.splitlines()]
    assert rows[0] == [
        "0",
        "00000000:18:00.0",
        "3",
        "No",
        "No",
        "No",
        "16",
        "16",
        "5",
        "5",
        "Not Active",
        "Not Active",
        "Not Active",
        "0",
    ]
    assert rows[1][:3] == ["1", "00000000:2A:00.0", "0"]


def test_tops_query_parses_as_top_reads_it():
    query = f"--query-gpu={','.join(SMI_FIELDS)}"
    samples = parse_smi(fake_smi.answer([query, CSV], gpus(3)).out)
    assert [sample.index for sample in samples] == [0, 1, 2]
    assert samples[0].name == "NVIDIA H100 80GB HBM3"
    assert samples[0].memory_total == 81559 << 20
    assert samples[0].power_limit == 700.0


def test_an_unknown_field_is_not_available_and_units_and_header_are_shown_when_asked():
    out = fake_smi.answer(["--query-gpu=index,no.such,memory.total", "--format=csv"], gpus(1))
    assert out.out == "index, no.such, memory.total [MiB]\n0, [N/A], 81559 MiB\n"


def test_no_gpu_left_and_bad_arguments_are_refused_as_nvidia_smi_does():
    assert fake_smi.answer(["-L"], []) == fake_smi.Answer("No devices were found\n", "", 6)
    assert fake_smi.answer(["--bogus"], gpus(1)).code == 2
    assert fake_smi.answer(["--query-gpu=index", "--format=xml"], gpus(1)).code == 2
    assert fake_smi.answer(["-i", "1", "-L"], gpus(2)).out.startswith("GPU 1: ")


# ---- on a sandbox: each fault through the real path ----------------------------------------------


@pytest.fixture(scope="module")
def lay() -> Iterator[sandbox.Layout]:
    with fresh_sandbox(sandbox_name(__name__), SANDBOX_NODES, user=True) as created:
        yield created


@pytest.fixture
def clean(lay) -> Iterator[sandbox.Layout]:
    """Both nodes well before and after each test."""
    for index in range(SANDBOX_NODES):
        sandbox.fault(lay, index, clear=True)
    yield lay
    for index in range(SANDBOX_NODES):
        sandbox.fault(lay, index, clear=True)


def on(lay, index: int, line: str) -> subprocess.CompletedProcess[str]:
    """``line`` in a root login on node ``index`` (its sshd's session, its default PATH)."""
    return ssh(lay, f"node{index}", line)


def as_the_user(lay, index: int, line: str) -> subprocess.CompletedProcess[str]:
    """``line`` in a login of the sandbox's ordinary user on node ``index``."""
    argv = ["ssh", "-F", str(lay.user_ssh_config), "-o", "BatchMode=yes", f"node{index}", line]
    return subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)


def python_on(lay, index: int, code: str) -> str:
    import sys

    done = on(lay, index, f"{shlex.quote(sys.executable)} -c {shlex.quote(code)}")
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_kernel_log_is_private_root_only_and_takes_an_xid_and_an_oom_kill(clean):
    lay = clean
    assert on(lay, 1, "cat /dev/kmsg").stdout == ""
    sandbox.fault(lay, 1, xid=79, pci="0000:3b:00")
    state = sandbox.fault(lay, 1, oom=True, pid=777)
    assert len(state.kernel_log) == 2
    seen = on(lay, 1, "cat /dev/kmsg").stdout.splitlines()
    assert seen[0].startswith("4,0,")
    assert seen[0].endswith(
        ",-;NVRM: Xid (PCI:0000:3b:00): 79, pid=4242, name=python, GPU has fallen off the bus."
    )
    assert seen[1].startswith("3,1,") and "Out of memory: Killed process 777 (python)" in seen[1]
    usec = int(seen[0].split(",")[2])
    now = float(on(lay, 1, "cut -d' ' -f1 /proc/uptime").stdout)  # roughly the monotonic clock
    assert abs(usec / 1e6 - now) < 3600
    assert on(lay, 0, "cat /dev/kmsg").stdout == ""
    # Not for another user, as with kernel.dmesg_restrict=1.
    denied = as_the_user(lay, 1, "cat /dev/kmsg")
    assert denied.returncode != 0 and "Permission denied" in denied.stderr
    uid = sandbox.node_exec(lay.nodes[1], [*as_user(sandbox.USER), "cat", "/dev/kmsg"])
    assert uid.returncode != 0


def test_gpus_through_the_nodes_own_nvidia_smi(clean):
    lay = clean
    assert on(lay, 1, "command -v nvidia-smi").returncode != 0
    sandbox.fault(lay, 1, gpus=8)
    listed = on(lay, 1, "nvidia-smi -L").stdout.splitlines()
    assert len(listed) == 8 and listed[0].startswith("GPU 0: NVIDIA H100")
    assert on(lay, 0, "command -v nvidia-smi").returncode != 0  # node 0 has none
    # What the node's readers use: found on PATH and trusted, counted, top's query parsed.
    code = (
        "from meshkit.node.gpus import gpu_count, _on_path; "
        "from meshkit.node.gpu_readings import read_smi; "
        "print(gpu_count(), _on_path('nvidia-smi'), len(read_smi()))"
    )
    assert python_on(lay, 1, code) == "8 /usr/local/sbin/nvidia-smi 8"
    assert python_on(lay, 0, code.replace("len(read_smi())", "read_smi()")) == "0 None None"
    # The user's default PATH finds it too.
    assert len(as_the_user(lay, 1, "nvidia-smi -L").stdout.splitlines()) == 8
    # Fewer GPUs (lost) and ECC errors, through the health query.
    sandbox.fault(lay, 1, gpus=7, ecc=2)
    rows = on(lay, 1, f"nvidia-smi {HEALTH_QUERY} {CSV}").stdout.splitlines()
    assert len(rows) == 7
    assert rows[0].split(", ")[:3] == ["0", "00000000:18:00.0", "2"]
    assert rows[1].split(", ")[2] == "0"
    with pytest.raises(SandboxError, match="no GPUs"):
        sandbox.fault(lay, 0, ecc=1)


def test_an_infiniband_port_down_and_erroring_on_one_node(clean):
    lay = clean
    assert on(lay, 1, "ls /sys/class/infiniband").returncode != 0
    nets_before = on(lay, 1, "ls /sys/class/net").stdout
    sandbox.fault(lay, 1, ib_errors=5)
    assert on(lay, 1, f"cat {PORT}/state").stdout == "4: ACTIVE\n"
    assert on(lay, 1, f"cat {PORT}/counters/symbol_error").stdout == "5\n"
    sandbox.fault(lay, 1, ib_down=True, ib_errors=2)
    assert on(lay, 1, f"cat {PORT}/state").stdout == "1: DOWN\n"
    assert on(lay, 1, f"cat {PORT}/counters/port_rcv_errors").stdout == "7\n"
    assert on(lay, 1, f"cat {PORT}/counters/link_downed").stdout == "8\n"
    # What the node's own readers make of it.
    code = "from meshkit.node.doctor import infiniband; print(infiniband())"
    assert python_on(lay, 1, code) == "['mlx5_0:1 DOWN']"
    assert python_on(lay, 0, code) == "[]"
    # The rest of /sys/class is as it was; node 0 has no InfiniBand.
    assert on(lay, 1, "ls /sys/class/net").stdout == nets_before
    assert on(lay, 1, "ls /sys/class/block").returncode == 0
    assert on(lay, 0, "ls /sys/class/infiniband").returncode != 0


def free_kib(lay, index: int, path: str) -> int:
    out = on(lay, index, f"df -k --output=avail {shlex.quote(path)} | tail -n 1").stdout
    return int(out.strip())


def test_a_full_disk_on_one_node_keeps_the_files(clean):
    lay = clean
    work = lay.shared / "work"
    work.mkdir(exist_ok=True)
    (work / "checkpoint.txt").write_text("step 5\n")
    sandbox.fault(lay, 1, disk_full=str(work))
    assert free_kib(lay, 1, str(work)) < 1024 * 1024
    assert on(lay, 1, f"cat {work}/checkpoint.txt").stdout == "step 5\n"
    assert free_kib(lay, 0, str(work)) > 1024 * 1024
    with pytest.raises(SandboxError, match="no such directory"):
        sandbox.fault(lay, 1, xid=79, disk_full="/no/such/place")
    assert on(lay, 1, "cat /dev/kmsg").stdout == ""  # refused before anything was done
    sandbox.fault(lay, 1, clear=True)
    assert free_kib(lay, 1, str(work)) > 1024 * 1024


def test_clear_makes_the_node_well_and_a_reboot_empties_only_its_kernel_log(clean):
    lay = clean
    sandbox.fault(lay, 1, xid=79, gpus=2, ib_down=True)
    sandbox.reboot(lay, 1)
    assert on(lay, 1, "cat /dev/kmsg").stdout == ""
    assert len(on(lay, 1, "nvidia-smi -L").stdout.splitlines()) == 2
    assert on(lay, 1, f"cat {PORT}/state").stdout == "1: DOWN\n"
    state = sandbox.fault(lay, 1, clear=True)
    assert state.gpus is None and state.ib_state is None and state.kernel_log == []
    assert on(lay, 1, "command -v nvidia-smi").returncode != 0
    assert on(lay, 1, "ls /sys/class/infiniband").returncode != 0
    assert on(lay, 1, "ls /usr/local/sbin").stdout == ""


def test_the_task_prints_the_nodes_faults_and_refuses_bad_input(clean):
    lay = clean
    where = ["--dir", sandbox_dir(lay.name), "--name", lay.name]

    def task(*args: str) -> subprocess.CompletedProcess[str]:
        argv = [*MESHKIT, "sandbox.fault", *args, *where]
        return subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)

    done = task("--node", "1", "--xid", "48", "--json")
    assert done.returncode == 0, done.stderr
    shown = json.loads(done.stdout)
    assert shown["node"] == "node1" and "Xid (PCI:0000:18:00): 48" in shown["kernel_log"][0]
    for bad in (
        ["--node", "1"],
        ["--node", "x", "--oom"],
        ["--node", "1", "--gpus", "-2"],
        ["--node", "1", "--xid", "79", "--pci", "0000:3b:00\n4,9,9,-;forged"],
        ["--node", "1", "--disk-full", "relative/path"],
    ):
        refused = task(*bad)
        assert refused.returncode != 0
        assert "Traceback" not in refused.stderr and refused.stderr.strip()
    assert on(lay, 1, "cat /dev/kmsg").stdout.count("\n") == 1  # nothing more written


def test_a_node_that_is_off_is_refused_and_booted_again_with_its_faults(clean):
    lay = clean
    sandbox.fault(lay, 1, gpus=1, xid=79)
    sandbox.poweroff(lay, 1)
    with pytest.raises(SandboxError, match="poweron"):
        sandbox.fault(lay, 1, oom=True)
    sandbox.poweron(lay, 1)
    assert on(lay, 1, "cat /dev/kmsg").stdout == ""
    assert len(on(lay, 1, "nvidia-smi -L").stdout.splitlines()) == 1
