"""A sandbox node's faults: what makes it unhealthy through the sources a real node's health is
read from, and well again, node by node, without changing the readers.

Each node has, privately:

- a kernel log (``kmsg``: the node's /dev/kmsg, bound at boot) that an XID or an OOM kill is
  appended to;
- GPUs through ``nvidia-smi``: the fake (``fake_smi``) and its state in the node's ``faults/sbin``,
  which the node sees over /usr/local/sbin (root's default PATH) and, where it is empty here,
  /usr/games (other users'); only a node given GPUs has them, as GPU counts change defaults;
- an InfiniBand port: ``faults/infiniband`` seen at /sys/class/infiniband (a tmpfs over the
  node's /sys/class with this machine's entries bound back, so that /sys/class/net stays);
- a full disk: a small tmpfs over the path holding a copy of its files, about 1 MiB free.

The node sees its own ``faults/`` at ``<sandbox>/faults`` (bound at boot, as its ~/.ssh is): the
nodes' directories themselves are hidden from the nodes. The mounts are made live in the node's
own mount namespace (``nsenter``) and die with it; the state (``faults.json`` in the node's
directory) is this machine's. A reboot empties the kernel log, as a real one does, and keeps what
is of the machine: its GPUs, its port, its full disk (``restore`` mounts them again).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..errors import SandboxError
from ..node.infiniband import ERROR_COUNTERS
from . import fake_smi, kmsg
from .layout import Layout, Node
from .networks import silent
from .nodes import node_exec
from .system import netns_pids

FAULTS = "faults"  # in each node's directory, and the sandbox's (where the node sees its own)
STATE = "faults.json"  # in the node's directory: this machine's record of the node's faults
KMSG = "kmsg"
# Where the fake nvidia-smi is found: root's default PATH (sshd's) has /usr/local/sbin, other
# users' /usr/games. Each must be empty here: the node's own directory hides what is there.
PROGRAM_DIRS = ("/usr/local/sbin", "/usr/games")
IB_DEVICE = "mlx5_0"
IB_PORT = "1"
IB_COUNTERS = ERROR_COUNTERS  # the ones the node's health reader watches rise
IB_DATA_COUNTERS = ("port_rcv_data", "port_xmit_data")
IB_STATES = {"ACTIVE": ("4: ACTIVE", "5: LinkUp"), "DOWN": ("1: DOWN", "3: Disabled")}
DISK_FREE_KIB = 1024  # what a full disk keeps free: below any sane health threshold
DISK_COPY_MAX_KIB = 256 * 1024  # a full disk holds a copy of the path's files, in memory
PROCESS = "python"  # the process an XID or OOM kill names
DEFAULT_PID = 4242
PCI = re.compile(r"[0-9a-fA-F]{4,8}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}(\.[0-7])?")


@dataclass(frozen=True)
class Fault:
    """What to do to a node (``clear`` first, then the rest in this order)."""

    clear: bool = False
    gpus: int | None = None  # install the fake with this many GPUs (fewer later: GPUs lost)
    ecc: int | None = None  # uncorrected ECC errors on GPU 0
    xid: int | None = None
    pci: str | None = None  # the XID's GPU (default: GPU 0's address)
    oom: bool = False
    pid: int = DEFAULT_PID  # the process an XID or OOM kill names
    ib_down: bool = False
    ib_errors: int | None = None  # added to every error counter of the port
    disk_full: str | None = None  # an absolute path in the node


@dataclass
class NodeFaults:
    """A node's faults now (this machine's record; ``kernel_log``: the node's /dev/kmsg)."""

    node: str
    gpus: int | None = None
    ecc: int = 0
    ib_state: str | None = None  # None: no InfiniBand
    ib_counters: dict[str, int] = field(default_factory=dict)
    disk_full: list[str] = field(default_factory=list)
    kernel_log: list[str] = field(default_factory=list)

    def as_json(self) -> dict[str, object]:
        return asdict(self)


def faults_dir(sandbox: Layout, node: Node) -> Path:
    return sandbox.node_dir(node) / FAULTS


def kmsg_path(sandbox: Layout, node: Node) -> Path:
    return sandbox.node_dir(node) / KMSG


def prepare(sandbox: Layout, node: Node) -> None:
    """A node's empty kernel log and fault directories, before it first boots; the sandbox's
    ``faults`` mount point."""
    for directory in (sandbox.root / FAULTS, faults_dir(sandbox, node)):
        directory.mkdir(mode=0o755, exist_ok=True)
        directory.chmod(0o755)  # the fake is trusted only in a directory no other user writes
    for sub in ("sbin", "infiniband"):
        (faults_dir(sandbox, node) / sub).mkdir(mode=0o755, exist_ok=True)
        (faults_dir(sandbox, node) / sub).chmod(0o755)
    kmsg.create(kmsg_path(sandbox, node))


