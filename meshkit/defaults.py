"""Every configuration key with its default (config.py and the invoke-free fast path share it)."""

from __future__ import annotations

from typing import Any

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
