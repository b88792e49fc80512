"""``meshkit env`` and ``meshkit run`` without importing invoke (about 0.1s of start-up saved on
every node at every launch). Same flags as the invoke tasks (tests/test_fastcli.py checks), same
config files and MESHKIT_* variables. Anything else (help, core flags, other tasks, a ``.py`` config,
a flag it does not know) goes to the invoke Program, which then reports it as usual."""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ..defaults import DEFAULTS
from ..errors import MeshkitError

DISCOVERY_FLAGS = (
    ("hostfile", "h"),
    ("node_rank", "n"),
    ("session", "s"),
    ("master_port", "m"),
    ("nproc_per_node", "p"),
    ("include", "i"),
    ("exclude", "e"),
)
FLAGS: dict[str, tuple[tuple[str, str], ...]] = {
    "env": (("json", "j"), *DISCOVERY_FLAGS),
    "run": (("cmd", "c"), *DISCOVERY_FLAGS, ("log", "l")),
}
BOOLEAN = {"json"}
CONFIG_LEVELS = ("/etc/meshkit", "~/.meshkit", "./meshkit")  # system, user, project: as invoke
SUFFIXES = ("yaml", "yml", "json", "py")  # invoke's order; the first file found at a level wins


class _Fallback(Exception):
    """Not something the fast path handles: let the invoke Program do it."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> Any:
        raise _Fallback


def _parser(task: str) -> argparse.ArgumentParser:
    parser = _Parser(add_help=False, allow_abbrev=False)
    for name, short in FLAGS[task]:
        long = "--" + name.replace("_", "-")
        if name in BOOLEAN:
            parser.add_argument(f"-{short}", long, dest=name, action="store_true")
        else:
            parser.add_argument(f"-{short}", long, dest=name)
    return parser


def _config_file(base: str) -> dict[str, Any]:
    for suffix in SUFFIXES:
        path = Path(os.path.expanduser(f"{base}.{suffix}"))
        if not path.is_file():
            continue
        if suffix == "py":
            raise _Fallback
        text = path.read_text()
        if suffix == "json":
            data = json.loads(text)
        else:
            import yaml

            data = yaml.safe_load(text)
        data = data or {}
        section = data.get("meshkit", data) if isinstance(data, dict) else {}
        return section if isinstance(section, dict) else {}
    return {}


def _cast(default: Any, text: str) -> Any:
    if isinstance(default, bool):
        return text.lower() not in ("", "0", "false", "no")
    if isinstance(default, (int, float)):
        return type(default)(text)
    if isinstance(default, (dict, list, tuple)):
        raise _Fallback
    return text


def settings(environ: Mapping[str, str]) -> dict[str, Any]:
    """The ``meshkit`` section from defaults, the three config files, then MESHKIT_<KEY>."""
    conf = copy.deepcopy(DEFAULTS)
    for base in CONFIG_LEVELS:
        for key, value in _config_file(base).items():
            if isinstance(conf.get(key), dict) and isinstance(value, dict):
                conf[key].update(value)
            else:
                conf[key] = value
    for key, default in DEFAULTS.items():
        var = f"MESHKIT_{key.upper()}"
        if var in environ:
            conf[key] = _cast(default, environ[var])
    return conf


def run_fast(argv: Sequence[str]) -> bool:
    """Handle ``env``/``run`` here and return True (``run`` never returns); False: not ours."""
    if not argv or argv[0] not in FLAGS or "--help" in argv:
        return False
    from .envcmd import exec_run, node_env, print_env

    try:
        flags = vars(_parser(argv[0]).parse_args(list(argv[1:])))
        conf = settings(os.environ)
    except (_Fallback, ValueError, OSError):
        return False
    if argv[0] == "run" and flags["cmd"] is None:
        return False
    discovery = {name: flags[name] for name, _ in DISCOVERY_FLAGS}
    try:
        node = node_env(conf, **discovery)
        if argv[0] == "env":
            print_env(node, bool(flags["json"]))
        else:
            exec_run(node, flags["cmd"], flags["log"])
    except MeshkitError as exc:
        print(f"meshkit: {exc}", file=sys.stderr)
        raise SystemExit(1) from None
    return True
