"""Errors the interpreter raises; each names the program, variable or backend involved."""

from __future__ import annotations


class UnsupportedFeatureError(RuntimeError):
    """The backend cannot do what the program asks (e.g. logprobs for `select`)."""

    def __init__(self, backend: str, feature: str, needed_by: str = "") -> None:
        self.backend = backend
        self.feature = feature
        by = f" (needed by {needed_by})" if needed_by else ""
        super().__init__(f"backend {backend!r} does not support {feature}{by}")


class BackendError(RuntimeError):
    """A transport-level failure: the server could not be reached or answered an error."""


class GenerationError(RuntimeError):
    """A model call finished with `abort` (rejected, out of memory, aborted)."""


class OutputParseError(ValueError):
    """The generated text of a typed `gen` (dtype, json_schema) did not parse."""

    def __init__(self, name: str | None, text: str, reason: str) -> None:
        self.name = name
        self.text = text
        super().__init__(f"gen {name!r}: {reason}; generated text: {text[:200]!r}")


class ProgramCancelled(RuntimeError):
    """The state was cancelled (its program failed or was stopped); nothing more runs on it."""
