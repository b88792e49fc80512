"""`invoke <task>` from the repository root runs meshkit's tasks (same as the `meshkit` script)."""

from meshkit.tasks import ns

__all__ = ["ns"]
