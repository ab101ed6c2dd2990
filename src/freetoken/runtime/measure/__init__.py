"""Measuring the machine: bandwidths, the saved profile, the CPU cores other processes leave."""
