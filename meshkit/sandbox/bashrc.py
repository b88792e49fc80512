"""The nodes' ~/.bashrc: a plain one, or one that costs what conda's does and counts every shell
sshd starts (so that tests and benchmarks can see how many shells meshkit costs a node)."""

from __future__ import annotations

from .layout import Layout

NODE_BASHRC = "# meshkit sandbox node: the host's ~/.bashrc does not run on the nodes\n"

# Where the conda-like bashrc counts shells: one line per shell, the command it was started for.
SHELLS_FILE = ".meshkit-shells"  # in the node's own /tmp
# What `conda init` leaves in ~/.bashrc, in cost: a Python process per shell (conda's hook is
# `conda shell.bash hook`; pyenv's `pyenv init -`), with no `case $- in *i*` guard, so every
# shell sshd starts for an exec channel pays it. The hook burns a fixed 0.09 s of its own CPU
# (plus the interpreter's start-up, about 0.1 s in all), the same on a busy machine as on an
# idle one; its output is eval'ed as conda's is.
CONDA_BASHRC = r"""# meshkit sandbox node: a conda-init-like ~/.bashrc (no interactive guard)
__mk_cmd=${BASH_EXECUTION_STRING:-interactive}
__mk_cmd=${__mk_cmd//$'\n'/ }
printf '%s\n' "${__mk_cmd:0:200}" >> /tmp/.meshkit-shells 2>/dev/null
unset __mk_cmd
# >>> conda initialize >>>
__conda_setup="$(/usr/bin/python3 -c '
import time
start = time.process_time()
while time.process_time() - start < 0.09:
    pass
print("export CONDA_SHLVL=1")
' 2>/dev/null)"
if [ $? -eq 0 ]; then
    eval "$__conda_setup"
fi
unset __conda_setup
# <<< conda initialize <<<
"""


def reset_shells(sandbox: Layout) -> None:
    """Empty every node's shell counter (a reboot empties it too)."""
    for node in sandbox.nodes:
        (sandbox.node_dir(node) / "tmp" / SHELLS_FILE).unlink(missing_ok=True)


def shells(sandbox: Layout) -> list[list[str]]:
    """Per node, in rank order: the shells started since ``reset_shells``, each as the command
    it was started for (``interactive`` for a login shell such as tmux's). Only the ``conda``
    bashrc counts; a ``minimal`` sandbox gives empty lists."""
    counted = []
    for node in sandbox.nodes:
        path = sandbox.node_dir(node) / "tmp" / SHELLS_FILE
        if path.exists():
            counted.append(path.read_text(errors="replace").splitlines())
        else:
            counted.append([])
    return counted
