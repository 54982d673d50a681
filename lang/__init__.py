"""The plait language: programs, primitives and IR nodes (plain data)."""
