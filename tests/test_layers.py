"""meshkit's layers, read from every module's imports (those inside functions and under
TYPE_CHECKING included): SSH only in ``remote/``; printing and exiting only in ``cli/``; the node
side and the env/run path on the standard library; nothing imports a higher layer; no import cycle.
And no module passes 600 lines unless meshkit/DESIGN.md names it with its reason.

Each rule names the module and the import that breaks it. The few exceptions are listed with their
reason: an exception is a decision, so one that no module needs any more fails too.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "meshkit"

# ---- the modules and what they import -----------------------------------------------------------


@dataclass(frozen=True)
class Import:
    """One import statement's target, as written (``paramiko``) or resolved (``meshkit.x.y``)."""

    name: str
    line: int


def module_files() -> dict[str, Path]:
    """Every module of the package by its dotted name (a package by its own name)."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


MODULES = module_files()
TREES = {module: ast.parse(path.read_text(), str(path)) for module, path in MODULES.items()}


def imports_of(module: str) -> list[Import]:
    """What ``module`` imports: relative imports resolved to absolute names; ``from x import y``
    gives ``x`` and ``x.y`` (the latter counts only where it is a module)."""
    is_package = MODULES[module].name == "__init__.py"
    package = module if is_package else module.rpartition(".")[0]
    found = []
    for node in ast.walk(TREES[module]):
        if isinstance(node, ast.Import):
            found += [Import(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[: len(parts) - node.level + 1]
                if node.module:
                    parts.append(node.module)
                base = ".".join(parts)
            found.append(Import(base, node.lineno))
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                if submodule in MODULES:
                    found.append(Import(submodule, node.lineno))
    return found


def own_module(name: str) -> str | None:
    """The package's module that an import of ``name`` loads (None: not meshkit's)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def meshkit_imports(module: str) -> dict[str, int]:
    """The package's modules that ``module`` imports, each with the first line that does; a
    module's own parent packages are left out (importing a package's member runs its
    ``__init__`` anyway, which is no dependency on it)."""
    found: dict[str, int] = {}
    for target in imports_of(module):
        imported = own_module(target.name)
        if imported is None or imported == module or module.startswith(imported + "."):
            continue
        found.setdefault(imported, target.line)
    return found


def outside_imports(module: str) -> list[Import]:
    """The imports of ``module`` that are not meshkit's own, by their top-level name."""
    found = []
    for target in imports_of(module):
        top = target.name.split(".")[0]
        if top != "meshkit":
            found.append(Import(top, target.line))
    return found


def where(module: str, line: int) -> str:
    return f"{MODULES[module].relative_to(PACKAGE.parent)}:{line}"


# ---- SSH only in remote/ ------------------------------------------------------------------------

SSH_PACKAGES = {"paramiko", "fabric"}


def test_only_remote_imports_paramiko_or_fabric():
    found = []
    for module in MODULES:
        if module.startswith("meshkit.remote"):
            continue
        for target in outside_imports(module):
            if target.name in SSH_PACKAGES:
                found.append(f"{where(module, target.line)}: {module} imports {target.name}")
    assert not found, "\n".join(["", *found])


# ---- printing and exiting only in cli/ ----------------------------------------------------------

EXIT_CALLS = {"exit", "quit", "_exit", "sys.exit", "os._exit"}

# (module, what it does): why it may
PRINTS_OR_EXITS = {
    ("meshkit.envrun", "print"): "meshkit env/run's own fast parser (it runs on every node at "
    "every launch, so it never imports invoke): it prints the variables and its errors",
    ("meshkit.envrun", "raise SystemExit"): "meshkit env/run's exit code, and --spawn's: the "
    "worst of its ranks' exit codes",
    ("meshkit.node.__main__", "print"): "the node agent's own command line (python -m "
    "meshkit.node): its usage line",
    ("meshkit.node.__main__", "raise SystemExit"): "the node agent's own command line: its exit "
    "code",
    ("meshkit.sandbox.fake_smi", "raise SystemExit"): "a fake nvidia-smi that sandbox nodes run "
    "as a program of their own (sandbox.fault --gpus), not meshkit's code: its exit code is "
    "nvidia-smi's",
    ("meshkit.templates.collective_probe", "sys.exit"): "a user script (the doctor runs it under "
    "torchrun on every node), not meshkit's code: its exit code is the probe's verdict",
}


def called_name(call: ast.Call) -> str:
    """``print``, ``sys.exit``, ``os._exit``: the dotted name a call is made through."""
    if isinstance(call.func, ast.Name):
        return call.func.id
    if isinstance(call.func, ast.Attribute) and isinstance(call.func.value, ast.Name):
        return f"{call.func.value.id}.{call.func.attr}"
    return ""


def prints_and_exits(module: str) -> Iterator[tuple[str, int]]:
    """Each ``print(``, exit call and ``raise SystemExit`` in ``module``, with its line."""
    for node in ast.walk(TREES[module]):
        if isinstance(node, ast.Call):
            name = called_name(node)
            if name == "print" or name in EXIT_CALLS:
                yield name, node.lineno
        elif isinstance(node, ast.Raise) and node.exc is not None:
            raised = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
            if isinstance(raised, ast.Name) and raised.id == "SystemExit":
                yield "raise SystemExit", node.lineno


