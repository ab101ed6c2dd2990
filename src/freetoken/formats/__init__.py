"""Checkpoint readers and writers, tensor-name tables, quant codecs."""
