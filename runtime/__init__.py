"""Serving model calls: the Engine and everything below it."""