def read(sandbox: Layout, node: Node) -> NodeFaults:
    """The node's faults as recorded, and its kernel log."""
    found = NodeFaults(node.name)
    try:
        data = json.loads((sandbox.node_dir(node) / STATE).read_text())
    except (OSError, ValueError):
        data = {}
    if isinstance(data, dict):
        gpus = data.get("gpus")
        found.gpus = gpus if isinstance(gpus, int) else None
        found.ecc = int(data.get("ecc") or 0)
        state = data.get("ib_state")
        found.ib_state = state if state in IB_STATES else None
        counters = data.get("ib_counters")
        if isinstance(counters, dict):
            found.ib_counters = {str(name): int(value) for name, value in counters.items()}
        paths = data.get("disk_full")
        if isinstance(paths, list):
            found.disk_full = [str(path) for path in paths]
    try:
        found.kernel_log = kmsg_path(sandbox, node).read_text(errors="replace").splitlines()
    except OSError:
        found.kernel_log = []
    return found


def _save(sandbox: Layout, node: Node, faults: NodeFaults) -> None:
    record = asdict(faults)
    del record["kernel_log"]
    path = sandbox.node_dir(node) / STATE
    path.with_suffix(".tmp").write_text(json.dumps(record))
    os.replace(path.with_suffix(".tmp"), path)


def fault(sandbox: Layout, index: int, change: Fault) -> NodeFaults:
    """Apply ``change`` to node ``index`` (on, and booted with its own kernel log); returns the
    node's faults after it."""
    node = sandbox.node(index)
    _check(sandbox, node, change)
    faults = read(sandbox, node)
    if change.clear:
        _clear(sandbox, node, faults)
        faults = NodeFaults(node.name)
    if change.gpus is not None:
        faults.gpus = change.gpus
    if change.ecc is not None:
        faults.ecc = change.ecc
    if change.gpus is not None or change.ecc is not None:
        _write_gpus(sandbox, node, faults)
        _save(sandbox, node, faults)
        _mount_gpus(sandbox, node)
    if change.xid is not None:
        pci = change.pci or fake_smi.short_pci(0)
        message = kmsg.xid_message(change.xid, pci, change.pid, PROCESS)
        kmsg.append(kmsg_path(sandbox, node), kmsg.WARNING, message)
    if change.oom:
        kmsg.append(kmsg_path(sandbox, node), kmsg.ERROR, kmsg.oom_message(change.pid, PROCESS))
    if change.ib_down or change.ib_errors is not None:
        _change_ib(faults, change)
        _write_ib(sandbox, node, faults)
        _save(sandbox, node, faults)
        _mount_ib(sandbox, node)
    if change.disk_full is not None:
        _fill(node, change.disk_full)
        if change.disk_full not in faults.disk_full:
            faults.disk_full.append(change.disk_full)
        _save(sandbox, node, faults)
    if change.clear:
        _save(sandbox, node, faults)
    return read(sandbox, node)


def _check(sandbox: Layout, node: Node, change: Fault) -> None:
    """Refuse what cannot be done, before anything is (what, and the fix)."""
    if silent(node) or not netns_pids(node.netns):
        raise SandboxError(
            f"{node.name} is off; switch it on first: meshkit sandbox.poweron --node {node.index}"
        )
    if not kmsg_path(sandbox, node).exists():
        raise SandboxError(
            f"{node.name} has no kernel log of its own (a sandbox made before faults); "
            "re-create the sandbox: meshkit sandbox.up"
        )
    for name in ("gpus", "ecc", "xid", "ib_errors"):
        value = getattr(change, name)
        if value is not None and value < 0:
            raise SandboxError(f"--{name.replace('_', '-')} {value}: give a number, 0 or more")
    gpus = change.gpus
    if gpus is None and not change.clear:
        gpus = read(sandbox, node).gpus
    if change.ecc is not None and not gpus:
        raise SandboxError(
            f"{node.name} has no GPUs to have ECC errors; give it some: --gpus N --ecc {change.ecc}"
        )
    if change.gpus is not None and change.gpus > 64:
        raise SandboxError(f"--gpus {change.gpus}: at most 64")
    if change.gpus is not None:
        _check_program_dir()
    if change.pci is not None and not PCI.fullmatch(change.pci):
        raise SandboxError(f"--pci {change.pci[:40]!r}: give a PCI address, e.g. 0000:3b:00")
    if change.disk_full is not None and not change.disk_full.startswith("/"):
        raise SandboxError(f"--disk-full {change.disk_full}: give an absolute path in the node")
    if change.disk_full is not None:
        _in_node(node, IS_DIRECTORY, change.disk_full)


