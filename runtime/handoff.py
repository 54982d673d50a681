"""`Engine.handoff`: an engine's part in prefill–decode disaggregation.

The prefill engine runs `prefill(...)` with the arguments `generate` takes: the same checks and
tokenization, then each distinct prompt is prefilled and not decoded, and its KV comes back as a
`KVRun`. The decode engine takes the runs with `import_runs(...)` and then serves the request
with `generate(...)` as usual: its prompt is a cache hit but for the last token, whose logits
give the first output token, so the output is the one the decode engine would give alone.

    runs = prefiller.handoff.prefill(prompt, params).runs
    decoder.handoff.import_runs(runs)
    out = decoder.generate(prompt, params)

Both engines must load the same model with the same KV dtype and page size: another engine's run
is refused as `foreign` (a miss: the decode engine then prefills the prompt itself).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

from plait.runtime.kv_tiers.block_format import BlockError
from plait.runtime.kv_tiers.handoff import ImportResult, KVRun, decode_runs
from plait.runtime.protocol import LogprobOptions, SamplingParams
from plait.runtime.request import Request
from plait.runtime.tuning import GIL_FREE_CHARS

logger = logging.getLogger("plait.engine")

# `generate` arguments that mean nothing to a prefill (no token is sampled)
_IGNORED = frozenset(
    {"return_logprob", "logprob_start_len", "top_logprobs_num", "return_text_in_logprobs", "stream"}
)


@dataclass
class Prefilled:
    runs: list[KVRun]  # one per distinct prompt that has whole pages to hand over
    outputs: list[dict]  # each prompt's prefill-only result: finish reason, prompt tokens, ...

    @property
    def error(self) -> str | None:
        """Why a prompt was not prefilled (its abort message), if one was not."""
        for out in self.outputs:
            reason = out["meta_info"]["finish_reason"] or {}
            if reason.get("type") == "abort":
                return str(reason.get("message"))
        return None


class Handoff:
    def __init__(self, engine: Any) -> None:
        self._engine = engine

    # the prefill side --------------------------------------------------------------------------

    def prefill(self, *args: Any, **kwargs: Any) -> Prefilled:
        """`async_prefill` from synchronous code."""
        return asyncio.run(self.async_prefill(*args, **kwargs))

    async def async_prefill(
        self,
        text: str | list[str] | None = None,
        sampling_params: dict | list[dict] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        rid: str | list[str] | None = None,
        timeout: float | None = None,
        client_id: str | None = None,
        **ignored: Any,
    ) -> Prefilled:
        """Prefills the prompts `generate` would get from the same arguments (checked alike: a
        `ValueError` names what is wrong) and returns their KV. `n` samples of a prompt share one
        run; logprob and stream options are accepted and mean nothing here."""
        unknown = sorted(set(ignored) - _IGNORED)
        if unknown:
            raise TypeError(f"async_prefill: unknown argument(s) {', '.join(unknown)}")
        engine = self._engine
        handoff = engine.core.kv_handoff()
        args = (text, input_ids, sampling_params, LogprobOptions(), rid, timeout, client_id)
        if isinstance(text, str) and len(text) >= GIL_FREE_CHARS:
            reqs, _ = await asyncio.to_thread(engine._make_requests, *args)
        else:
            reqs, _ = engine._make_requests(*args)
        reqs = _prefill_only(reqs)
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[tuple[int, dict, Any]] = asyncio.Queue()

        def sink_of(index: int, req: Request) -> Any:
            def sink(out: dict, final: bool) -> None:  # on the engine loop
                if not final:
                    return
                exported = None
                if (out["meta_info"]["finish_reason"] or {}).get("type") != "abort":
                    try:  # now, before a later step may evict the pages
                        exported = handoff.export(req)
                    except Exception:
                        logger.exception("kv handoff: exporting request %s failed", req.rid)
                loop.call_soon_threadsafe(events.put_nowait, (index, out, exported))

            return sink

        for i, req in enumerate(reqs):
            req.delivery.sink = sink_of(i, req)
        engine._submit(reqs)
        got: list[tuple[dict, Any]] = [({}, None)] * len(reqs)
        try:
            for _ in reqs:
                index, out, exported = await events.get()
                got[index] = (out, exported)
        except BaseException:
            engine._abort_all(reqs)
            raise
        exports = [exported for _, exported in got if exported is not None]
        runs = await asyncio.to_thread(lambda: [handoff.encode(e) for e in exports])
        return Prefilled(runs, [out for out, _ in got])

    # the decode side ---------------------------------------------------------------------------

    def import_runs(self, runs: list[KVRun] | bytes | memoryview) -> ImportResult:
        """Caches the runs' KV in this engine's pool for the requests that follow (a message of
        runs as bytes, or `KVRun`s). A run that is not this engine's KV of its tokens, or finds
        no room, is a miss (in `failures`); a message that is not runs at all a `ValueError`."""
        runs, checked, failures = self._check(runs)
        return self._engine.core.call(lambda: self._apply(runs, checked, failures)).result()

    async def async_import_runs(self, runs: list[KVRun] | bytes | memoryview) -> ImportResult:
        runs, checked, failures = await asyncio.to_thread(self._check, runs)
        future = self._engine.core.call(lambda: self._apply(runs, checked, failures))
        return await asyncio.wrap_future(future)

    def _check(self, data: Any) -> tuple[list[KVRun], list[memoryview | None], list[str]]:
        handoff = self._engine.core.kv_handoff()
        if isinstance(data, (bytes, bytearray, memoryview)):
            try:
                data = decode_runs(data)
            except BlockError as exc:
                handoff.count(exc.kind)
                raise ValueError(f"kv runs: {exc.kind}: {exc}") from None
        checked: list[memoryview | None] = []
        failures: list[str] = []
        for run in data:
            try:
                checked.append(handoff.check(run))
            except BlockError as exc:
                logger.warning(
                    "kv handoff: a run of %d tokens is a miss (%s: %s)",
                    len(run.tokens),
                    exc.kind,
                    exc,
                )
                checked.append(None)
                failures.append(f"{exc.kind}: {exc}")
        return data, checked, failures

    def _apply(
        self, runs: list[KVRun], checked: list[memoryview | None], failures: list[str]
    ) -> ImportResult:  # on the engine loop
        core = self._engine.core
        tokens = new = 0
        for run, payload in zip(runs, checked):
            if payload is None:
                continue
            cached, copied = core.handoff.apply(run, payload, core.scheduler.kv)
            if cached < len(run.tokens):
                failures.append(f"no_room: the pool had no pages for {len(run.tokens)} tokens")
            tokens += cached
            new += copied
        if core.config.check_invariants:
            core.scheduler.check()
        return ImportResult(len(runs), tokens, new, tuple(failures))


def _prefill_only(reqs: list[Request]) -> list[Request]:
    """One request per distinct prompt, computing its prompt and nothing after it."""
    seen: set[tuple[int, ...]] = set()
    out: list[Request] = []
    for req in reqs:
        key = tuple(req.prompt_ids)
        if key in seen:
            continue
        seen.add(key)
        req.sampling.params = SamplingParams(max_new_tokens=0)
        out.append(req)
    return out
