"""Triton kernels of the graph-captured decode step, each beside its plain-torch reference."""
