"""Every user-facing error meshkit raises, in one place (one type per kind of failure, as libtmux
does). The CLI turns any ``MeshkitError`` into its message and a non-zero exit, never a traceback.
Standard library only: node-side code imports this module too."""

from __future__ import annotations


class MeshkitError(Exception):
    """A problem the user can fix; ``str()`` is one line per problem, each naming where
    (``file:line`` or the host) and the fix."""

    exit_code = 1

    def __init__(self, problems: str | list[str]) -> None:
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        super().__init__("\n".join(self.problems))


class UsageError(MeshkitError):
    """A flag or config value is malformed (exit code 2)."""

    exit_code = 2


class HostfileError(MeshkitError):
    """The hostfile (or a filter) is malformed or cannot be read; each problem names
    ``path:line`` and the fix. Bad input: exit code 2, as for every usage error."""

    exit_code = 2


class ConfigError(UsageError):
    """A configuration file or ``MESHKIT_*`` variable is malformed."""


class TopologyError(MeshkitError):
    """This node cannot be placed in the hostfile (no match, or several). Bad input (exit code
    2): the hostfile given does not describe this machine, or ``--node-rank`` is needed; no node
    failed and nothing was touched."""

    exit_code = 2


class SourceError(MeshkitError):
    """A launcher's variables (SLURM, OpenMPI, PBS, torchrun) are present but unusable."""


class DistEnvError(MeshkitError):
    """The pieces of a node environment contradict each other."""


class KeyFormatError(MeshkitError):
    """A public key line is not a well-formed SSH public key."""


class UnsafeFileError(MeshkitError):
    """A node's ``~/.ssh`` file is one sshd would refuse (mode, owner, symlink): reported, never
    repaired into one it accepts."""


class UntrustedFileError(MeshkitError):
    """A configuration file, ssh_config or hostfile that another local user owns or can write:
    refused as OpenSSH refuses such a config file, and nothing done (exit code 2)."""

    exit_code = 2


class JobError(MeshkitError):
    """A job description is missing or malformed, or clashes with another job."""


class RemoteError(MeshkitError):
    """A node cannot be reached or used; the message names the node and what to do."""


class PhaseTimeout(RemoteError):
    """A phase did not finish within the timeout it names; its connection was closed so that
    nothing after it waits on the dead link again."""

    def __init__(self, phase: str, seconds: float, setting: str = "command_timeout") -> None:
        self.phase = phase
        self.seconds = seconds
        super().__init__(
            f"{phase}: no answer within {seconds:.0f}s ({setting}); the link or the node is down, "
            "nothing more was done there"
        )


class AgentGone(RemoteError):
    """The node agent exited (e.g. its interpreter is missing): its exit code and stderr."""

    def __init__(self, code: int, stderr: str) -> None:
        self.code = code
        self.stderr = stderr
        message = f"node agent exited {code}"
        if stderr.strip():
            message = stderr.splitlines()[-1]
        super().__init__(message)


class ProtocolError(RemoteError):
    """A node agent's reply is malformed or too large."""


class NodeFailed(RemoteError):
    """The agent answered that the request failed on the node (a damaged state file, say); the
    agent itself is fine: the node answers, unlike a timeout or a lost connection."""


class LaunchError(MeshkitError):
    """Preflight or launch failed; nothing (or nothing more) was started."""


class MeshAbort(MeshkitError):
    """Some nodes failed before anything was written; nothing was changed."""


class SandboxError(MeshkitError):
    """The sandbox cannot be created, changed or removed."""
