"""meshkit's configuration: one loader, used by the fast path (``env``/``run``) and every task.

Sources, lowest to highest: the defaults below, ``/etc/meshkit.yaml``, ``~/.meshkit.yaml``,
``./meshkit.yaml`` (``.yml``/``.json`` too; keys bare or under ``meshkit:``), ``MESHKIT_<KEY>``
environment variables, then flags. Every value is checked here: a bad one is a ``ConfigError``
naming the file or variable, the key and what is expected. Never imports invoke or SSH.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from .errors import ConfigError, UsageError
from .record import Invalid, asdict, build, field, fields, record
from .trust import read_config

TYPE_CHECKING = False  # no runtime `typing` on the env path (see meshkit/__init__.py)
if TYPE_CHECKING:
    from typing import Any

LEVELS = ("/etc/meshkit", "~/.meshkit", "./meshkit")  # system, user, project
SUFFIXES = ("yaml", "yml", "json")  # the first file found at a level wins
MAX_CONFIG_BYTES = 1 << 20


# The defaults are the records' own (DEFAULTS below is derived from them).
@record
class SandboxConfig:
    dir: str = "/var/tmp/meshkit-sandbox"
    subnet: str = "10.77.0.0/24"
    nodes: int = 3


@record
class Config:
    hostfile: str = "hostfile"  # relative to the working directory
    include: str | None = None  # comma list of names, patterns or ranges to keep
    exclude: str | None = None  # ... and to drop
    user: str | None = None  # login user when the hostfile line names none (else ssh config)
    port: int | None = None  # SSH port when the hostfile line names none (else ssh config, 22)
    identity: str | None = None  # private key for the controller's logins (a bootstrap key)
    ssh_config: str | None = None  # extra ssh_config; an ``ssh_config`` beside the hostfile too
    connect_timeout: float = 10.0  # seconds for TCP connect + SSH handshake + auth, per node
    command_timeout: float = 120.0  # seconds for any one remote command
    parallel: int = 32  # nodes contacted at once
    session: str = "meshkit"  # job name (tmux session prefix); salts the derived master port
    workdir: str | None = None  # where the job runs and keeps its logs; default: cwd
    python: str | None = None  # node-side interpreter path; default: the one running meshkit
    nproc_per_node: int | None = None  # default: hostfile slots, else GPUs, else 1
    master_port: int | None = None  # default: derived from the hostfile and session
    setup: tuple[str, ...] = ()  # shell lines run before the job on every node
    env: dict[str, str] = field(default_factory=dict)  # extra environment for the job
    sync_exclude: tuple[str, ...] = ()  # names train --sync never copies
    stall_after: str = "30m"  # no output from any rank for this long: stalled ("off")
    step_stall_after: str = "5m"  # of a job reporting steps: no step of a rank this long stalls
    straggler_window: str = "1m"  # the nodes' compute time per step is compared over this long
    health_min_free_mib: int = 1024  # MiB free at least on the workdir's and state dir's disks
    health_xid_window: str = "1h"  # XIDs and OOM kills older than this are history, not health
    crash_window: str = "5m"  # an attempt that fails sooner failed to start (--max-failed-starts)
    notify_timeout: str = "30s"  # how long train --notify's command may run for one event
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)


def _plain(value: Any) -> Any:
    """A deep copy of a default as a file or a MESHKIT_* variable gives it: lists for tuples
    (dicts, lists and scalars only, so `meshkit env` needs no `copy` import)."""
    if isinstance(value, (tuple, list)):
        return [_plain(item) for item in value]
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    return value


DEFAULTS: dict[str, Any] = _plain(asdict(Config()))


def whole(text: str) -> bool:
    """ASCII digits only: ``str.isdigit`` also takes '²', which ``int`` then refuses."""
    return text.isascii() and text.isdigit()


@record
class ConfigFile:
    """A configuration file that was found, and its meshkit section."""

    path: str
    section: dict[str, Any]


@record
class Setting:
    """One key's value before checking, and where it came from (for error messages): a file's
    path, a ``MESHKIT_*`` variable's name, or ``default``."""

    value: Any
    where: str


def _read_file(base: str) -> ConfigFile | None:
    """The first file of a level that exists, read only when trusted as OpenSSH trusts its
    configuration (``trust.read_trusted``): what it says runs as this user."""
    for suffix in SUFFIXES:
        path = os.path.expanduser(f"{base}.{suffix}")
        try:
            content = read_config(path, MAX_CONFIG_BYTES, "configuration file")
        except OSError as exc:
            raise ConfigError(f"{path}: cannot read: {exc}") from None
        if content is None:
            continue
        try:
            text = content.decode()
            if suffix == "json":
                import json  # only here and for JSON variables

                data = json.loads(text)
            else:
                import yaml

                data = yaml.safe_load(text)
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{path}: cannot read: {exc}") from None
        except Exception as exc:  # json's ValueError; yaml.YAMLError, which is not one
            kind = "YAML"
            if suffix == "json":
                kind = "JSON"
            raise ConfigError(f"{path}: not valid {kind}: {str(exc)[:200]}") from None
        data = data or {}
        section = None
        if isinstance(data, dict):
            section = data.get("meshkit", data)
        if not isinstance(section, dict):
            raise ConfigError(f"{path}: expected a mapping of meshkit keys (e.g. 'hostfile: x')")
        return ConfigFile(path, section)
    return None


