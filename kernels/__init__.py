"""Stateless tensor functions: each fast kernel beside its torch reference, one dispatch point."""
