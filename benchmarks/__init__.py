"""meshkit's benchmarks: ``python -m benchmarks`` (root; builds sandbox clusters)."""
