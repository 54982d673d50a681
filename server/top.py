"""`plait top`: the dashboard's snapshot in the terminal, one screen, refreshed every second, for
servers without a browser nearby. It reads `GET /dashboard/snapshot` like the page does."""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from collections import deque
from typing import Any

SPARKS = "▁▂▃▄▅▆▇█"
KEEP_ROWS = 120


def add_top_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("top", help="a live view of a running server in the terminal")
    parser.add_argument("--url", default="http://127.0.0.1:30000", help="the server or router")
    parser.add_argument(
        "--api-key", dest="api_key", default=None, help="the server's key (default: none)"
    )
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes")
    parser.add_argument(
        "--replica",
        type=int,
        default=None,
        help="behind a router: which replica (default: the router's view of all)",
    )
    parser.add_argument("--once", action="store_true", help="print one screen and exit")
    parser.set_defaults(func=run_top)
    return parser


def run_top(args: argparse.Namespace) -> int:
    import httpx

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    rows: deque[dict[str, Any]] = deque(maxlen=KEEP_ROWS)
    since: int | None = None
    with httpx.Client(base_url=args.url.rstrip("/"), headers=headers, timeout=10) as http:
        try:
            while True:
                params: dict[str, Any] = {} if since is None else {"since": since}
                if args.replica is not None:
                    params["replica"] = args.replica
                try:
                    r = http.get("/dashboard/snapshot", params=params)
                except httpx.HTTPError as e:
                    screen = f"plait top  {args.url}\n\nno answer: {type(e).__name__}: {e}\n"
                else:
                    if r.status_code == 401:
                        print(
                            f"plait top: {args.url} needs its API key (--api-key)", file=sys.stderr
                        )
                        return 2
                    r.raise_for_status()
                    snap = r.json()
                    new = snap.get("history") or []
                    if new and since is not None and new[0]["seq"] <= since:
                        rows.clear()  # the server restarted
                    rows.extend(new)
                    since = rows[-1]["seq"] if rows else since
                    size = shutil.get_terminal_size((120, 40))
                    screen = render(snap, list(rows), args.url, size.columns, size.lines)
                if args.once:
                    sys.stdout.write(screen)
                    return 0
                sys.stdout.write("\x1b[H\x1b[2J" + screen)
                sys.stdout.flush()
                time.sleep(args.interval)
        except KeyboardInterrupt:
            return 0


# rendering (pure: tests call it on a snapshot) ------------------------------------------------


