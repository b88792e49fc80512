"""Operations over a cluster (mesh, check, unmesh, preflight, launch, status, logs, stop, ...):
functions that take hosts and settings, do their phases over ``remote``, and return dataclasses.
They print nothing and never exit: the CLI renders what they return."""
