"""The tools users would pick instead of meshkit, each installed by the benchmark into its own venv
under a cache directory (reused when present) and driven to the same end state as meshkit.

- ansible-core (builtin modules only: shell + blockinfile; forks = N, pipelining, strict host keys
  through the sandbox's ssh_config);
- a skilled parallel bash with ControlMaster (mesh_bash.sh);
- clustershell (``clush -b``) and Debian pdsh (``pdsh -R ssh``) for one round on every node, and
  pdsh running torchrun with ``%n`` ranks (the DeepSpeed way) for a launch;
- torchrunx, launched from node0 (it needs the launcher's hostname to resolve on every node, and
  the nodes' /etc/hosts name only the nodes).
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import sysconfig
from pathlib import Path

CACHE = Path(os.environ.get("MESHKIT_BENCH_PEERS", "/var/tmp/meshkit-bench-peers"))
HERE = Path(__file__).resolve().parent
INSTALL_TIMEOUT = 900

# What each peer's venv gets. torchrunx brings no torch of its own: a .pth file lends it the torch
# (and fabric, numpy) of the interpreter running the benchmark, so both launch the same torch.
PACKAGES: dict[str, tuple[list[str], bool]] = {
    "ansible-core": (["ansible-core"], True),
    "clustershell": (["clustershell"], True),
    "torchrunx": (["torchrunx", "cloudpickle>=3.0"], False),
}


class PeerUnavailable(Exception):
    """A peer could not be installed or found; the message is the skip reason kept in results."""


def venv(peer: str) -> Path:
    return CACHE / peer / "venv"


def install(peer: str) -> Path:
    """The peer's venv, created and filled on first use (bounded in time); its bin directory."""
    env_dir = venv(peer)
    python = env_dir / "bin" / "python"
    marker = env_dir / ".bench-installed"
    packages, with_deps = PACKAGES[peer]
    if marker.exists():
        if not with_deps:
            lend_torch(python)
        return env_dir / "bin"
    try:
        if not python.exists():
            subprocess.run(
                [sys.executable, "-m", "venv", str(env_dir)],
                check=True,
                capture_output=True,
                timeout=INSTALL_TIMEOUT,
            )
        argv = [str(python), "-m", "pip", "install", "-q", *([] if with_deps else ["--no-deps"])]
        subprocess.run(
            [*argv, *packages], check=True, capture_output=True, text=True, timeout=INSTALL_TIMEOUT
        )
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError) as exc:
        detail = getattr(exc, "stderr", "") or ""
        lines = [x for x in str(detail).splitlines() if "WARNING" not in x]
        raise PeerUnavailable(
            f"pip install {' '.join(packages)} failed: {exc} {lines[-1:]}"
        ) from exc
    if not with_deps:
        lend_torch(python)
    marker.write_text("\n".join(packages) + "\n")
    return env_dir / "bin"


def install_meshkit(repo: Path, name: str = "meshkit") -> Path:
    """meshkit as users run it: this checkout's wheel (not editable: an editable install adds a
    finder import to every interpreter start, on every node) in a fresh venv, lent this
    interpreter's dependencies and torch, with a torchrun beside it. Its bin directory.
    ``name``: the venv's directory under the cache (another source tree beside this one)."""
    root = CACHE / name
    subprocess.run(["rm", "-rf", str(root)], check=True, timeout=60)
    dist = root / "dist"
    env_dir = root / "venv"
    python = env_dir / "bin" / "python"
    try:
        subprocess.run(
            [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(dist), str(repo)],
            check=True,
            capture_output=True,
            text=True,
            timeout=INSTALL_TIMEOUT,
        )
        subprocess.run(
            [sys.executable, "-m", "venv", "--without-pip", str(env_dir)],
            check=True,
            capture_output=True,
            timeout=INSTALL_TIMEOUT,
        )
        wheel = next(dist.glob("meshkit-*.whl"))
        pip = [sys.executable, "-m", "pip", "--python", str(python), "install", "-q"]
        subprocess.run(
            [*pip, "--no-deps", str(wheel)],
            check=True,
            capture_output=True,
            text=True,
            timeout=INSTALL_TIMEOUT,
        )
    except (
        subprocess.CalledProcessError,
        subprocess.TimeoutExpired,
        OSError,
        StopIteration,
    ) as exc:
        detail = getattr(exc, "stderr", "") or ""
        raise PeerUnavailable(
            f"building and installing meshkit's wheel failed: {exc} {detail}"
        ) from exc
    lend_torch(python)
    torchrun = env_dir / "bin" / "torchrun"
    torchrun.write_text(
        f"#!{python}\nimport sys\nfrom torch.distributed.run import main\nsys.exit(main())\n"
    )
    torchrun.chmod(0o755)
    spy = Path(sys.executable).parent / "py-spy"  # a dependency's program: lent like torch
    if spy.exists():
        (env_dir / "bin" / "py-spy").symlink_to(spy)
    return env_dir / "bin"


def lend_torch(python: Path) -> None:
    """Point the peer's venv at this interpreter's packages (torch, fabric), on every run: the
    cached venv outlives the interpreter that first lent them."""
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout.strip()
    Path(purelib, "zz_meshkit_bench_torch.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")


