"""FreeToken runtime."""
