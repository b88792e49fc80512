"""Where a saved job is indexed: beside its hostfile (``HOSTFILE_DIR/.meshkit/jobs/
HOSTFILE_NAME--SESSION.json``), so that ``status``, ``logs``, ``stop``, a bare ``train`` and each
node's ``meshkit env`` find the job from any directory. The one spelling of that path, written
with os.path: ``meshkit env`` looks for the index at every start on every node, and pathlib is
not imported there."""

from __future__ import annotations

import os


def index_root(hostfile: str) -> str:
    """The directory below which the index is written without following a link (the
    hostfile's own): ``.meshkit`` and ``jobs`` there may be planted links, the directory of
    the hostfile the user named is taken where it leads."""
    return os.path.dirname(hostfile)


def index_file(hostfile: str, session: str) -> str:
    """The index of the job ``session`` on ``hostfile`` (as given: the callers make it
    absolute)."""
    name = f"{os.path.basename(hostfile)}--{session}.json"
    return os.path.join(os.path.dirname(hostfile), ".meshkit", "jobs", name)