def version(argv: list[str]) -> str:
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    except OSError as exc:
        raise PeerUnavailable(f"{argv[0]}: {exc}") from exc
    text = (out.stdout + out.stderr).strip().splitlines()
    if out.returncode != 0 or not text:
        raise PeerUnavailable(f"{shlex.join(argv)} exited {out.returncode}: {text[-1:]}")
    return text[0]


# --- Ansible: the mesh with builtin modules only --------------------------------------------------

PLAYBOOK = """\
- hosts: all
  gather_facts: false
  tasks:
    - name: user key (created if missing) and the host keys sshd serves
      ansible.builtin.shell: |
        test -f ~/.ssh/id_ed25519 || ssh-keygen -q -t ed25519 -N '' -f ~/.ssh/id_ed25519
        cat ~/.ssh/id_ed25519.pub
        cat /etc/ssh/ssh_host_*_key.pub
      register: bench_keys
      changed_when: false
    - name: every user key in every authorized_keys
      ansible.builtin.blockinfile:
        path: /root/.ssh/authorized_keys
        marker: "# {mark} bench ansible mesh"
        mode: "0600"
        block: |
          {% for h in ansible_play_hosts %}
          {{ hostvars[h].bench_keys.stdout_lines[0] }}
          {% endfor %}
    - name: every host key in every known_hosts, by name and address
      ansible.builtin.blockinfile:
        path: /root/.ssh/known_hosts
        create: true
        marker: "# {mark} bench ansible mesh"
        mode: "0644"
        block: |
          {% for h in ansible_play_hosts %}
          {% for k in hostvars[h].bench_keys.stdout_lines[1:] %}
          {{ h }},{{ hostvars[h].ansible_host }} {{ k.split()[:2] | join(' ') }}
          {% endfor %}
          {% endfor %}
"""


def ansible_files(work: Path, names: list[str], addresses: list[str]) -> Path:
    """Write the inventory and playbook under ``work``; the playbook's path."""
    work.mkdir(parents=True, exist_ok=True)
    (work / "inventory.ini").write_text(
        "[all]\n" + "".join(f"{n} ansible_host={a}\n" for n, a in zip(names, addresses))
    )
    (work / "mesh.yml").write_text(PLAYBOOK)
    return work / "mesh.yml"


def ansible_env(work: Path, ssh_config: Path, forks: int) -> dict[str, str]:
    """Forks >= N, pipelining, strict host keys (the ssh_config's known_hosts and
    StrictHostKeyChecking yes), its own control sockets and temp dirs so runs never share state."""
    (work / "cp").mkdir(parents=True, exist_ok=True)
    return {
        **os.environ,
        "ANSIBLE_HOME": str(work / "home"),
        "ANSIBLE_LOCAL_TEMP": str(work / "tmp"),
        "ANSIBLE_REMOTE_TMP": "/tmp/.ansible-bench",
        "ANSIBLE_FORKS": str(forks),
        "ANSIBLE_PIPELINING": "True",
        "ANSIBLE_HOST_KEY_CHECKING": "True",
        "ANSIBLE_SSH_ARGS": (
            f"-F {ssh_config} -o BatchMode=yes -o StrictHostKeyChecking=yes "
            "-o ControlMaster=auto -o ControlPersist=30s"
        ),
        "ANSIBLE_SSH_CONTROL_PATH_DIR": str(work / "cp"),
        "ANSIBLE_PYTHON_INTERPRETER": "/usr/bin/python3",
        "ANSIBLE_GATHERING": "explicit",
        "ANSIBLE_RETRY_FILES_ENABLED": "False",
        "ANSIBLE_NOCOLOR": "1",
        "ANSIBLE_CONFIG": str(work / "none.cfg"),  # no ansible.cfg from the cwd or ~ leaks in
    }


# --- one round: pdsh and clush --------------------------------------------------------------------


def pdsh_argv(names: list[str], command: str) -> list[str]:
    return ["pdsh", "-R", "ssh", "-S", "-f", str(len(names)), "-w", ",".join(names), command]


def pdsh_env(ssh_config: Path) -> dict[str, str]:
    return {
        **os.environ,
        "PDSH_SSH_ARGS_APPEND": f"-F {ssh_config} -o BatchMode=yes -o StrictHostKeyChecking=yes",
    }


def clush_argv(bin_dir: Path, ssh_config: Path, names: list[str], command: str) -> list[str]:
    return [
        str(bin_dir / "clush"),
        "-b",
        "-S",
        "-f",
        str(len(names)),
        "-o",
        f"-F {ssh_config} -oBatchMode=yes -oStrictHostKeyChecking=yes",
        "-w",
        ",".join(names),
        command,
    ]


# --- launches -------------------------------------------------------------------------------------


def pdsh_torchrun_command(
    workdir: Path, torchrun: Path, nodes: int, per_node: int, master: str, port: int
) -> str:
    """What DeepSpeed's pdsh runner sends: one torchrun per node, its rank from pdsh's ``%n``."""
    return " ".join(
        [
            "cd",
            shlex.quote(str(workdir)),
            "&&",
            shlex.quote(str(torchrun)),
            f"--nnodes={nodes}",
            "--node-rank=%n",
            f"--nproc-per-node={per_node}",
            f"--master-addr={master}",
            f"--master-port={port}",
            "example_train.py",
        ]
    )


TRX_SCRIPT = HERE / "trx_launch.py"
