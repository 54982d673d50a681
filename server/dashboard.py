"""`GET /dashboard`: a live page of the engine (radix tree, KV pool, batches, latency, requests),
and `GET /dashboard/snapshot`: the JSON it polls, which scripts and `plait top` read too.

The page is a static file with no data in it: `DashboardPage` serves it before the API-key check
(a browser cannot send a bearer header when it opens a URL), and it asks for the key when the
snapshot answers 401. The snapshot obeys the key like every other route.

Nothing runs while nobody watches: the first snapshot installs the engine probe
(`dashboard_probe.StepProbe`, a subscriber to the engine's events), each one takes at most one
history row, and the probe comes off `idle_after` seconds after the last snapshot.
"""

from __future__ import annotations

import asyncio
import bisect
import time
import weakref
from collections import deque
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, FastAPI, Query, Request
from fastapi.responses import JSONResponse

from plait.radix_cache.inspect import TreeSummary, summarize_tree
from plait.server.dashboard_history import LATENCY_WINDOW_S, History
from plait.server.dashboard_page import DashboardPage
from plait.server.dashboard_probe import StepProbe, StepRecord
from plait.server.dashboard_requests import RequestLog, RouteLabel, copy_list

SNAPSHOT_VERSION = 1
KEY_TOKENS = 12  # token ids of each shown edge decoded into its label when prompts may be shown
TREE_BUDGET = 100  # a walk of the tree is reused for up to 100x the time it took
MAX_WALK = 20_000  # nodes walked at most, so a walk stays brief (beyond, the summary: `truncated`)

# by id(engine): each view holds its engine, so an id is not reused while its view lives; a view
# lives as long as an app that installed it (`install_dashboard`)
_views: weakref.WeakValueDictionary[int, EngineView] = weakref.WeakValueDictionary()


@dataclass(frozen=True)
class DashboardConfig:
    show_prompts: bool = False  # prompt text and tree edge text in the snapshot and page
    interval: float = 1.0  # seconds between history rows (and the page's poll period)
    idle_after: float = 15.0  # seconds without a snapshot after which the probe comes off
    history: int = 600  # rows kept
    max_tree_nodes: int = 64

    def __post_init__(self) -> None:
        if not 0.05 <= self.interval <= 60:
            raise ValueError(f"interval: must be in [0.05, 60] seconds, got {self.interval}")
        if self.idle_after < self.interval:
            raise ValueError(f"idle_after: must be at least interval, got {self.idle_after}")
        if self.history < 2:
            raise ValueError(f"history: must be at least 2 rows, got {self.history}")


class EngineView:
    """What the dashboard keeps for one engine; servers around the same engine share it."""

    def __init__(self, engine: Any, config: DashboardConfig) -> None:
        self.engine = engine
        self.probe = StepProbe(engine)
        self.requests = RequestLog(engine)
        self.history = History(config.history, config.interval)
        self.clock_marks: deque[tuple[int, float]] = deque(maxlen=config.history)
        self.last_watched = 0.0
        self.watched_since: float | None = None
        self._idle_timer: asyncio.TimerHandle | None = None
        self._tree: tuple[float, tuple[int, bool], float, TreeSummary] | None = None

    @classmethod
    def of(cls, engine: Any, config: DashboardConfig) -> EngineView:
        view = _views.get(id(engine))
        if view is None:
            view = _views[id(engine)] = cls(engine, config)
        return view

    def watch(self, idle_after: float) -> None:
        self.last_watched = time.monotonic()
        if not self.probe.installed:
            self.probe.install()
            self.watched_since = time.time()
        if self._idle_timer is None:
            loop = asyncio.get_running_loop()
            self._idle_timer = loop.call_later(idle_after, self._check_idle, idle_after)

    def _check_idle(self, idle_after: float) -> None:
        self._idle_timer = None
        left = self.last_watched + idle_after - time.monotonic()
        if left > 0:
            self._idle_timer = asyncio.get_running_loop().call_later(
                left, self._check_idle, idle_after
            )
            return
        self.probe.uninstall()
        self.watched_since = None

    def tree(self, nodes: int, show_prompts: bool, now: float) -> TreeSummary:
        """The tree's summary, walked again only when the last walk is older than
        `TREE_BUDGET` times its own duration (so walking a large tree takes at most ~1% of the
        event loop's time), or was asked with other options."""
        key = (nodes, show_prompts)
        cached = self._tree
        if cached is not None and cached[1] == key and now - cached[0] < cached[2] * TREE_BUDGET:
            return cached[3]
        start = time.perf_counter()
        hits = _copy_dict(self.probe.hits) if self.probe.installed else None
        tree = summarize_tree(
            self.engine.core.cache,
            max_nodes=nodes,
            hits=hits,
            key_tokens=KEY_TOKENS if show_prompts else 0,
            max_walk=MAX_WALK,
        )
        self._tree = (now, key, time.perf_counter() - start, tree)
        return tree

    def last_use_s(self, last_access: int, now: float) -> float | None:
        """Seconds since the first snapshot that saw the cache's clock past `last_access` (the
        use happened before it, after the one before); None if before the oldest kept one."""
        marks = self.clock_marks
        if not marks or last_access < marks[0][0]:
            return None
        i = bisect.bisect_left(marks, (last_access, float("-inf")))
        return max(now - marks[min(i, len(marks) - 1)][1], 0.0)