def raw(environ: Mapping[str, str] | None = None, cwd: str | None = None) -> dict[str, Setting]:
    """Each key's value and where it came from, before checking. ``cwd``: the directory whose
    ``./meshkit.yaml`` counts (default: the working directory)."""
    if environ is None:
        environ = os.environ
    merged = {key: Setting(_plain(value), "default") for key, value in DEFAULTS.items()}
    for base in LEVELS:
        if cwd is not None and base.startswith("./"):
            base = os.path.join(cwd, base[2:])
        found = _read_file(base)
        if found is None:
            continue
        where = found.path
        for key, value in found.section.items():
            if key not in DEFAULTS:
                known = ", ".join(sorted(DEFAULTS))
                raise ConfigError(f"{where}: unknown key {str(key)[:40]!r}; the keys are: {known}")
            if key == "sandbox" and isinstance(value, dict):
                # Sandbox keys merge one by one: a level may set only `nodes`.
                merged[key] = Setting({**merged[key].value, **value}, where)
            else:
                merged[key] = Setting(value, where)
    for key, default in DEFAULTS.items():
        variable = f"MESHKIT_{key.upper()}"
        if variable not in environ:
            continue
        value = environ[variable]
        if isinstance(default, (dict, list)):
            import json  # only for such variables: `meshkit env` rarely needs it

            try:
                value = json.loads(value)
            except ValueError:
                kind = type(default).__name__
                raise ConfigError(f"{variable}={value[:60]!r}: expected JSON (a {kind})") from None
        merged[key] = Setting(value, variable)
    return merged


def _check(name: str, kind: Any, value: Any, where: str) -> Any:
    def bad(expected: str) -> ConfigError:
        return ConfigError(f"{where}: {name} = {str(value)[:60]!r}: expected {expected}")

    text = str(kind)
    optional = "None" in text
    if value is None or value == "":
        if optional:
            return None
        raise bad("a value")
    if "float" in text:
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise bad("a number of seconds") from None
        if not 0 < number <= 86400:
            raise bad("seconds between 0 and 86400")
        return number
    if "int" in text:
        if isinstance(value, bool) or not whole(str(value).strip()):
            raise bad("a whole number")
        number = int(str(value).strip())
        limits = {"port": (1, 65535), "master_port": (1, 65535), "parallel": (1, 1024)}
        low, high = limits.get(name, (1, 1 << 20))
        if not low <= number <= high:
            raise bad(f"a whole number {low}..{high}")
        return number
    if "tuple" in text:
        items = value
        if isinstance(value, str):
            items = [value]
        if not isinstance(items, list) or not all(isinstance(item, str) for item in items):
            raise bad("a list of shell lines")
        return tuple(items)
    if "dict" in text:
        if not isinstance(value, dict):
            raise bad("a mapping NAME: value")
        env = {str(key): str(item) for key, item in value.items()}
        if not env:
            return env
        # Imported only when there is something to check: `meshkit env` runs on every node.
        from .job import check_env

        try:
            return check_env(env, where)
        except UsageError as exc:  # check_env's, re-filed as a config problem
            raise ConfigError(exc.problems) from None
    if isinstance(value, (dict, list)):
        raise bad("a single value")
    return str(value)


def load(environ: Mapping[str, str] | None = None, cwd: str | None = None) -> Config:
    """The checked configuration, from every level (``cwd``: see ``raw``)."""
    merged = raw(environ, cwd)
    hints = {config_field.name: config_field.type for config_field in fields(Config)}
    values: dict[str, Any] = {}
    for key, setting in merged.items():
        value = setting.value
        where = setting.where
        if key == "sandbox":
            if not isinstance(value, dict):
                raise ConfigError(f"{where}: sandbox: expected a mapping with dir, subnet, nodes")
            unknown = set(value) - {"dir", "subnet", "nodes"}
            if unknown:
                raise ConfigError(f"{where}: sandbox: unknown keys {sorted(unknown)}")
            values[key] = {
                "dir": str(value.get("dir") or SandboxConfig.dir),
                "subnet": str(value.get("subnet") or SandboxConfig.subnet),
                "nodes": _check("sandbox.nodes", "int", value.get("nodes", 3), where),
            }
        elif key == "sync_exclude":
            values[key] = _check_names(value, where)
        else:
            values[key] = _check(key, hints[key], value, where)
    # The same checker as the protocol's, over the converted values: what reaches the rest of
    # meshkit has exactly the record's types.
    try:
        return build(Config, values, "config")
    except Invalid as exc:
        raise ConfigError(str(exc)) from None


def _check_names(value: Any, where: str) -> tuple[str, ...]:
    """``sync_exclude``: file or directory names (no '/'), matched at any depth."""
    items = value
    if isinstance(value, str):
        items = [value]
    if not isinstance(items, list) or not all(isinstance(item, str) for item in items):
        raise ConfigError(f"{where}: sync_exclude: expected a list of file or directory names")
    for item in items:
        if not item or "/" in item or item in (".", "..") or "\0" in item:
            raise ConfigError(
                f"{where}: sync_exclude: {item[:60]!r} is not a file or directory name (names "
                "match at any depth; no '/')"
            )
    return tuple(items)


# ---- flags over configuration: a flag given on the command line is the last level ------------


def pick(conf: Config, name: str, flag: Any) -> Any:
    """A flag when given, else the configured value (flags are the last config level)."""
    if flag is not None:
        return flag
    return getattr(conf, name)


def pick_int(conf: Config, name: str, flag: Any, *, allow_auto: bool = False) -> int | None:
    value = pick(conf, name, flag)
    if value is None or value == "":
        return None
    text = str(value)
    if allow_auto and text == "auto":
        return None
    if not whole(text) or int(text) < 1:
        hint = ""
        if allow_auto:
            hint = " or 'auto'"
        raise UsageError(
            f"--{name.replace('_', '-')} {text[:40]!r}: expected a whole number >= 1{hint}"
        )
    return int(text)
