"""Token indexes built in a child process, so that a pattern that needs too much time or memory is
stopped rather than waited for: the child is killed (timeout) or dies at its address-space limit,
and the pattern is rejected with a `GrammarError` (HTTP 400). The static limits (`limits.py`)
reject the obvious cases before this; the sandbox bounds what they miss (product blow-ups such as
`[^x]{1,300}\\w+`, which take minutes and gigabytes in process).

One child per compiling thread, started on first use (`python -m` this module, so nothing of the
parent's `__main__` runs again) with the vocabulary; it answers pickled `Index` objects over
its stdout. For a JSON schema the child also writes the regex, whose size can explode before
any index is built. Linux and macOS only; elsewhere indexes are built in process.
"""

from __future__ import annotations

import os
import pickle
import select
import struct
import subprocess
import sys
import threading
from typing import Any

from .base import GrammarError

_HEADER = struct.Struct("<Q")
MAX_INDEX_BYTES = 256 << 20  # one compiled index, as the child sends it
SUPPORTED = os.name == "posix"


class IndexSandbox:
    def __init__(self, vocabulary: Any, timeout: float, memory_mb: int) -> None:
        self.vocabulary = pickle.dumps(vocabulary)
        self.timeout = timeout
        self.memory_mb = memory_mb
        self._local = threading.local()
        self._children: list[subprocess.Popen] = []
        self._lock = threading.Lock()

    def build(self, regex: str, name: str) -> tuple[Any, int]:
        """The `Index` of `regex` and its size in bytes (as sent); `GrammarError` naming `name`
        past the time or memory limit. Other build errors are re-raised as `RuntimeError` with
        the child's message."""
        index, _, nbytes = self._ask(("regex", regex), name)
        return index, nbytes

    def build_key(self, key: Any, sentinel: str | None) -> tuple[Any, str, int]:
        """The `Index`, regex and index size of a JSON-schema `GrammarKey`: the child writes the
        regex too, since a schema's regex can itself outgrow memory (deep `$ref` chains
        unrolled). The regex is wrapped as `(?:regex)sentinel` for the index when `sentinel` is
        given."""
        return self._ask(("key", key, sentinel), key.kind)

    def _ask(self, request: tuple, name: str) -> tuple[Any, str, int]:
        child = self._child()
        try:
            _write(child.stdin, pickle.dumps(request))
            ready, _, _ = select.select([child.stdout], [], [], self.timeout)
            if not ready:
                self._kill(child)
                raise GrammarError(
                    f"{name}: compiling the constraint took longer than {self.timeout:g} s; "
                    f"simplify it"
                )
            reply = pickle.loads(_read(child.stdout))
        except (EOFError, BrokenPipeError, OSError, pickle.UnpicklingError):
            self._kill(child)
            raise GrammarError(
                f"{name}: compiling the constraint needs more than {self.memory_mb} MB; simplify it"
            ) from None
        if reply[0] == "refused":  # the child's GrammarError, of the same class
            raise reply[1]
        if reply[0] != "ok":
            raise RuntimeError(reply[1])
        _, payload, regex = reply
        if len(payload) > MAX_INDEX_BYTES:  # it would stay in the parent's grammar cache
            raise GrammarError(
                f"{name}: the compiled constraint takes {len(payload) >> 20} MB; the limit is "
                f"{MAX_INDEX_BYTES >> 20} MB; simplify it"
            )
        return pickle.loads(payload), regex, len(payload)

    def _child(self) -> subprocess.Popen:
        child = getattr(self._local, "child", None)
        if child is not None and child.poll() is None:
            return child
        child = subprocess.Popen(
            [sys.executable, "-m", __name__, str(self.memory_mb)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        _write(child.stdin, self.vocabulary)
        self._local.child = child
        with self._lock:
            self._children = [c for c in self._children if c.poll() is None] + [child]
        return child

    def _kill(self, child: subprocess.Popen) -> None:
        child.kill()
        child.wait()
        self._local.child = None

    def close(self) -> None:
        with self._lock:
            children, self._children = self._children, []
        for child in children:
            if child.poll() is None:
                child.kill()
                child.wait()


def _write(stream: Any, data: bytes) -> None:
    stream.write(_HEADER.pack(len(data)) + data)
    stream.flush()


def _read(stream: Any) -> bytes:
    header = stream.read(_HEADER.size)
    if len(header) < _HEADER.size:
        raise EOFError
    (size,) = _HEADER.unpack(header)
    data = stream.read(size)
    if len(data) < size:
        raise EOFError
    return data


def _serve(memory_mb: int) -> None:
    """The child: reads the vocabulary, then answers one index per request until stdin closes.
    A request is `("regex", regex)` or `("key", GrammarKey, sentinel)`."""
    import resource

    if memory_mb:
        limit = memory_mb << 20
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    from outlines_core import Index

    from .patterns import escape
    from .spec import grammar_key_to_regex

    inp, out = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # stray prints must not corrupt the frames
    vocabulary = pickle.loads(_read(inp))
    while True:
        try:
            request = pickle.loads(_read(inp))
        except EOFError:
            return
        try:
            if request[0] == "regex":
                regex = indexed = request[1]
            else:
                _, key, sentinel = request
                regex = grammar_key_to_regex(key)
                indexed = regex if sentinel is None else f"(?:{regex}){escape(sentinel)}"
            reply: tuple = ("ok", pickle.dumps(Index(indexed, vocabulary)), regex)
        except GrammarError as e:
            reply = ("refused", e)
        except BaseException as e:  # Rust panics are BaseExceptions (pyo3's PanicException)
            if isinstance(e, (KeyboardInterrupt, SystemExit)):
                raise
            reply = ("error", str(e) or type(e).__name__)
        _write(out, pickle.dumps(reply))


if __name__ == "__main__":
    _serve(int(sys.argv[1]))
