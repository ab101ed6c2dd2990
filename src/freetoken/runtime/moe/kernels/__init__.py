"""CPU expert kernels compiled at first use (C + OpenMP, loaded with ctypes)."""
