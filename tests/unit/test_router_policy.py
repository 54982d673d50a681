"""The data-parallel router's pieces without HTTP: the prefix tree, route keys, the policy."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from plait.server import route_keys
from plait.server.prefix_tree import PrefixTree
from plait.server.routing import NoReplicaError, Router, RouterConfig


def test_prefix_tree_matches_longest_inserted_prefix():
    tree = PrefixTree()
    tree.insert("system: be brief\nuser: hi")
    tree.insert("system: be brief\nuser: bye")
    assert tree.match_prefix("system: be brief\nuser: hello") == len("system: be brief\nuser: h")
    assert tree.match_prefix("system: be brief\nuser: bye now") == len(
        "system: be brief\nuser: bye"
    )
    assert tree.match_prefix("other") == 0
    assert tree.num_chars == len("system: be brief\nuser: hi") + len("bye")


def test_prefix_tree_matches_a_naive_model():
    rng = random.Random(0)
    tree, texts = PrefixTree(), []
    for _ in range(300):
        text = "".join(rng.choice("ab") for _ in range(rng.randint(1, 12)))
        if rng.random() < 0.5:
            tree.insert(text)
            texts.append(text)
        naive = max((_common(t, text) for t in texts), default=0)
        assert tree.match_prefix(text) == naive
    assert tree.num_chars == len({t[:i] for t in texts for i in range(1, len(t) + 1)})


def test_prefix_tree_evicts_least_recently_used_text():
    tree = PrefixTree(max_chars=20)
    tree.insert("a" * 10)
    tree.insert("b" * 10)
    tree.match_prefix("a" * 10)  # a is now more recent than b
    tree.insert("c" * 10)
    assert tree.num_chars <= 20
    assert tree.match_prefix("a" * 10) == 10
    assert tree.match_prefix("b" * 10) == 0


def _common(a: str, b: str) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_route_keys_keep_prompt_order():
    assert route_keys.generate_key({"text": ["first", "second"]}) == "first"
    assert route_keys.generate_key({"input_ids": [1, 2, 3]}) == "1,2,3,"
    assert route_keys.completion_key({"prompt": [[5, 6]]}) == "5,6,"
    one = route_keys.chat_key({"messages": [{"role": "system", "content": "S"}]})
    two = route_keys.chat_key(
        {
            "messages": [
                {"role": "system", "content": "S"},
                {"role": "user", "content": [{"type": "text", "text": "Q"}]},
            ]
        }
    )
    assert two.startswith(one) and two.endswith("<user>Q")
    assert route_keys.generate_key({"text": 3}) == ""  # the replica answers the 400
    odd = {
        "messages": [
            {
                "role": "user",
                "content": [{"type": "text", "text": 5}, {"type": "text", "text": None}],
            }
        ]
    }
    assert route_keys.chat_key(odd) == "<user>"


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=5),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=12,
)
_fields = st.sampled_from(
    ["text", "input_ids", "prompt", "messages", "tools", "content", "type", "role"]
)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(
    st.dictionaries(
        _fields,
        _json | st.lists(st.dictionaries(_fields, _json, max_size=3), max_size=3),
        max_size=4,
    )
)
def test_route_keys_of_any_body_are_strings(body):
    """Malformed bodies reach the replica, which answers the 400 naming the field: the router's
    key never raises."""
    for key in (route_keys.generate_key, route_keys.completion_key, route_keys.chat_key):
        assert isinstance(key(body), str)


def test_cache_aware_follows_the_prefix_then_balances():
    router = Router.for_urls(["http://a", "http://b"], RouterConfig(balance_abs_threshold=2))
    a, b = router.replicas
    first = router.choose("shared system prompt. question 1")
    assert first.reason == "least_loaded"
    first.replica.in_flight += 1
    again = router.choose("shared system prompt. question 2")
    assert (again.replica, again.reason) == (first.replica, "cache")
    other = router.choose("a completely different prompt")
    assert other.replica is not first.replica  # least loaded
    first.replica.in_flight = 5  # imbalanced: 5 - 0 > 2 and 5 > 1.5 * 0
    assert router.choose("shared system prompt. question 3").reason == "balance"


def test_round_robin_sessions_and_dead_replicas():
    router = Router.for_urls(["http://a", "http://b"], RouterConfig(policy="round_robin"))
    urls = [router.choose("x").replica.url for _ in range(4)]
    assert urls == ["http://a", "http://b", "http://a", "http://b"]
    pinned = router.choose("y", session="run-1").replica
    assert all(router.choose(f"z{i}", session="run-1").replica is pinned for i in range(3))
    router.mark_down(pinned, "gone")
    assert router.choose("y", session="run-1").replica is not pinned
    router.mark_down(router.healthy()[0], "gone too")
    with pytest.raises(NoReplicaError, match="no healthy replica"):
        router.choose("y")


def test_router_config_names_the_bad_field():
    with pytest.raises(ValueError, match="policy"):
        RouterConfig(policy="random")
    with pytest.raises(ValueError, match="balance_rel_threshold"):
        RouterConfig(balance_rel_threshold=0.5)


def test_prefill_replicas_prefill_and_the_others_serve():
    router = Router.for_urls(["http://d1", "http://d2"], RouterConfig(), ["http://p"])
    d1, d2, p = router.replicas
    assert router.disaggregated and [r.role for r in router.replicas] == [
        "decode",
        "decode",
        "prefill",
    ]
    served = {router.choose(f"prompt {i}").replica.url for i in range(6)}
    assert served <= {"http://d1", "http://d2"}
    assert router.choose("prompt 0", prefill=True).replica is p
    router.mark_down(p, "gone")
    with pytest.raises(NoReplicaError, match="no healthy prefill replica"):
        router.choose("x", prefill=True)
    # with no decode replica left, whole requests go to the prefill replicas
    router.mark_up(p, p.failures)
    router.mark_down(d1, "gone")
    router.mark_down(d2, "gone")
    assert router.choose("x").replica is p
    assert not Router.for_urls(["http://a"]).disaggregated