def build_snapshot(
    view: EngineView,
    config: DashboardConfig,
    since: int | None,
    nodes: int,
    model: str,
    started: float,
) -> dict[str, Any]:
    engine, probe = view.engine, view.probe
    now = time.time()
    cache = engine.core.cache
    if view.clock_marks and cache.clock < view.clock_marks[-1][0]:
        view.clock_marks.clear()  # the cache was flushed: its clock started again
    view.clock_marks.append((cache.clock, now))
    stats = engine.stats()
    live = view.requests.live(config.show_prompts)
    if view.history.due(now, config.interval):
        last = view.history.rows[-1]["time"] if view.history.rows else now - config.interval
        since_t = min(last, now - LATENCY_WINDOW_S)
        view.history.sample(
            now,
            stats,
            stats["prompt_tokens_scheduled"],
            stats["prompt_tokens_cached"],
            steps=_newer(probe.steps, last, lambda s: s.time),
            ttft=_newer(probe.ttft, since_t, lambda x: x[0]),
            itl=_newer(probe.itl, since_t, lambda x: x[0]),
            events=_newer(probe.events, last, lambda e: e["time"]),
            retracted_waiting=sum(1 for r in live if r["status"] == "retracted"),
        )
    tree = view.tree(nodes, config.show_prompts, now)
    probe.forget(
        {r["rid"] for r in live}, {n.id for n in tree.nodes} if tree.num_nodes <= nodes else None
    )
    rows = view.history.since(since)
    return {
        "version": SNAPSHOT_VERSION,
        "kind": "server",
        "time": now,
        "uptime_s": now - started,
        "model": model,
        "show_prompts": config.show_prompts,
        "interval_s": config.interval,
        "stats": _jsonable(stats),
        "current": view.history.rows[-1] if view.history.rows else None,
        "history": rows,
        "tree": _tree_json(tree, view, engine, config.show_prompts, now),
        "events": _last(probe.events, 50),
        "steps": [_step_json(s) for s in _last(probe.steps, 20)],
        "requests": {
            "live": live,
            "finished": view.requests.finished(copy_list(probe.finished), 32, config.show_prompts),
        },
        "watch": {
            "probe_installed": probe.installed,
            "watched_since": view.watched_since,
            "idle_after_s": config.idle_after,
        },
    }


def _tree_json(tree: Any, view: EngineView, engine: Any, show: bool, now: float) -> dict[str, Any]:
    nodes = []
    for n in tree.nodes:
        item = {
            "id": n.id,
            "parent": n.parent,
            "depth": n.depth,
            "tokens": n.tokens,
            "pages": n.pages,
            "subtree_tokens": n.subtree_tokens,
            "subtree_pages": n.subtree_pages,
            "subtree_nodes": n.subtree_nodes,
            "children": n.num_children,
            "locked": n.locked,
            "locks": n.own_locks,
            "evictable": n.evictable,
            "hits": n.hits,
            "last_use_s": view.last_use_s(n.last_access, now),
        }
        if show and n.key_head:
            item["text"] = engine.tokenizer.decode(list(n.key_head))
        nodes.append(item)
    return {
        "page_size": engine.page_size,
        "num_nodes": tree.num_nodes,
        "num_tokens": tree.num_tokens,
        "cached_pages": tree.cached_pages,
        "evictable_pages": tree.evictable_pages,
        "protected_pages": tree.protected_pages,
        "truncated": tree.truncated,
        "hits_counted": any(n.hits is not None for n in tree.nodes),
        "walked_at": view._tree[0] if view._tree else now,
        "nodes": nodes,
    }


def _newer(items: Any, t: float, when: Any) -> list[Any]:
    """The items of a time-ordered deque after time `t`, read from its newest end."""
    out = []
    for item in reversed(copy_list(items)):
        if when(item) <= t:
            break
        out.append(item)
    return out[::-1]


def _last(items: Any, n: int) -> list[Any]:
    """The last `n` items of a deque the engine thread appends to, oldest first."""
    return copy_list(items)[-n:]


def _copy_dict(d: dict[int, int]) -> dict[int, int]:
    for _ in range(3):
        try:
            return dict(d)
        except RuntimeError:  # it grew while copied
            continue
    return {}


def _step_json(step: StepRecord) -> dict[str, Any]:
    return step._asdict()


def _jsonable(stats: dict[str, Any]) -> dict[str, Any]:
    return {
        k: v if v is None or isinstance(v, (bool, int, float, str)) else str(v)
        for k, v in stats.items()
    }


# the routes ----------------------------------------------------------------------------------

router = APIRouter()


@router.get("/dashboard/snapshot")
async def snapshot(
    request: Request,
    since: int | None = Query(None, ge=0, description="only history rows after this seq"),
    nodes: int | None = Query(None, ge=1, le=1000, description="tree nodes to show"),
) -> JSONResponse:
    """The dashboard's data: `engine.stats()`, history rows, the radix tree's largest branches,
    KV events, recent steps, and live and recently finished requests."""
    state = request.app.state.plait
    config: DashboardConfig = request.app.state.dashboard
    view = EngineView.of(state.engine, config)
    view.watch(config.idle_after)
    body = build_snapshot(
        view, config, since, nodes or config.max_tree_nodes, state.model_name, state.started
    )
    return JSONResponse(body, headers={"Cache-Control": "no-store"})


def install_dashboard(app: FastAPI, config: DashboardConfig | None = None) -> None:
    """Adds the routes and the page; call it after the app's other middleware (the page is
    served first, before the API-key check)."""
    config = config or DashboardConfig()
    app.state.dashboard = config
    # labels requests from the first one on; the app holds the view (and so its subscriptions)
    app.state.dashboard_view = EngineView.of(app.state.plait.engine, config)
    app.include_router(router)
    app.add_middleware(RouteLabel)
    app.add_middleware(DashboardPage)
