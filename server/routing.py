"""Which replica serves a request: the data-parallel router's policy, free of HTTP.

`Router.choose(key)` follows the replica whose `PrefixTree` holds the longest prefix of the
request's text, unless the load is imbalanced (then the least-loaded replica) or the best match
is too short to matter (then the least-loaded replica, the one holding the least text on ties).
A session id pins every request of one program run to one replica.

A replica is routed to while it is healthy: `mark_down` (a failed forward, a failed health probe,
its process gone) takes it out of the candidates, `mark_up` (a health probe that passed) puts it
back.

With prefill replicas (prefill–decode disaggregation), requests go to the others (the decode
replicas), and `choose(..., prefill=True)` picks the replica that prefills a request's prompt for
them, by the same policy. With no decode replica healthy, whole requests go to the prefill
replicas.
"""

from __future__ import annotations

import itertools
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from plait.server.prefix_tree import PrefixTree

POLICIES = ("cache_aware", "round_robin", "least_loaded")


@dataclass(frozen=True)
class RouterConfig:
    policy: str = "cache_aware"
    cache_threshold: float = 0.5  # follow the cache when it holds this fraction of the prompt
    balance_abs_threshold: int = 4  # imbalanced when max - min load exceeds this ...
    balance_rel_threshold: float = 1.5  # ... and max load exceeds this times the min load
    max_tree_chars: int = 2_000_000  # per replica; least-recently-used text is forgotten past it
    health_interval: float = 1.0  # seconds between /health probes of each replica
    max_attempts: int = 3  # replicas one request may try before it fails
    max_sessions: int = 10_000
    # with prefill replicas: shorter prompts (in characters) are prefilled where they decode
    prefill_min_chars: int = 0

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy: expected one of {', '.join(POLICIES)}, got {self.policy!r}")
        if not 0.0 <= self.cache_threshold <= 1.0:
            raise ValueError(f"cache_threshold: must be in [0, 1], got {self.cache_threshold}")
        if self.balance_abs_threshold < 0:
            raise ValueError(
                f"balance_abs_threshold: must be non-negative, got {self.balance_abs_threshold}"
            )
        if self.balance_rel_threshold < 1.0:
            raise ValueError(
                f"balance_rel_threshold: must be at least 1, got {self.balance_rel_threshold}"
            )
        if self.prefill_min_chars < 0:
            raise ValueError(
                f"prefill_min_chars: must be non-negative, got {self.prefill_min_chars}"
            )
        for name in ("max_tree_chars", "max_attempts", "max_sessions"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be positive, got {getattr(self, name)}")
        if self.health_interval <= 0:
            raise ValueError(f"health_interval: must be positive, got {self.health_interval}")


@dataclass
class Replica:
    url: str
    tree: PrefixTree
    healthy: bool = True
    in_flight: int = 0
    served: int = 0
    failures: int = 0  # failed forwards and probes that marked it down
    downs: int = 0  # times it went from routed-to to down
    last_error: str | None = None
    process: Any = None  # the `ServerProcess` when the router started this replica
    role: str = "both"  # prefill | decode with prefill–decode disaggregation

    def describe(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "role": self.role,
            "healthy": self.healthy,
            "in_flight": self.in_flight,
            "served": self.served,
            "failures": self.failures,
            "downs": self.downs,
            "last_error": self.last_error,
            "tree_chars": self.tree.num_chars,
        }


@dataclass(frozen=True)
class Decision:
    replica: Replica
    reason: str  # cache | balance | least_loaded | round_robin | sticky
    matched_chars: int


class NoReplicaError(RuntimeError):
    """No healthy replica is left to serve the request."""


@dataclass
class Router:
    config: RouterConfig
    replicas: list[Replica] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._turn = itertools.count()
        self._sessions: OrderedDict[str, str] = OrderedDict()
        # NOTE: the health monitor marks replicas down and up from its own thread while requests
        # are routed on the event loop; one lock keeps a replica's health and tree consistent.
        self._lock = threading.Lock()

    @classmethod
    def for_urls(
        cls, urls: list[str], config: RouterConfig | None = None, prefill_urls: Sequence[str] = ()
    ) -> Router:
        """Replicas serving `urls`; with `prefill_urls`, those prefill and `urls` decode."""
        config = config or RouterConfig()
        if not urls:
            raise ValueError("replicas: at least one replica URL is needed")
        role = "decode" if prefill_urls else "both"
        replicas = [
            Replica(u.rstrip("/"), PrefixTree(config.max_tree_chars), role=role) for u in urls
        ]
        replicas += [
            Replica(u.rstrip("/"), PrefixTree(config.max_tree_chars), role="prefill")
            for u in prefill_urls
        ]
        return cls(config, replicas)

    @property
    def disaggregated(self) -> bool:
        """Whether prompts are prefilled on prefill replicas for the decode replicas."""
        return any(r.role == "prefill" for r in self.replicas)

    def healthy(self, exclude: frozenset[str] = frozenset()) -> list[Replica]:
        return [r for r in self.replicas if r.healthy and r.url not in exclude]

    def candidates(self, exclude: frozenset[str], prefill: bool) -> list[Replica]:
        """The healthy replicas a request (or, with `prefill`, its prefill half) may go to."""
        healthy = self.healthy(exclude)
        wanted = [r for r in healthy if (r.role == "prefill") == prefill]
        if not wanted and not prefill:  # no decode replica left: prefill replicas serve it whole
            return healthy
        return wanted

    def choose(
        self,
        key: str,
        session: str | None = None,
        exclude: frozenset[str] = frozenset(),
        prefill: bool = False,
    ) -> Decision:
        """The replica for a request whose prompt text is `key` (with `prefill`: the prefill
        replica for it); records the text in its tree."""
        with self._lock:
            candidates = self.candidates(exclude, prefill)
            if not candidates:
                kind = "prefill replica" if prefill else "replica"
                down = ", ".join(r.url for r in self.replicas if not r.healthy) or "none"
                raise NoReplicaError(f"no healthy {kind} left to try (down: {down})")
            decision = self._sticky(session, candidates) or self._pick(key, candidates)
            if self.config.policy == "cache_aware":
                decision.replica.tree.insert(key)
            if session is not None:
                self._sessions[session] = decision.replica.url
                self._sessions.move_to_end(session)
                while len(self._sessions) > self.config.max_sessions:
                    self._sessions.popitem(last=False)
            return decision

    def mark_down(self, replica: Replica, error: str) -> bool:
        """A replica that failed is routed around, and what the router knew of its cache goes.
        True if it was routed to until now."""
        with self._lock:
            was_up = replica.healthy
            replica.healthy = False
            replica.failures += 1
            if was_up:
                replica.downs += 1
            replica.last_error = error
            replica.tree.clear()
            return was_up

    def mark_up(self, replica: Replica, failures: int) -> bool:
        """Routes to `replica` again after a health probe passed, unless it failed after the probe
        was sent (`failures` is its count then): a stale answer must not revive a dead replica.
        True if it was down until now."""
        with self._lock:
            if replica.healthy or replica.failures != failures:
                return False
            replica.healthy = True
            return True

    def _sticky(self, session: str | None, candidates: list[Replica]) -> Decision | None:
        url = self._sessions.get(session) if session is not None else None
        replica = next((r for r in candidates if r.url == url), None)
        return Decision(replica, "sticky", 0) if replica is not None else None

    def _pick(self, key: str, candidates: list[Replica]) -> Decision:
        policy = self.config.policy
        if policy == "round_robin":
            return Decision(candidates[next(self._turn) % len(candidates)], "round_robin", 0)
        if policy == "least_loaded" or self._imbalanced(candidates):
            reason = "least_loaded" if policy == "least_loaded" else "balance"
            return Decision(_least_loaded(candidates), reason, 0)
        matches = [(r.tree.match_prefix(key), -r.in_flight, -i) for i, r in enumerate(candidates)]
        matched, _, neg_index = max(matches)
        if key and matched / len(key) >= self.config.cache_threshold:
            return Decision(candidates[-neg_index], "cache", matched)
        return Decision(_least_loaded(candidates), "least_loaded", matched)

    def _imbalanced(self, candidates: list[Replica]) -> bool:
        loads = [r.in_flight for r in candidates]
        high, low = max(loads), min(loads)
        cfg = self.config
        return high - low > cfg.balance_abs_threshold and high > cfg.balance_rel_threshold * low


def _least_loaded(candidates: list[Replica]) -> Replica:
    return min(candidates, key=lambda r: (r.in_flight, r.tree.num_chars))