def test_only_the_cli_prints_or_exits():
    found = []
    for module in MODULES:
        if module.startswith("meshkit.cli"):
            continue
        for what, line in prints_and_exits(module):
            if (module, what) not in PRINTS_OR_EXITS:
                found.append(f"{where(module, line)}: {module}: {what}")
    assert not found, "\n".join(["", *found])


def test_every_print_or_exit_exception_is_still_needed():
    used = set()
    for module in MODULES:
        used |= {(module, what) for what, _ in prints_and_exits(module)}
    assert set(PRINTS_OR_EXITS) - used == set()


# ---- the node side and the env/run path: the standard library only ------------------------------

# Where these modules import something outside the standard library, on purpose: (module,
# top-level name): why. Each is a declared dependency that is imported only where it is needed.
OUTSIDE_STDLIB = {
    ("meshkit.localnet", "netifaces"): "this machine's interfaces and their addresses: the "
    "standard library cannot list them",
    ("meshkit.hostfile", "hostlist"): "host ranges such as node[01-04], imported only for a "
    "name that has one",
    ("meshkit.sources", "hostlist"): "SLURM's node lists (node[01-04]), imported only under SLURM",
    ("meshkit.settings", "yaml"): "the configuration file, imported only when there is one",
    ("meshkit.node.hook.sitecustomize", "sitecustomize"): "the rank hook hands on to the next "
    "sitecustomize on the path (the user's own), if there is one",
}
# CPython 3.12+ keeps sha256 in _sha2 (digest.py tries it first); older interpreters do not list it
STDLIB_ELSEWHERE = {"_sha2"}
STDLIB = set(sys.stdlib_module_names) | STDLIB_ELSEWHERE

# Where the standard-library rule starts; every meshkit module these import is held to it too.
STDLIB_ONLY_ROOTS = ["meshkit.protocol", "meshkit.record", "meshkit.envrun"]
STDLIB_ONLY_ROOTS += [module for module in MODULES if module.startswith("meshkit.node")]


def stdlib_only_modules() -> set[str]:
    """The node side, the protocol and the env/run path, and every meshkit module they import."""
    reached: set[str] = set()
    pending = list(STDLIB_ONLY_ROOTS)
    while pending:
        module = pending.pop()
        if module in reached:
            continue
        reached.add(module)
        pending += list(meshkit_imports(module))
    return reached


def test_the_node_side_and_the_env_path_import_only_the_standard_library():
    reached = stdlib_only_modules()
    # the env/run path reaches discovery; the rule would be empty if it did not
    assert {"meshkit.envrun", "meshkit.discovery", "meshkit.node.agent"} <= reached
    found = []
    for module in sorted(reached):
        for target in outside_imports(module):
            if target.name in STDLIB or (module, target.name) in OUTSIDE_STDLIB:
                continue
            found.append(f"{where(module, target.line)}: {module} imports {target.name}")
    assert not found, "\n".join(["", *found])


def test_every_outside_stdlib_exception_is_still_needed():
    reached = stdlib_only_modules()
    used = set()
    for module in reached:
        used |= {(module, target.name) for target in outside_imports(module)}
    assert set(OUTSIDE_STDLIB) - used == set()


# ---- the layers: nothing imports up, and no cycle -----------------------------------------------

# Lowest first; a module may import its own layer and those below it.
# core: records, parsing and planning, pure.
# node: what runs on every node: the node agent, the env/run path and discovery, the templates.
# remote: SSH to the nodes. ops: operations over the cluster (and the local sandbox cluster).
# api: the Python API. cli: the command line, and the package itself (it exposes api lazily).
LAYERS = ["core", "node", "remote", "ops", "api", "cli"]
NODE_SIDE = {"meshkit.envrun", "meshkit.discovery", "meshkit.localnet", "meshkit.torch"}
PACKAGE_LAYERS = {
    "meshkit.node": "node",
    "meshkit.templates": "node",
    "meshkit.remote": "remote",
    "meshkit.ops": "ops",
    "meshkit.sandbox": "ops",
    "meshkit.api": "api",
    "meshkit.cli": "cli",
    "meshkit.__main__": "cli",
}


def layer_of(module: str) -> str:
    if module == "meshkit":
        return "cli"
    if module in NODE_SIDE:
        return "node"
    for prefix, layer in PACKAGE_LAYERS.items():
        if module == prefix or module.startswith(prefix + "."):
            return layer
    return "core"


def test_no_module_imports_a_higher_layer():
    found = []
    for module in MODULES:
        rank = LAYERS.index(layer_of(module))
        for imported, line in meshkit_imports(module).items():
            if LAYERS.index(layer_of(imported)) > rank:
                upward = f"{layer_of(module)} imports {layer_of(imported)}"
                found.append(f"{where(module, line)}: {module} imports {imported} ({upward})")
    assert not found, "\n".join(["", *found])


