"""What runs on every node: the agent (``python -m meshkit.node serve``) that answers the
controller's requests, and the keeper (``python -m meshkit.node keep DIR``) that runs one job.

Standard library only, and nothing printed except protocol lines: this is imported on every node
at every launch, status and stop.
"""