def _check_program_dir() -> None:
    first = PROGRAM_DIRS[0]
    try:
        present = sorted(os.listdir(first))
    except OSError:
        raise SandboxError(
            f"{first} is missing on this machine: the fake nvidia-smi is mounted over it"
        ) from None
    if present:
        shown = ", ".join(present[:5])
        raise SandboxError(
            f"{first} on this machine is not empty ({shown}): a node given GPUs sees its own "
            f"nvidia-smi there, which would hide them; move them to /usr/local/bin"
        )


def _program_dirs() -> list[str]:
    """The PATH directories the fake is mounted over: /usr/local/sbin, and /usr/games where it
    is empty here."""
    chosen = [PROGRAM_DIRS[0]]
    for directory in PROGRAM_DIRS[1:]:
        try:
            if not os.listdir(directory):
                chosen.append(directory)
        except OSError:
            continue
    return chosen


def _in_node(node: Node, script: str, *args: str) -> str:
    """Run ``script`` under sh inside the node, its data as positional arguments only."""
    done = node_exec(node, ["sh", "-c", script, "meshkit-fault", *args])
    if done.returncode != 0:
        why = done.stderr.strip() or done.stdout.strip()
        raise SandboxError(f"{node.name}: {why}")
    return done.stdout


def _write_gpus(sandbox: Layout, node: Node, faults: NodeFaults) -> None:
    """The fake and its state in the node's program directory (root's, 0755, as
    ``gpus.trusted_program`` wants it); the interpreter by absolute path."""
    sbin = faults_dir(sandbox, node) / "sbin"
    state = fake_smi.gpus_state(node.name, faults.gpus or 0, faults.ecc)
    _replace(sbin / fake_smi.STATE_FILE, json.dumps(state), 0o644)
    interpreter = "/usr/bin/python3"
    if not Path(interpreter).exists():
        interpreter = os.path.realpath(sys.executable)
    source = Path(fake_smi.__file__).read_text()
    _replace(sbin / "nvidia-smi", f"#!{interpreter} -I\n{source}", 0o755)


def _replace(path: Path, text: str, mode: int) -> None:
    """Write ``path`` whole, so that a reader never sees half of it."""
    temporary = path.with_name(f".{path.name}.tmp")
    temporary.write_text(text)
    temporary.chmod(mode)
    os.replace(temporary, path)


# A directory is the node's own once it is the same inode as its source (not mounted twice).
MOUNT_PROGRAMS = r"""
set -e
source=$1
shift
for directory in "$@"; do
  if [ "$(stat -c %d:%i "$directory")" != "$(stat -c %d:%i "$source")" ]; then
    mount --bind "$source" "$directory"
  fi
done
"""


def _mount_gpus(sandbox: Layout, node: Node) -> None:
    source = str(sandbox.root / FAULTS / "sbin")
    _in_node(node, MOUNT_PROGRAMS, source, *_program_dirs())


# /sys/class rebuilt on a tmpfs beside, with every entry of this machine's bound back and the
# node's InfiniBand added, then moved over /sys/class at once (never seen half built).
MOUNT_IB = r"""
set -e
source=$1
if [ "$(findmnt -n -o SOURCE --mountpoint /sys/class)" = meshkit-sysclass ]; then exit 0; fi
built=$(mktemp -d /tmp/.meshkit-sysclass.XXXXXX)
mount -t tmpfs -o size=1m,mode=755 meshkit-sysclass "$built"
for entry in /sys/class/*; do
  name=${entry##*/}
  mkdir "$built/$name"
  mount --bind "$entry" "$built/$name"
done
mkdir -p "$built/infiniband"
mount --bind "$source" "$built/infiniband"
mount --move "$built" /sys/class
rmdir "$built"
"""


def _mount_ib(sandbox: Layout, node: Node) -> None:
    _in_node(node, MOUNT_IB, str(sandbox.root / FAULTS / "infiniband"))


def _change_ib(faults: NodeFaults, change: Fault) -> None:
    if faults.ib_state is None:
        faults.ib_state = "ACTIVE"
        faults.ib_counters = {name: 0 for name in IB_COUNTERS}
    if change.ib_down:
        if faults.ib_state != "DOWN":
            faults.ib_counters["link_downed"] = faults.ib_counters.get("link_downed", 0) + 1
        faults.ib_state = "DOWN"
    if change.ib_errors:
        for name in IB_COUNTERS:
            faults.ib_counters[name] = faults.ib_counters.get(name, 0) + change.ib_errors


