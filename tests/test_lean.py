"""What every node interpreter (agent, `meshkit env`, `meshkit run`) imports stays lean, and the
stand-ins for the heavy modules behave like them."""

import ast
import hashlib
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from meshkit.digest import sha256, sha256_hex
from meshkit.node import gpus

HEAVY = {"typing", "hashlib", "shutil", "pathlib"}


def env_imports(cwd: Path, args: list[str], watched: set[str]) -> tuple[str, list[str]]:
    """`meshkit env ARGS` in ``cwd``: what it printed, and which ``watched`` modules meshkit
    itself imported (CI installs the checkout with a plain path, as a wheel is found: the default
    editable finder would have loaded pathlib, re and enum before it, and hidden them)."""
    code = (
        f"import sys; before = set(sys.modules); sys.argv = {['meshkit', 'env', *args]!r}\n"
        "from meshkit.cli.main import main\n"
        "try:\n    main()\nexcept SystemExit:\n    pass\n"
        f"print(sorted({watched!r} & (set(sys.modules) - before)), file=sys.stderr)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=cwd, check=True
    )
    return out.stdout, ast.literal_eval(out.stderr.strip().splitlines()[-1])


def test_meshkit_env_imports_none_of_the_heavy_modules(tmp_path: Path) -> None:
    (tmp_path / "hostfile").write_text("10.255.0.1\n10.255.0.2\n")
    printed, loaded = env_imports(tmp_path, ["--node-rank", "1"], HEAVY)
    assert "NODE_RANK=1" in printed
    assert loaded == []


