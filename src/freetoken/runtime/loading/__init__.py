"""Loading: model references and the catalog, checkpoints of every format into the model and the pool."""