def render(
    snap: dict[str, Any], rows: list[dict[str, Any]], url: str, width: int = 120, height: int = 40
) -> str:
    """One screen of text, at most `height` lines of at most `width` characters."""
    if snap.get("error"):
        return f"plait top  {url}\n\n{snap['error']}\n"
    s, cur, tree = snap["stats"], snap.get("current") or {}, snap["tree"]
    spark_w = max(10, min(60, width - 40))
    lines = [_header(snap, url)]
    lines.append(
        f"requests  running {s['num_running']}  waiting {s['num_waiting']}  "
        f"retracted {s.get('num_retracted', 0)}  |  "
        f"output {_num(cur.get('output_tokens_per_s'))} tok/s"
        f"  |  TTFT P50 {_sec(cur.get('ttft_p50_s'))} P99 {_sec(cur.get('ttft_p99_s'))}"
        f"  |  ITL P50 {_sec(cur.get('itl_p50_s'))} P99 {_sec(cur.get('itl_p99_s'))}"
    )
    lines.append(_pool_line(s, max(10, min(50, width - 90))))
    lines.append(
        f"cache     hit rate {_pct(s.get('cache_hit_rate'))} since start, "
        f"{_pct(cur.get('window_hit_rate'))} last interval  |  nodes {tree['num_nodes']}  "
        f"tokens {tree['num_tokens']}  |  "
        f"{spark([r.get('window_hit_rate') for r in rows], spark_w, 1.0)}"
    )
    lines.append(
        f"steps     batch {_num(cur.get('batch_size'))}  tokens/step: prefill "
        f"{_num(cur.get('prefill_tokens_per_step'))}  "
        f"decode {_num(cur.get('decode_tokens_per_step'))}"
        f"  verify {_num(cur.get('verify_tokens_per_step'))}  jump-forward "
        f"{_num(cur.get('jump_forward_tokens_per_step'))}  |  "
        f"step {_num(cur.get('step_time_ms'))} ms"
    )
    lines.append(f"tok/s     {spark([r.get('output_tokens_per_s') for r in rows], spark_w)}")
    events = snap.get("events") or []
    if events:
        e = events[-1]
        what = (
            f"retracted {e.get('rid')}" if e["kind"] == "retract" else f"evicted {e['pages']} pages"
        )
        lines.append(f"events    {len(events)} kept; last: {what}")
    budget = max(height - len(lines) - 3, 6)
    tree_lines = _tree_lines(tree, width, max(3, budget // 2))
    lines += ["", "radix tree (largest branches)", *tree_lines]
    lines += _request_lines(snap["requests"], width, max(2, budget - len(tree_lines)))
    return "\n".join(line[:width] for line in lines[:height]) + "\n"


def _header(snap: dict[str, Any], url: str) -> str:
    head = f"plait top  {url}  {snap.get('model', '')}  up {_dur(snap.get('uptime_s'))}"
    router = snap.get("router")
    if router:
        marks = " ".join(
            f"[{r['index']}{'' if r['healthy'] else ' down'}]"
            if r["index"] == router["selected"]
            else f" {r['index']}{'' if r['healthy'] else ' down'} "
            for r in router["replicas"]
        )
        head += f"  replicas {marks}"
    return head + "  " + time.strftime("%H:%M:%S", time.localtime(snap.get("time", time.time())))


def _pool_line(s: dict[str, Any], width: int) -> str:
    total = s.get("kv_pages_total") or 1
    in_use, cached = s.get("kv_pages_in_use", 0), s.get("kv_pages_cached", 0)
    evictable = s.get("kv_pages_evictable", 0)
    protected = cached - evictable
    cells = [("#", in_use), ("=", protected), ("-", evictable)]
    bar, used = "", 0
    for ch, n in cells:
        k = round(n / total * width)
        bar += ch * k
        used += k
    bar = (bar + "." * width)[:width]
    return (
        f"KV pool   [{bar}] in use {in_use} (#)  protected {protected} (=)  evictable "
        f"{evictable} (-)  free {s.get('kv_pages_free', 0)} of {total} pages"
    )


def _tree_lines(tree: dict[str, Any], width: int, limit: int) -> list[str]:
    nodes = tree.get("nodes") or []
    if len(nodes) <= 1:
        return ["  nothing cached yet"]
    total = nodes[0]["subtree_tokens"] or 1
    kids: dict[Any, list[dict[str, Any]]] = {}
    for n in nodes[1:]:
        kids.setdefault(n["parent"], []).append(n)
    out: list[str] = []

    def walk(n: dict[str, Any]) -> None:
        if len(out) >= limit:
            return
        bar = "█" * max(1, round(n["subtree_tokens"] / total * 20))
        hits = "-" if n.get("hits") is None else n["hits"]
        state = "locked" if n["locked"] else "evictable"
        last = "before" if n.get("last_use_s") is None else f"{_dur(n['last_use_s'])} ago"
        text = f"  {n['text']!r}" if "text" in n else ""
        indent = "  " * n["depth"]
        out.append(
            f"{indent}#{n['id']:<5} {bar:<20} {n['subtree_tokens']:>7} tok {n['pages']:>5} pages"
            f"  hits {hits:<4} {state:<9} {last}{text}"
        )
        for k in sorted(kids.get(n["id"], []), key=lambda c: -c["subtree_tokens"]):
            walk(k)

    for top in sorted(kids.get(nodes[0]["id"], []), key=lambda c: -c["subtree_tokens"]):
        walk(top)
    return out


def _request_lines(requests: dict[str, Any], width: int, limit: int) -> list[str]:
    live, done = requests.get("live") or [], requests.get("finished") or []
    head = (
        f"{'id':<18} {'source':<14} {'status':<9} {'prompt':>6} {'cached':>6} "
        f"{'generated':>11} {'constraint':<11} {'spec':>5} {'age':>8}  finish"
    )
    out = ["", f"requests: {len(live)} live, {len(done)} recently finished", head]
    for r in (live + done)[: max(limit - 3, 1)]:
        acc = "-" if r.get("spec_acceptance") is None else f"{r['spec_acceptance'] * 100:.0f}%"
        gen = f"{r['generated_tokens']}/{r['max_new_tokens']}"
        out.append(
            f"{r['rid'][:18]:<18} {r['label'][:14]:<14} {r['status']:<9} {r['prompt_tokens']:>6} "
            f"{r['cached_tokens']:>6} {gen:>11} {(r['constraint'] or '-'):<11} {acc:>5} "
            f"{_sec(r['age_s']):>8}  {r.get('finish_reason') or ''}"
        )
    return out


def spark(values: list[Any], width: int, top: float | None = None) -> str:
    """The last `width` values as block characters (blank where a value is missing)."""
    vals = values[-width:]
    nums = [v for v in vals if isinstance(v, (int, float))]
    peak = top if top is not None else max(nums, default=0.0)
    if not peak:
        return " " * (width - len(vals)) + "".join(" " if v is None else SPARKS[0] for v in vals)
    cells = []
    for v in vals:
        if not isinstance(v, (int, float)):
            cells.append(" ")
        else:
            cells.append(SPARKS[min(int(v / peak * (len(SPARKS) - 1) + 0.5), len(SPARKS) - 1)])
    return " " * (width - len(vals)) + "".join(cells)


def _num(v: Any) -> str:
    return "-" if v is None else f"{v:.1f}"


def _pct(v: Any) -> str:
    return "-" if v is None else f"{v * 100:.1f}%"


def _sec(v: Any) -> str:
    if v is None:
        return "-"
    return f"{v * 1000:.1f}ms" if v < 1 else f"{v:.2f}s"


def _dur(v: Any) -> str:
    if v is None:
        return "-"
    s = int(v)
    return (
        f"{s // 3600}h{s % 3600 // 60:02d}m"
        if s >= 3600
        else f"{s // 60}m{s % 60:02d}s"
        if s >= 60
        else f"{s}s"
    )
