// The plait dashboard: polls `dashboard/snapshot` (relative to this page) and draws it.
// Every figure is an element with data-metric="<key>" (filled from the snapshot's `stats`, then
// its latest history row); its raw value is in data-value. Charts are SVG. Text from the server
// is only ever set with textContent.
"use strict";
(() => {
  const SVGNS = "http://www.w3.org/2000/svg";
  const MAX_ROWS = 600;
  const WINDOW_S = 300;
  const state = { rows: [], lastSeq: null, replica: null, key: null, interval: 1000,
                  updates: 0, failures: 0, timer: null, waitingForKey: false, generation: 0 };

  // data -------------------------------------------------------------------------------------

  function readKey() {
    const m = location.hash.match(/key=([^&]+)/);
    if (m) {
      state.key = decodeURIComponent(m[1]);
      sessionStorage.setItem("plait-dashboard-key", state.key);
      history.replaceState(null, "", location.pathname + location.search);
    } else {
      state.key = sessionStorage.getItem("plait-dashboard-key");
    }
  }

  async function poll() {
    state.timer = null;
    if (document.hidden) return schedule();  // nobody looks: let the server's probe come off
    const params = new URLSearchParams();
    if (state.lastSeq !== null) params.set("since", state.lastSeq);
    if (state.replica !== null) params.set("replica", state.replica);
    const headers = state.key ? { Authorization: "Bearer " + state.key } : {};
    const generation = state.generation;
    try {
      const r = await fetch("dashboard/snapshot?" + params, { headers, cache: "no-store" });
      if (r.status === 401) return askKey();
      if (!r.ok) throw new Error("HTTP " + r.status);
      const snap = await r.json();
      if (generation !== state.generation) return;  // another replica was chosen meanwhile
      apply(snap);
      state.failures = 0;
    } catch (e) {
      state.failures += 1;
      setStatus(state.failures > 2 ? "error" : "stale", "no answer (" + e.message + ")");
    }
    schedule();
  }

  function schedule() {
    if (state.timer === null && !state.waitingForKey) state.timer = setTimeout(poll, state.interval);
  }

  function askKey() {
    state.waitingForKey = true;
    setStatus("error", "API key needed");
    const form = document.querySelector('[data-field="auth"]');
    form.hidden = false;
    form.onsubmit = (ev) => {
      ev.preventDefault();
      state.key = form.elements.key.value;
      sessionStorage.setItem("plait-dashboard-key", state.key);
      form.hidden = true;
      state.waitingForKey = false;
      poll();
    };
  }

  function apply(snap) {
    if (snap.router) renderReplicas(snap.router);
    if (snap.error) return setStatus("error", snap.error);
    state.interval = Math.max(250, (snap.interval_s || 1) * 1000);
    const cur = snap.current;
    if (cur && state.lastSeq !== null && cur.seq < state.lastSeq) state.rows = [];  // restarted
    for (const row of snap.history || []) {
      if (state.lastSeq === null || row.seq > state.lastSeq || state.rows.length === 0) {
        state.rows.push(row);
        state.lastSeq = row.seq;
      }
    }
    if (state.rows.length > MAX_ROWS) state.rows.splice(0, state.rows.length - MAX_ROWS);
    const stats = snap.stats || {};
    const figures = Object.assign({}, cur || {}, stats, {
      uptime_s: snap.uptime_s,
      tree_nodes: snap.tree.num_nodes,
      tree_tokens: snap.tree.num_tokens,
      kv_pages_protected: (stats.kv_pages_cached || 0) - (stats.kv_pages_evictable || 0),
    });
    fillFigures(figures);
    text('[data-field="model"]', snap.model + (snap.router ? "  ·  replica " + snap.router.selected : ""));
    renderTree(svgOf("tree"), snap.tree);
    renderBranches(snap.tree);
    renderCharts(snap.events || []);
    renderEvents(snap.events || []);
    renderTiers(stats);
    renderExecution(stats);
    renderRequests("live", snap.requests.live, false, snap.show_prompts);
    renderRequests("finished", snap.requests.finished, true, snap.show_prompts);
    state.updates += 1;
    const body = document.body;
    body.dataset.updates = String(state.updates);
    body.dataset.seq = String(state.lastSeq);
    body.dataset.snapshotTime = String(snap.time);
    setStatus("live", "live · " + new Date(snap.time * 1000).toLocaleTimeString());
  }

  // figures ----------------------------------------------------------------------------------

  function fmt(v, kind) {
    if (v === null || v === undefined || (typeof v === "number" && Number.isNaN(v))) return "–";
    if (typeof v !== "number") return String(v);
    switch (kind) {
      case "int": return Math.round(v).toLocaleString("en-US");
      case "pct": return (v * 100).toFixed(1) + "%";
      case "rate": return v >= 100 ? v.toFixed(0) : v.toFixed(1);
      case "num": return v.toFixed(1);
      case "bytes": {
        const units = ["B", "KB", "MB", "GB", "TB"];
        let i = 0;
        while (v >= 1024 && i < units.length - 1) { v /= 1024; i += 1; }
        return (i ? v.toFixed(1) : String(Math.round(v))) + " " + units[i];
      }
      case "ms": return v.toFixed(v < 10 ? 2 : 1) + " ms";
      case "sec": return v < 1 ? (v * 1000).toFixed(v < 0.01 ? 2 : 1) + " ms" : v.toFixed(2) + " s";
      case "dur": {
        const s = Math.floor(v), h = Math.floor(s / 3600), m = Math.floor((s % 3600) / 60);
        return h ? h + "h " + m + "m" : m ? m + "m " + (s % 60) + "s" : s + "s";
      }
      default: return String(v);
    }
  }

  function fillFigures(figures) {
    for (const el of document.querySelectorAll("[data-metric]")) {
      const v = figures[el.dataset.metric];
      el.dataset.value = v === null || v === undefined ? "" : String(v);
      el.textContent = fmt(v, el.dataset.format);
    }
  }

  function setStatus(kind, message) {
    document.body.dataset.state = kind;
    text('[data-field="status"]', message);
  }

  function text(selector, value) {
    const el = document.querySelector(selector);
    if (el) el.textContent = value;
  }

  // svg helpers ------------------------------------------------------------------------------

  function svgOf(name) { return document.querySelector('[data-chart="' + name + '"]'); }

  function el(tag, attrs, parent) {
    const node = document.createElementNS(SVGNS, tag);
    for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
    if (parent) parent.appendChild(node);
    return node;
  }

  function label(parent, x, y, value, attrs) {
    const t = el("text", Object.assign({ x, y }, attrs || {}), parent);
    t.textContent = value;
    return t;
  }

  function clear(svg) { while (svg.firstChild) svg.removeChild(svg.firstChild); }

  function size(svg) { const vb = svg.viewBox.baseVal; return [vb.width, vb.height]; }

  // the radix tree: an icicle; a column per depth, a node's height its branch's tokens --------

  function renderTree(svg, tree) {
    clear(svg);
    const [W, H] = size(svg);
    const nodes = tree.nodes || [];
    if (nodes.length <= 1 || !nodes[0].subtree_tokens) {
      label(svg, W / 2, H / 2, "nothing cached yet", { "text-anchor": "middle", class: "empty" });
      return;
    }
    const kids = new Map();
    for (const n of nodes.slice(1)) {
      if (!kids.has(n.parent)) kids.set(n.parent, []);
      kids.get(n.parent).push(n);
    }
    const depth = Math.max(...nodes.map((n) => n.depth));
    const rootW = 70;
    const colW = (W - rootW) / depth;
    const left = (n) => (n.depth === 0 ? 0 : rootW + (n.depth - 1) * colW);
    const total = nodes[0].subtree_tokens;
    const draw = (n, y0) => {
      const h = Math.max((n.subtree_tokens / total) * H, 1.5);
      const w = n.depth === 0 ? rootW : colW;
      const cls = n.parent === null ? "node root" : n.locked ? "node locked" : "node evictable";
      const g = el("g", { class: cls, "data-node-id": n.id, "data-tokens": n.subtree_tokens }, svg);
      el("rect", { x: left(n), y: y0, width: Math.max(w - 1, 1), height: h,
                   opacity: n.parent === null ? 1 : recency(n.last_use_s) }, g);
      const tip = el("title", {}, g);
      tip.textContent = describeNode(n);
      if (h >= 12 && w >= 40) {
        const name = n.parent === null ? "root" : n.text !== undefined ? JSON.stringify(n.text) : "#" + n.id;
        const t = label(g, left(n) + 4, y0 + 11, name + " · " + n.subtree_tokens + " tok");
        t.setAttribute("textLength", String(Math.min(w - 8, t.textContent.length * 5.6)));
        t.setAttribute("lengthAdjust", "spacingAndGlyphs");
      }
      let y = y0;
      const children = (kids.get(n.id) || []).sort((a, b) => b.subtree_tokens - a.subtree_tokens);
      for (const c of children) y += draw(c, y);
      return h;
    };
    draw(nodes[0], 0);
  }

  function recency(lastUse) {  // fresh nodes solid, ones untouched for minutes faded
    if (lastUse === null || lastUse === undefined) return 0.45;
    return Math.max(0.45, 1 - lastUse / 600);
  }

  function describeNode(n) {
    if (n.parent === null) return "root: " + n.subtree_tokens + " tokens cached in " + n.subtree_nodes + " nodes";
    const hits = n.hits === null || n.hits === undefined ? "not counted" : n.hits;
    return ["node #" + n.id + " (depth " + n.depth + ")",
            "edge: " + n.tokens + " tokens, " + n.pages + " pages",
            "branch: " + n.subtree_tokens + " tokens, " + n.subtree_nodes + " nodes",
            "hits: " + hits,
            n.locked ? "locked (" + n.locks + " own locks): protected" : "unlocked: evictable",
            "last use: " + ago(n.last_use_s)].join("\n") + (n.text !== undefined ? "\n" + n.text : "");
  }

  function ago(s) { return s === null || s === undefined ? "before" : fmt(s, "dur") + " ago"; }

  function renderBranches(tree) {
    const table = document.querySelector('[data-table="branches"]');
    const top = (tree.nodes || []).slice(1).sort((a, b) => b.subtree_tokens - a.subtree_tokens).slice(0, 10);
    const cols = ["node", "depth", "edge", "branch", "pages", "hits", "state", "last use"];
    const rows = top.map((n) => ({
      attrs: { "data-node-id": n.id },
      cells: ["#" + n.id, n.depth, n.tokens, n.subtree_tokens, n.pages,
              n.hits === null ? "–" : n.hits,
              { text: n.locked ? "locked" : "evictable", cls: n.locked ? "locked" : "evictable" },
              ago(n.last_use_s)],
    }));
    fillTable(table, cols, rows, "largest branches, tokens (" + tree.num_nodes + " nodes" +
              (tree.truncated ? ", walk truncated" : "") + "; hits count since watching)");
  }

  // charts -----------------------------------------------------------------------------------

  const COLORS = { free: "#c5ccd8", evictable: "#2a9d8f", protected: "#e9c46a", inUse: "#3d5a80",
                   prefill: "#3d5a80", decode: "#2a9d8f", verify: "#9b5de5", jump: "#f4a261",
                   a: "#3d5a80", b: "#e76f51", c: "#2a9d8f", d: "#9b5de5" };

  function renderCharts(events) {
    const rows = state.rows;
    chart(svgOf("hit-rate"), rows, [
      { key: "window_hit_rate", label: "interval", color: COLORS.c },
      { key: "cache_hit_rate", label: "since start", color: COLORS.a },
    ], { max: 1, format: "pct", title: "hit rate" });
    chart(svgOf("kv-pool"), rows, [
      { key: "kv_pages_in_use", label: "in use", color: COLORS.inUse },
      { key: "kv_pages_protected", label: "protected", color: COLORS.protected },
      { key: "kv_pages_evictable", label: "evictable", color: COLORS.evictable },
      { key: "kv_pages_free", label: "free", color: COLORS.free },
    ], { stacked: true, format: "int", title: "pages", events });
    chart(svgOf("queues"), rows, [
      { key: "num_running", label: "running", color: COLORS.a },
      { key: "num_waiting", label: "waiting", color: COLORS.b, dash: true },
      { key: "num_retracted_waiting", label: "retracted", color: COLORS.d, dash: true },
    ], { format: "int", title: "requests", events: events.filter((e) => e.kind === "retract") });
    chart(svgOf("tokens-per-step"), rows, [
      { key: "prefill_tokens_per_step", label: "prefill", color: COLORS.prefill },
      { key: "decode_tokens_per_step", label: "decode", color: COLORS.decode },
      { key: "verify_tokens_per_step", label: "verify", color: COLORS.verify },
      { key: "jump_forward_tokens_per_step", label: "jump-forward", color: COLORS.jump },
    ], { stacked: true, format: "num", title: "tokens / step" });
    chart(svgOf("step-time"), rows, [
      { key: "step_time_ms", label: "mean", color: COLORS.a },
      { key: "step_time_p99_ms", label: "P99", color: COLORS.b, dash: true },
    ], { format: "num", title: "step ms" });
    chart(svgOf("throughput"), rows, [
      { key: "output_tokens_per_s", label: "output tok/s", color: COLORS.c },
    ], { format: "num", title: "tok/s" });
    chart(svgOf("latency"), rows, [
      { key: "ttft_p50_s", label: "TTFT P50", color: COLORS.a },
      { key: "ttft_p99_s", label: "TTFT P99", color: COLORS.d, dash: true },
      { key: "itl_p50_s", label: "ITL P50", color: COLORS.c },
      { key: "itl_p99_s", label: "ITL P99", color: COLORS.b, dash: true },
    ], { format: "sec", title: "seconds" });
  }

  function chart(svg, allRows, series, opt) {
    clear(svg);
    const [W, H] = size(svg);
    const pad = { l: 40, r: 6, t: 16, b: 12 };
    let x = pad.l;
    for (const s of series) {  // the legend
      el("rect", { x, y: 3, width: 8, height: 8, fill: s.color }, svg);
      const t = label(svg, x + 11, 11, s.label);
      x += 16 + s.label.length * 5.4;
      t.setAttribute("data-legend", s.key);
    }
    if (!allRows.length) {
      label(svg, W / 2, H / 2 + 4, "waiting for data", { "text-anchor": "middle" });
      return;
    }
    const tMax = allRows[allRows.length - 1].time;
    const tMin = Math.max(allRows[0].time, tMax - WINDOW_S);
    const rows = allRows.filter((r) => r.time >= tMin);
    const value = (r, key) => (typeof r[key] === "number" ? r[key] : null);
    const stacks = rows.map((r) => {
      let sum = 0;
      return series.map((s) => {
        const v = value(r, s.key);
        if (!opt.stacked) return v;
        sum += v || 0;
        return sum;
      });
    });
    let top = opt.max;
    if (top === undefined) {
      top = 0;
      for (const st of stacks) for (const v of st) if (v !== null && v > top) top = v;
      top = niceCeil(top);
    }
    const X = (t) => pad.l + ((t - tMin) / (tMax - tMin || 1)) * (W - pad.l - pad.r);
    const Y = (v) => H - pad.b - (v / top) * (H - pad.t - pad.b);
    for (const g of [0, 0.5, 1]) {
      el("line", { class: "grid", x1: pad.l, x2: W - pad.r, y1: Y(top * g), y2: Y(top * g) }, svg);
      label(svg, pad.l - 3, Y(top * g) + 3, axisFmt(top * g, opt.format), { "text-anchor": "end" });
    }
    label(svg, W - pad.r, H - 1, Math.round(tMax - tMin) + " s", { "text-anchor": "end" });
    series.forEach((s, i) => {
      let d = "";
      if (opt.stacked) {
        const upper = rows.map((r, j) => [X(r.time), Y(stacks[j][i])]);
        const lower = rows.map((r, j) => [X(r.time), Y(i ? stacks[j][i - 1] : 0)]).reverse();
        d = "M" + upper.concat(lower).map((p) => p[0].toFixed(1) + "," + p[1].toFixed(1)).join("L") + "Z";
        el("path", { d, fill: s.color, opacity: 0.85, "data-series": s.key }, svg);
        return;
      }
      let pen = "M";
      rows.forEach((r, j) => {
        const v = stacks[j][i];
        if (v === null) { pen = "M"; return; }
        d += pen + X(r.time).toFixed(1) + "," + Y(Math.min(v, top)).toFixed(1);
        pen = "L";
      });
      if (rows.length === 1 && d) d += "h2";
      const attrs = { d, class: "line", stroke: s.color, "data-series": s.key };
      if (s.dash) attrs["stroke-dasharray"] = "5 3";  // visible where it lies on another line
      el("path", attrs, svg);
    });
    for (const e of opt.events || []) {
      if (e.time < tMin || e.time > tMax + 2) continue;
      const ex = Math.min(X(e.time), W - pad.r);
      el("line", { class: "marker " + e.kind, x1: ex, x2: ex, y1: pad.t, y2: H - pad.b }, svg);
    }
  }

  function axisFmt(v, kind) {  // short tick labels
    if (kind === "pct") return Math.round(v * 100) + "%";
    if (kind === "sec") return v === 0 ? "0" : v < 1 ? +(v * 1000).toPrecision(3) + "ms" : +v.toPrecision(3) + "s";
    if (v >= 10000) return +(v / 1000).toPrecision(3) + "k";
    return String(+v.toPrecision(3));
  }

  function niceCeil(v) {  // 1, 2, 2.5, 5 or 10 times a power of ten, at least v
    if (!(v > 0)) return 1;
    const base = Math.pow(10, Math.floor(Math.log10(v)));
    for (const m of [1, 2, 2.5, 5, 10]) if (m * base >= v) return m * base;
    return 10 * base;
  }

  function renderEvents(events) {
    const list = document.querySelector('[data-list="events"]');
    list.replaceChildren();
    const recent = events.slice(-12).reverse();
    if (!recent.length) {
      const li = document.createElement("li");
      li.textContent = "no retractions or evictions seen";
      list.appendChild(li);
    }
    for (const e of recent) {
      const li = document.createElement("li");
      li.className = e.kind;
      const when = new Date(e.time * 1000).toLocaleTimeString();
      li.textContent = when + "  " + (e.kind === "retract"
        ? "retracted " + e.rid + " (" + e.tokens + " tokens, " + e.pages + " pages)"
        : "evicted " + e.pages + " pages (asked " + e.asked + ")");
      list.appendChild(li);
    }
  }

  // tables -----------------------------------------------------------------------------------

  function fillTable(table, cols, rows, caption) {
    table.replaceChildren();
    const cap = document.createElement("caption");
    cap.textContent = caption;
    table.appendChild(cap);
    const head = table.insertRow();
    for (const c of cols) {
      const th = document.createElement("th");
      th.textContent = c;
      head.appendChild(th);
    }
    for (const row of rows) {
      const tr = table.insertRow();
      for (const [k, v] of Object.entries(row.attrs || {})) tr.setAttribute(k, v);
      for (const cell of row.cells) {
        const td = tr.insertCell();
        if (cell !== null && typeof cell === "object") {
          if (cell.cls === "text") td.className = "text";
          const span = document.createElement("span");
          if (cell.cls && cell.cls !== "text") span.className = cell.cls;
          span.textContent = cell.text;
          td.appendChild(span);
        } else {
          td.textContent = cell === null || cell === undefined ? "–" : String(cell);
        }
      }
    }
  }

  function renderRequests(name, reqs, finished, showPrompts) {
    const table = document.querySelector('[data-table="' + name + '"]');
    const cols = ["id", "source", "status", "prompt", "cached", "generated", "constraint",
                  "spec acc.", finished ? "took" : "age", "TTFT"];
    if (finished) cols.push("finish");
    if (showPrompts) cols.push("prompt text");
    const rows = (reqs || []).slice(0, 40).map((r) => {
      const cells = [r.rid.length > 18 ? r.rid.slice(0, 16) + "…" : r.rid, r.label, r.status,
                     r.prompt_tokens, r.cached_tokens, r.generated_tokens + " / " + r.max_new_tokens,
                     r.constraint || "–",
                     r.spec_acceptance === null ? "–" : fmt(r.spec_acceptance, "pct"),
                     fmt(r.age_s, "sec"), fmt(r.ttft_s, "sec")];
      if (finished) cells.push(r.finish_reason + (r.finish_detail ? " (" + r.finish_detail + ")" : ""));
      if (showPrompts) cells.push({ text: r.prompt || "", cls: "text" });
      return { attrs: { "data-rid": r.rid, "data-status": r.status }, cells };
    });
    table.dataset.count = String((reqs || []).length);
    fillTable(table, cols, rows, (finished ? "recently finished (" : "live (") + (reqs || []).length + ")");
  }

  function renderTiers(stats) {
    const panel = document.querySelector('[data-panel="kv-tiers"]');
    const names = stats.kv_tiers ? String(stats.kv_tiers).split(",") : [];
    panel.hidden = names.length === 0;
    if (!names.length) return;
    const cols = ["tier", "blocks", "bytes", "hit rate", "promotions", "demotions", "load (mean)",
                  "failures"];
    const rows = names.map((t) => {
      const g = (k) => stats["kv_" + t + "_" + k];
      const kinds = ["truncated", "corrupt", "foreign", "io", "full", "timeout", "unavailable"]
        .filter((k) => g("failures_" + k)).map((k) => k + " " + g("failures_" + k));
      return { attrs: { "data-tier": t }, cells: [
        t, fmt(g("blocks"), "int"), fmt(g("bytes"), "bytes"), fmt(g("hit_rate"), "pct"),
        fmt(g("promotions"), "int"), fmt(g("demotions"), "int"), fmt(g("load_seconds_mean"), "sec"),
        fmt(g("failures"), "int") + (kinds.length ? " (" + kinds.join(", ") + ")" : "")] };
    });
    fillTable(document.querySelector('[data-table="tiers"]'), cols, rows,
              "each " + fmt(stats.kv_tiers_block_tokens, "int") + " tokens");
  }

  function renderExecution(stats) {  // the engine's execution_* stats, as chosen at start
    const rows = Object.keys(stats).filter((k) => k.startsWith("execution_")).sort().map((k) => {
      const name = k.slice("execution_".length);
      return { attrs: { "data-choice": name }, cells: [name.replace(/_/g, " "),
                                                       { text: String(stats[k]), cls: "text" }] };
    });
    fillTable(document.querySelector('[data-table="execution"]'), ["choice", "taken"], rows,
              rows.length + " choices");
  }

  function renderReplicas(router) {
    const nav = document.querySelector('[data-panel="replicas"]');
    nav.hidden = false;
    if (state.replica === null) state.replica = router.selected;
    nav.replaceChildren();
    router.replicas.forEach((r, i) => {
      const b = document.createElement("button");
      b.type = "button";
      b.textContent = "replica " + i + (r.healthy ? "" : " (down)");
      b.title = r.url + " · in flight " + r.in_flight + " · served " + r.served;
      b.dataset.replica = String(i);
      b.setAttribute("aria-pressed", String(i === state.replica));
      if (!r.healthy) b.className = "down";
      b.onclick = () => {
        if (i === state.replica) return;
        state.replica = i;
        state.generation += 1;
        state.rows = [];
        state.lastSeq = null;
        if (state.timer !== null) clearTimeout(state.timer);
        poll();
      };
      nav.appendChild(b);
    });
  }

  readKey();
  poll();
})();
