"""Executing plait programs against a backend."""
