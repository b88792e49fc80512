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

from .defaults import DEFAULTS


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

    @staticmethod
    def _nest(data: Any) -> Any:
        # A meshkit.yaml may hold the keys bare (``hostfile: ...``); file them under ``meshkit``.
        if isinstance(data, dict) and "meshkit" not in data:
            return {"meshkit": data}
        return data

    def _load_yaml(self, path: Any) -> Any:
        return self._nest(super()._load_yaml(path))

    _load_yml = _load_yaml

    def _load_json(self, path: Any) -> Any:
        return self._nest(super()._load_json(path))

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