def _write_ib(sandbox: Layout, node: Node, faults: NodeFaults) -> None:
    """The port's files as the kernel shows them: ``4: ACTIVE``, a counter a number a line."""
    port = faults_dir(sandbox, node) / "infiniband" / IB_DEVICE / "ports" / IB_PORT
    (port / "counters").mkdir(parents=True, exist_ok=True)
    state, physical = IB_STATES[faults.ib_state or "ACTIVE"]
    _replace(port / "state", f"{state}\n", 0o444)
    _replace(port / "phys_state", f"{physical}\n", 0o444)
    _replace(port / "rate", "400 Gb/sec (4X NDR)\n", 0o444)
    for name in IB_COUNTERS:
        _replace(port / "counters" / name, f"{faults.ib_counters.get(name, 0)}\n", 0o444)
    for name in IB_DATA_COUNTERS:  # top's rates: an idle port
        _replace(port / "counters" / name, "0\n", 0o444)


IS_DIRECTORY = r"""
[ -d "$1" ] || { echo "--disk-full $1: no such directory on this node" >&2; exit 1; }
"""


# A tmpfs sized to the path's files plus FREE KiB, a copy of them in it, moved over the path.
FILL = r"""
set -e
path=$1 free=$2 most=$3
[ -d "$path" ] || { echo "--disk-full $path: no such directory on this node" >&2; exit 1; }
if [ "$(findmnt -n -o SOURCE --mountpoint "$path")" = meshkit-diskfull ]; then exit 0; fi
used=$(du -skx "$path" | cut -f1)
if [ "$used" -gt "$most" ]; then
  echo "--disk-full $path: its $used KiB of files are more than the $most KiB copied to memory;" \
    "give a smaller directory (the job's workdir)" >&2
  exit 1
fi
built=$(mktemp -d /tmp/.meshkit-diskfull.XXXXXX)
mount -t tmpfs -o size=$((used * 2 + free + 1024))k meshkit-diskfull "$built"
cp -a "$path"/. "$built"/
chown --reference="$path" "$built"
chmod --reference="$path" "$built"
taken=$(df -k --output=used "$built" | tail -n 1 | tr -d ' ')
mount -o remount,size=$((taken + free))k "$built"
mount --move "$built" "$path"
rmdir "$built"
"""


def _fill(node: Node, path: str) -> None:
    _in_node(node, FILL, path, str(DISK_FREE_KIB), str(DISK_COPY_MAX_KIB))


# Everything the faults mounted in the node, undone (what is not there is skipped).
UNDO = r"""
source=$1
shift
for directory in "$@"; do
  if [ "$(stat -c %d:%i "$directory")" = "$(stat -c %d:%i "$source")" ]; then
    umount -l "$directory"
  fi
done
if [ "$(findmnt -n -o SOURCE --mountpoint /sys/class)" = meshkit-sysclass ]; then
  umount -R -l /sys/class
fi
findmnt -rn -o SOURCE,TARGET -t tmpfs | while read -r name target; do
  if [ "$name" = meshkit-diskfull ]; then umount -l "$(printf '%b' "$target")"; fi
done
"""


def _clear(sandbox: Layout, node: Node, faults: NodeFaults) -> None:
    """The node well again: an empty kernel log, no GPUs, no InfiniBand, its disks as they
    were (what was written to a full one meanwhile is gone with it)."""
    _in_node(node, UNDO, str(sandbox.root / FAULTS / "sbin"), *PROGRAM_DIRS)
    kmsg.create(kmsg_path(sandbox, node))
    for sub in ("sbin", "infiniband"):
        directory = faults_dir(sandbox, node) / sub
        shutil.rmtree(directory)
        directory.mkdir(mode=0o755)
        directory.chmod(0o755)


def booted(sandbox: Layout, node: Node) -> None:
    """Before a node boots again: its kernel log empty, as after a real reboot."""
    kmsg.create(kmsg_path(sandbox, node))


def restore(sandbox: Layout, node: Node) -> None:
    """After a node booted: what of its faults is the machine's (its GPUs, its port, its full
    disks) mounted again in its fresh namespaces."""
    faults = read(sandbox, node)
    if faults.gpus is not None:
        _mount_gpus(sandbox, node)
    if faults.ib_state is not None:
        _mount_ib(sandbox, node)
    kept = []
    for path in faults.disk_full:
        # A path gone meanwhile (a workdir removed) is no longer full; the reboot goes on.
        try:
            _fill(node, path)
        except SandboxError:
            continue
        kept.append(path)
    if kept != faults.disk_full:
        faults.disk_full = kept
        _save(sandbox, node, faults)
