"""meshkit's configuration: invoke's Config with prefix ``meshkit``.

Sources, lowest to highest: the defaults below, ``/etc/meshkit.yaml``, ``~/.meshkit.yaml``,
``./meshkit.yaml``, ``MESHKIT_<KEY>`` environment variables, then task flags. Keys live under
``meshkit.`` (``meshkit.hostfile``); a ``meshkit.yaml`` may nest them under ``meshkit:`` or not.
"""

from __future__ import annotations

import copy
import os
from typing import Any

from invoke.config import Config, merge_dicts
from invoke.env import Environment

DEFAULTS: dict[str, Any] = {
    "hostfile": "hostfile",  # relative to the working directory
    "include": None,  # comma list of names, patterns or ranges to keep
    "exclude": None,  # ... and to drop
    "user": None,  # login user when the hostfile line names none (else ssh config, else $USER)
    "port": None,  # SSH port when the hostfile line names none (else ssh config, else 22)
    "identity": None,  # private key for the controller's logins (a bootstrap key)
    "ssh_config": None,  # extra ssh_config file; an ``ssh_config`` beside the hostfile is read too
    "connect_timeout": 10,  # seconds for TCP connect + SSH handshake + auth, per node
    "command_timeout": 120,  # seconds for any one remote command
    "parallel": 32,  # nodes contacted at once
    "session": "meshkit",  # tmux session name, also salts the derived master port
    "workdir": None,  # where the job runs and keeps its logs (shared storage); default: cwd
    "python": None,  # node-side interpreter path; default: the one running meshkit
    "nproc_per_node": None,  # processes per node; default: hostfile slots, else GPUs, else 1
    "master_port": None,  # default: derived from the hostfile and session
    "setup": [],  # shell lines run before the job on every node (e.g. activate a venv)
    "env": {},  # extra environment variables for the job
    "sandbox": {
        "dir": "/var/tmp/meshkit-sandbox",  # state of the local test cluster (shared "storage")
        "subnet": "10.77.0.0/24",  # its private network; checked against the host's routes
        "nodes": 3,
    },
}


class MeshkitConfig(Config):
    """Config whose project file is ``./meshkit.yaml`` and whose env vars are ``MESHKIT_<KEY>``."""

    prefix = "meshkit"

    @staticmethod
    def global_defaults() -> dict[str, Any]:
        base: dict[str, Any] = Config.global_defaults()
        return merge_dicts(base, {"meshkit": copy.deepcopy(DEFAULTS)})  # type: ignore[no-any-return]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # invoke's Program only looks for a project file next to a tasks.py it loaded from disk; the
        # console script's collection is fixed, so point it at the working directory ourselves.
        kwargs.setdefault("project_location", os.getcwd())
        super().__init__(*args, **kwargs)
        if not kwargs.get("lazy"):
            self.load_project()

    def load_shell_env(self) -> None:
        self.merge()
        # Only our own subtree, unprefixed: meshkit.hostfile <- MESHKIT_HOSTFILE.
        loader = Environment(config={"meshkit": self._config["meshkit"]}, prefix="")  # type: ignore[arg-type]
        self._set(_env=loader.load())
        self.merge()

    def _load_yaml(self, path: Any) -> Any:
        data = super()._load_yaml(path)
        # A meshkit.yaml may hold the keys bare (``hostfile: ...``); file them under ``meshkit``.
        if isinstance(data, dict) and "meshkit" not in data:
            return {"meshkit": data}
        return data

    _load_yml = _load_yaml

    @classmethod
    def load(cls) -> MeshkitConfig:
        """A fully loaded config, for callers that are not run by the meshkit Program."""
        config = cls()
        config.load_shell_env()
        return config


def settings(config: Config) -> Any:
    """The ``meshkit`` section for a task: from the console script's MeshkitConfig directly; under
    plain ``invoke`` (whose Config reads invoke.yaml), from the same files the console script reads."""
    if not isinstance(config, MeshkitConfig):
        config = MeshkitConfig.load()
    return config.meshkit
