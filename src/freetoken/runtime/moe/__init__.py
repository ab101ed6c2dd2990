"""Mixture-of-Experts: host pool, expert executors (the `--moe-backend` axis), expert kernels."""
