"""Routing traces and agent sessions, replayed against placement policies and the engine."""
