"""FreeToken: large Mixture-of-Experts models on one small GPU."""

__version__ = "0.1.0"
