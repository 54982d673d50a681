"""Unknown program arguments while tracing (see `plait.lang.trace`)."""

from __future__ import annotations

from typing import Any, NoReturn


class TraceStop(Exception):
    """Raised inside a traced program where its text stops being constant."""


class Placeholder:
    """An argument not known while tracing: any use of it ends the trace."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"<argument {self.name}>"

    def _stop(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise TraceStop(f"uses argument {self.name!r}")

    __str__ = __format__ = __iter__ = __len__ = __bool__ = __contains__ = _stop
    __getitem__ = __getattr__ = __call__ = __int__ = __float__ = __index__ = _stop
    __add__ = __radd__ = __mul__ = __rmul__ = __mod__ = __eq__ = __ne__ = __hash__ = _stop
    __lt__ = __le__ = __gt__ = __ge__ = _stop