def cycle_from(graph: dict[str, dict[str, int]]) -> list[str]:
    """One import cycle (the modules in order, the first repeated at the end), or []."""
    finished: set[str] = set()
    path: list[str] = []

    def visit(module: str) -> list[str]:
        if module in path:
            return [*path[path.index(module) :], module]
        if module in finished:
            return []
        path.append(module)
        for imported in graph[module]:
            cycle = visit(imported)
            if cycle:
                return cycle
        path.pop()
        finished.add(module)
        return []

    for module in graph:
        cycle = visit(module)
        if cycle:
            return cycle
    return []


def test_no_import_cycle():
    graph = {module: meshkit_imports(module) for module in MODULES}
    assert cycle_from(graph) == []


def test_a_cycle_is_found():
    graph = {"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1}, "d": {"a": 1}}
    assert cycle_from(graph) == ["a", "b", "c", "a"]


# ---- the ops that do not connect do not load SSH ------------------------------------------------

# The ops modules that load paramiko on import: why.
CONNECTING_OPS = {
    "meshkit.ops.mesh": "opens its own SSH connections (Remote, the proven host keys)",
    "meshkit.ops.mesh_node": "runs each node's phases over its SSH node shell",
}
OPS_MODULES = sorted(module for module in MODULES if module.startswith("meshkit.ops."))


def test_the_connecting_ops_exist():
    assert set(CONNECTING_OPS) <= set(OPS_MODULES)


@pytest.mark.parametrize(
    "module", [module for module in OPS_MODULES if module not in CONNECTING_OPS]
)
def test_an_op_that_does_not_connect_does_not_load_ssh(module):
    loaded = f"[name for name in {sorted(SSH_PACKAGES)!r} if name in sys.modules]"
    program = f"import sys, {module}; print({loaded})"
    run = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, timeout=60, check=False
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "[]"


# ---- a module holds one concept: none passes 600 lines unless DESIGN.md names it ----------------

MAX_LINES = 600
DESIGN = PACKAGE / "DESIGN.md"
SIZE_RULE = "- A module holds one concept"
# a module allowed past the limit, in the size rule's list: ``  - `protocol.py`: its reason``
LONG_MODULE = re.compile(r"  - `(?P<path>[\w/]+\.py)`: (?P<reason>.+)")


def size_rule_lines() -> list[str]:
    """DESIGN.md's size rule, from its bullet in "The package shape" to the end of that bullet (the
    next bullet at its level, a blank line or a code block)."""
    lines = DESIGN.read_text().splitlines()
    shape = lines.index("## The package shape")
    starts = [index for index in range(shape, len(lines)) if lines[index].startswith(SIZE_RULE)]
    assert starts, f"{DESIGN.name}: no bullet starting {SIZE_RULE!r} under 'The package shape'"
    found = []
    for line in lines[starts[0] :]:
        if found and (line.startswith("- ") or not line.strip() or line.startswith("```")):
            break
        found.append(line)
    return found


def long_modules_allowed() -> dict[str, str]:
    """The modules DESIGN.md allows past the limit (their path under meshkit/), each with its
    reason: the only place an exception is made."""
    allowed: dict[str, str] = {}
    last_path = ""
    for line in size_rule_lines():
        listed = LONG_MODULE.fullmatch(line)
        if listed:
            last_path = listed["path"]
            allowed[last_path] = listed["reason"]
        elif last_path and line.startswith("    "):
            allowed[last_path] += " " + line.strip()  # its reason goes on
        else:
            # an item the pattern misses would be an exception nobody sees
            assert not line.startswith("  - "), f"{DESIGN.name}: not `path.py`: reason: {line}"
    return allowed


def lines_of(path: Path) -> int:
    return len(path.read_text().splitlines())


def test_the_size_rule_in_design_names_the_limit_this_test_holds():
    words = " ".join(size_rule_lines()).split()
    assert f"Past {MAX_LINES} lines" in " ".join(words)


def test_no_module_passes_the_limit_unless_design_names_it_with_its_reason():
    allowed = long_modules_allowed()
    found = []
    for path in MODULES.values():
        name = path.relative_to(PACKAGE).as_posix()
        size = lines_of(path)
        if size > MAX_LINES and name not in allowed:
            found.append(
                f"meshkit/{name}: {size} lines, over {MAX_LINES}: split it by concept (never "
                f"shorten code to fit), or name it in meshkit/DESIGN.md's list under "
                f"{SIZE_RULE[2:]!r} with the reason it is one concept"
            )
    assert not found, "\n".join(["", *found])


def test_every_long_module_named_in_design_is_still_long():
    found = []
    for name, reason in long_modules_allowed().items():
        path = PACKAGE / name
        if not path.is_file():
            found.append(f"meshkit/DESIGN.md names meshkit/{name} ({reason}): no such module")
        elif lines_of(path) <= MAX_LINES:
            found.append(
                f"meshkit/DESIGN.md names meshkit/{name} as past {MAX_LINES} lines: it has "
                f"{lines_of(path)}, so take it off the list"
            )
    assert not found, "\n".join(["", *found])
