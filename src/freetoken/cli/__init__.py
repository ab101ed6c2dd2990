"""Command-line interface. Importing this package must not import torch."""