@pytest.mark.parametrize(
    ("modules", "heavy"),
    [
        # the agent as every command starts it, with the job ops a status round uses
        (
            "meshkit.node.agent, meshkit.node.jobs",
            HEAVY | {"subprocess", "tempfile", "platform", "signal"},
        ),
        # the keeper reads the job's record as JSON (json imports re, and re enum): what it no
        # longer avoids
        ("meshkit.node.keeper", HEAVY | {"subprocess", "tempfile", "platform"}),
        ("meshkit.node.supervise", HEAVY | {"subprocess", "tempfile", "platform"}),
        # `meshkit run --spawn`, between discovery and the ranks' exec
        (
            "meshkit.node.ranks",
            HEAVY | {"subprocess", "tempfile", "platform", "json", "re", "enum", "contextlib"},
        ),
        (
            "meshkit.node.doctor",
            HEAVY | {"subprocess", "tempfile", "platform", "importlib.metadata"},
        ),
        # `meshkit exec`'s command: the agent, the op and the variables it exports
        ("meshkit.node.agent, meshkit.node.execute", HEAVY | {"tempfile", "platform"}),
    ],
)
def test_node_side_modules_stay_lean(modules: str, heavy: set[str]) -> None:
    code = (
        f"import sys; before = set(sys.modules); import {modules};"
        f"print(sorted({heavy!r} & (set(sys.modules) - before)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_versions_read_as_importlib_metadata_reads_them() -> None:
    from importlib import metadata

    from meshkit.node.doctor import _version

    names = {d.metadata["Name"] for d in metadata.distributions()}
    assert {"pytest", "meshkit"} <= names
    for name in sorted(names):
        assert _version(name) == metadata.version(name), name
        assert _version(name.upper().replace("-", "_")) == metadata.version(name), name
    assert _version("no-such-distribution-here") is None


def test_digests_are_hashlibs() -> None:
    for data in (b"", b"x", "a\0b\nü".encode(), bytes(range(256)) * 50):
        assert sha256(data) == hashlib.sha256(data).digest()
        assert sha256_hex(data) == hashlib.sha256(data).hexdigest()


def test_gpu_count_finds_nvidia_smi_on_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the driver's /proc entries are missing, nvidia-smi on PATH answers. On an NVIDIA host
    the driver would answer first, so the test hides its directory (and only it): it runs, and
    passes, on every host."""
    listdir = os.listdir

    def no_driver(path: str | os.PathLike[str] = ".") -> list[str]:
        if os.fspath(path).startswith("/proc/driver/nvidia"):
            raise FileNotFoundError(path)
        return listdir(path)

    monkeypatch.setattr(gpus.os, "listdir", no_driver)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert gpus.gpu_count() == 0  # none on PATH
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'GPU 0: A (UUID: x)'\necho 'GPU 1: A (UUID: y)'\n")
    assert gpus.gpu_count() == 0  # not executable: not a command (as shutil.which says)
    smi.chmod(smi.stat().st_mode | stat.S_IXUSR)
    assert gpus.gpu_count() == 2
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    assert gpus.gpu_count() == 1


def test_addresses_and_the_hostname_are_what_socket_would_answer() -> None:
    """`meshkit env` skips getaddrinfo for an address (and socket's import with it)."""
    import socket

    from meshkit import localnet
    from meshkit.topology import normalize

    assert localnet.hostname() == socket.gethostname()
    for address in ("10.1.2.3", "127.0.0.1", "::1", "fe80::1%lo", "::ffff:10.0.0.1", "2001:db8::1"):
        infos = socket.getaddrinfo(address, None, proto=socket.IPPROTO_TCP)
        assert localnet.resolve(address) == tuple(
            dict.fromkeys(normalize(str(i[4][0])) for i in infos)
        ), address
    assert localnet.resolve("localhost")  # a name still resolves


def test_meshkit_env_from_a_hostfile_of_addresses_needs_no_re_socket_or_hostlist(
    tmp_path: Path,
) -> None:
    """What `meshkit run` reads on every node at every launch: nothing to resolve, no range to
    expand, no name to check, nothing to quote with shlex. (``re`` itself comes with the
    records' dataclasses: an editable install's finder had loaded it first, hiding that.)"""
    from meshkit import localnet

    mine = next(
        a.address
        for a in localnet.local_addresses()
        if "." in a.address and not a.address.startswith("127.")
    )
    (tmp_path / "hostfile").write_text(f"{mine} slots=2\n10.255.0.2 slots=2\n")
    lean = {"socket", "shlex", "hostlist", "fnmatch", "encodings.idna", "subprocess"}
    printed, loaded = env_imports(tmp_path, [], lean)
    assert "NODE_RANK=0" in printed
    assert "NPROC_PER_NODE=2" in printed
    assert loaded == []


def test_shell_quote_is_shlex_quote() -> None:
    import shlex

    from meshkit.distenv import shell_quote

    samples = ["", "a", "a b", "it's", "$HOME", "a'b\"c", "ü", "x\ny", "-n", "a=b,c:d/e.f@g%h+i"]
    samples += [chr(c) for c in range(0, 300)] + ["''", "'", "\\"]
    for text in samples:
        assert shell_quote(text) == shlex.quote(text), repr(text)


def test_a_command_makes_only_the_records_it_uses() -> None:
    """Making a record a dataclass compiles its methods: an agent serving
    ``exec`` (and the controller sending it) pays for its request and reply, not for every one
    of the protocol's records."""
    code = (
        "from meshkit import protocol\n"
        "import meshkit.node.agent, meshkit.node.execute\n"
        "request = protocol.ExecRequest('true', 0, 1, '10.0.0.1', 29500, 's', 5.0)\n"
        "op, back = protocol.decode_request(protocol.encode_request(request))\n"
        "assert back == request\n"
        "protocol.decode_reply(op, protocol.encode_reply(protocol.ExecReply(0, 'x', '')))\n"
        "made = [name for name, cls in vars(protocol).items()\n"
        "        if isinstance(cls, type) and '__dataclass_fields__' in vars(cls)]\n"
        "print(sorted(made))"
    )
    made = ast.literal_eval(subprocess.check_output([sys.executable, "-c", code], text=True))
    assert made == ["ExecReply", "ExecRequest", "Reply", "Request"]
