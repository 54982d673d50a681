"""The order in which waiting requests are considered for admission.

- `fcfs`: arrival order.
- `lpm`: longest cached prefix first, so requests that share a prefix run while it is cached.
- `dfs-weight`: walks the radix tree depth first, heaviest subtree (most waiting requests) first,
  so requests under the same branch are admitted together.

Whatever the policy, `fair_order` then interleaves clients (`Request.client_id`), so one client's
flood cannot starve another's requests.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

from plait.radix_cache import RadixCache, TreeNode
from plait.runtime.request import Request
from plait.runtime.tuning import MAX_MATCHED_WAITING


def order_waiting(policy: str, waiting: Sequence[Request], cache: RadixCache) -> list[Request]:
    if policy == "fcfs" or cache.disable or len(waiting) > MAX_MATCHED_WAITING:
        return list(waiting)
    # NOTE: retracted requests keep their place at the front whatever the policy.
    first = [r for r in waiting if r.output_ids]
    rest = [r for r in waiting if not r.output_ids]
    matches = {r: _peek(cache, r) for r in rest}
    if policy == "lpm":
        rest.sort(key=lambda r: -matches[r][0])
    else:
        rest = _dfs_weight(rest, {r: matches[r][1] for r in rest})
    return first + rest


def fair_order(ordered: list[Request], active: Sequence[Request]) -> list[Request]:
    """Round-robin between clients, those with the fewest active requests first; the policy's
    order is kept within a client and among ties. Retracted requests stay in front."""
    clients = {r.client_id for r in ordered}
    if len(clients) <= 1:
        return ordered
    load: dict[str, int] = defaultdict(int)
    for r in active:
        load[r.client_id] += 1
    first = [r for r in ordered if r.output_ids]
    rest = [r for r in ordered if not r.output_ids]
    rank: dict[str, int] = defaultdict(int)
    keys = {}
    for r in rest:
        keys[r] = load[r.client_id] + rank[r.client_id]
        rank[r.client_id] += 1
    return first + sorted(rest, key=lambda r: keys[r])


def _peek(cache: RadixCache, req: Request) -> tuple[int, TreeNode]:
    result = cache.match_prefix(req.all_ids[:-1], record=False)
    return result.num_tokens, result.node


def _dfs_weight(reqs: list[Request], node_of: dict[Request, TreeNode]) -> list[Request]:
    by_node: dict[int, list[Request]] = defaultdict(list)
    weight: dict[int, int] = defaultdict(int)
    nodes: dict[int, TreeNode] = {}
    for r in reqs:
        node = node_of[r]
        by_node[node.id].append(r)
        cursor: TreeNode | None = node
        while cursor is not None:
            weight[cursor.id] += 1
            nodes[cursor.id] = cursor
            cursor = cursor.parent
    root = next(n for n in nodes.values() if n.parent is None)
    ordered: list[Request] = []
    stack = [root]
    while stack:
        node = stack.pop()
        ordered.extend(by_node.get(node.id, ()))
        children = [c for c in node.children.values() if weight.get(c.id)]
        children.sort(key=lambda c: weight[c.id])  # heaviest popped first
        stack.extend(children)
    return ordered
