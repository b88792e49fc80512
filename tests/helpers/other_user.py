"""Running meshkit as another local user, from any checkout: the checkout and its venv may sit
where that user cannot enter (a clone in /root, mode 700), so the user gets a Python
environment of its own that it can read, and the argv that runs a command as it. Shared by the
tests that run as another user (diagnose's agent as ``nobody``, the sandbox's user's flow)."""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

import meshkit

PACKAGE = Path(meshkit.__file__).resolve().parent  # the meshkit under test: this checkout's
# Every sandbox node sees /var/tmp (each has a /tmp of its own): the environment works there.
PLACE = "/var/tmp"


def as_user(name: str) -> list[str]:
    """The argv prefix that runs a command as ``name`` (its uid, gid and groups)."""
    entry = pwd.getpwnam(name)
    return ["setpriv", f"--reuid={entry.pw_uid}", f"--regid={entry.pw_gid}", "--init-groups"]


def login_env(name: str, python: Path) -> dict[str, str]:
    """The environment a login of ``name`` would have, with ``python``'s programs first."""
    entry = pwd.getpwnam(name)
    return {
        "HOME": entry.pw_dir,
        "USER": name,
        "LOGNAME": name,
        "SHELL": "/bin/bash",
        "PATH": f"{python.parent}:/usr/local/bin:/usr/bin:/bin",
        "LANG": "C.UTF-8",
    }


@contextmanager
def readable_python(name: str, extras: Sequence[str] = ()) -> Iterator[Path]:
    """A venv that ``name`` can run, in a fresh 0755 directory under /var/tmp: the meshkit
    under test, and what it requires (with ``extras``, e.g. ``torch``) as installed in this
    venv, their programs (py-spy, torchrun) included. Yields its interpreter; removed
    afterwards. Files are hard links where the filesystem allows, copies elsewhere."""
    root = Path(tempfile.mkdtemp(prefix="meshkit-env-", dir=PLACE))
    try:
        root.chmod(0o755)
        venv = root / "venv"
        interpreter = _interpreter_for(name)
        subprocess.run([interpreter, "-m", "venv", "--without-pip", venv], check=True)
        python = venv / "bin" / "python"
        site = _site_packages(python)
        for distribution in _required(extras):
            _install(distribution, site, python)
        ignored = shutil.ignore_patterns("__pycache__")
        shutil.copytree(PACKAGE, site / "meshkit", ignore=ignored, copy_function=shutil.copy)
        yield python
    finally:
        subprocess.run(["rm", "-rf", "--one-file-system", root], check=False)


def _interpreter_for(name: str) -> str:
    """This Python's version, at a path ``name`` can run: this venv's base interpreter, else
    the system's (a base in /root, as pyenv's, is closed to other users)."""
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    candidates = [Path(sys.base_prefix, "bin", version), Path("/usr/bin", version)]
    candidates.append(Path("/usr/local/bin", version))
    for candidate in candidates:
        if not candidate.exists():
            continue
        # through a shell: setpriv's own exec may reach what the user alone cannot
        check = [*as_user(name), "sh", "-c", 'exec "$0" -c "import venv"', candidate]
        done = subprocess.run(check, capture_output=True, check=False)
        if done.returncode == 0:
            return str(candidate)
    listed = ", ".join(str(candidate) for candidate in candidates)
    raise AssertionError(f"no {version} that {name} can run; looked at {listed}")


def _site_packages(python: Path) -> Path:
    code = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    done = subprocess.run([python, "-c", code], capture_output=True, text=True, check=True)
    return Path(done.stdout.strip())


def _required(extras: Sequence[str]) -> list[metadata.Distribution]:
    """meshkit's distribution and every one it requires (with ``extras``), as installed."""
    found: dict[str, metadata.Distribution] = {}
    wanted = [("meshkit", set(extras))]
    while wanted:
        name, with_extras = wanted.pop()
        key = canonicalize_name(name)
        if key in found:
            continue
        distribution = metadata.distribution(name)
        found[key] = distribution
        for line in distribution.requires or []:
            requirement = Requirement(line)
            marker = requirement.marker
            applies = [marker is None]
            for extra in ["", *with_extras]:
                applies.append(marker is not None and marker.evaluate({"extra": extra}))
            if any(applies):
                wanted.append((requirement.name, requirement.extras))
    return list(found.values())


def _install(distribution: metadata.Distribution, site: Path, python: Path) -> None:
    """A distribution's files into ``site``, its programs into ``python``'s bin. meshkit's
    own package is the checkout's tree (copied after): its editable hooks point there."""
    is_meshkit = canonicalize_name(distribution.metadata["Name"]) == "meshkit"
    for file in distribution.files or []:
        source = Path(distribution.locate_file(file))
        parts = file.parts
        if parts[0] == "..":
            if parts[-2] == "bin" and source.is_file():
                _install_program(source, python)
            continue
        if is_meshkit and not parts[0].endswith(".dist-info"):
            continue
        if not source.is_file():  # a RECORD may list what was never written, such as a .pyc
            continue
        target = site / file
        target.parent.mkdir(parents=True, exist_ok=True)
        _link_or_copy(source, target)


def _install_program(source: Path, python: Path) -> None:
    """A program: a Python script (a venv's: pip wrote its interpreter's path in) is rewritten
    to run on ``python``; a binary (py-spy) is linked."""
    target = python.parent / source.name
    with source.open("rb") as handle:
        first_line = handle.readline(4096)
    interpreter = Path(os.fsdecode(first_line[2:].strip()))
    if first_line.startswith(b"#!") and interpreter.name.startswith("python"):
        rest = source.read_bytes().split(b"\n", 1)[1]
        target.write_bytes(b"#!" + bytes(python) + b"\n" + rest)
        target.chmod(0o755)
        return
    _link_or_copy(source, target)


def _link_or_copy(source: Path, target: Path) -> None:
    try:
        os.link(source, target)
    except OSError:  # another filesystem
        shutil.copy2(source, target)
