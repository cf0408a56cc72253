// arpo rollout-tree viewer. Every piece of model or tool text is inserted with textContent, never as markup.
// Data comes from the server (/v1/index, /v1/group, with the key from the URL fragment) or, in an exported file,
// from the JSON block #arpo-data.
"use strict";
(function () {
  const SOLVED = 0.5;
  const embedded = document.getElementById("arpo-data");
  const DATA = embedded ? JSON.parse(embedded.textContent) : null;
  const $ = (id) => document.getElementById(id);
  const state = { rows: new Map(), seen: 0, it: null, g: null, node: null, group: null, cache: new Map(),
    sources: null, rowsB: new Map(), seenB: 0 };

  function el(tag, cls, text) {
    const e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text !== undefined && text !== null) e.textContent = String(text);
    return e;
  }
  function fmt(x, d) { return x === null || x === undefined ? "n/a" : Number(x).toFixed(d === undefined ? 2 : d); }

  // ------------------------------------------------------------------ the URL fragment: key and permalink
  function parseHash() {
    const out = {};
    for (const part of location.hash.replace(/^#/, "").split("&")) {
      const i = part.indexOf("=");
      if (i > 0) out[decodeURIComponent(part.slice(0, i))] = decodeURIComponent(part.slice(i + 1));
    }
    return out;
  }
  const first = parseHash();
  if (first.key) {
    sessionStorage.setItem("arpo-view-key", first.key);
    delete first.key;
  }
  const KEY = sessionStorage.getItem("arpo-view-key");
  function setHash(it, g, n) {
    let h = "#it=" + it + "&g=" + g;
    if (n !== null && n !== undefined) h += "&n=" + n;
    history.replaceState(null, "", h);
    $("permalink").href = h;
  }

  // ------------------------------------------------------------------ data
  async function api(path) {
    const r = await fetch(path, { headers: KEY ? { Authorization: "Bearer " + KEY } : {} });
    if (r.status === 401) throw new Error("no key: open the address `arpo view` printed (it carries #key=...)");
    const body = await r.json();
    if (!r.ok) throw new Error(body.error ? body.error.message : "HTTP " + r.status);
    return body;
  }
  async function loadIndex() {
    if (DATA) return { rows: DATA.rows, total: DATA.rows.length };
    return api("/v1/index?since=" + state.seen);
  }
  async function loadGroup(it, g, side) {
    const key = (side ? "b:" : "") + it + ":" + g;
    if (state.cache.has(key)) return state.cache.get(key);
    let rec;
    if (DATA) {
      rec = DATA.groups[key];
      if (!rec) throw new Error("this group's record was cut short and is not in the file");
    } else {
      rec = await api("/v1/group?iteration=" + it + "&group=" + g + (side ? "&side=1" : ""));
    }
    state.cache.set(key, rec);
    return rec;
  }

  // ------------------------------------------------------------------ filters
  const FILTER_GROUP = {
    all: () => true, solved: (s) => s.solved > 0, failed: (s) => s.failed > 0,
    branched: (s) => s.branch_points > 0, tool_limit: (s) => s.tool_limit > 0,
  };
  function trajVisible(t, rec, filter) {
    if (filter === "solved") return (t.reward || 0) > SOLVED;
    if (filter === "failed") return (t.reward || 0) <= SOLVED;
    if (filter === "tool_limit") return t.finish_reason === "tool_limit";
    if (filter === "branched") {
      const branchNodes = new Set(rec.nodes.filter((n) => n.branch).map((n) => n.id));
      return t.node_ids.some((id) => branchNodes.has(id));
    }
    return true;
  }

  // ------------------------------------------------------------------ the prompt list
  function renderIterations() {
    const sel = $("iteration");
    const its = [...state.rows.keys()].sort((a, b) => a - b);
    const have = new Set([...sel.options].map((o) => Number(o.value)));
    for (const it of its) {
      if (have.has(it)) continue;
      const o = el("option", null, String(it));
      o.value = String(it);
      const before = [...sel.options].find((x) => Number(x.value) > it);
      sel.insertBefore(o, before || null);
    }
    $("status").textContent = (DATA ? "exported file" : "live") + " · " + its.length + " iterations" +
      (state.sources ? " · " + state.sources[0] + " beside " + state.sources[1] : "");
    renderChart();
  }
  function renderChart() {
    // Per iteration: the fraction of recorded trajectories solved (green) and branch points per group (orange, scaled
    // to the largest); a click on an iteration's column opens it.
    const box = $("chart");
    box.replaceChildren();
    const its = [...state.rows.keys()].sort((a, b) => a - b);
    if (!its.length) return;
    const NS = "http://www.w3.org/2000/svg", W = 210, H = 70;
    const svg = document.createElementNS(NS, "svg");
    svg.setAttribute("width", W); svg.setAttribute("height", H); svg.setAttribute("viewBox", "0 0 " + W + " " + H);
    const stats = its.map((it) => {
      const gs = state.rows.get(it).groups;
      const n = gs.reduce((a, s) => a + s.trajectories, 0) || 1;
      return { it, acc: gs.reduce((a, s) => a + s.solved, 0) / n,
        br: gs.length ? gs.reduce((a, s) => a + s.branch_points, 0) / gs.length : 0 };
    });
    const maxBr = Math.max(1e-9, ...stats.map((s) => s.br));
    const step = W / stats.length;
    stats.forEach((s, i) => {
      const col = document.createElementNS(NS, "g");
      col.setAttribute("class", "chart-col");
      col.dataset.iteration = String(s.it);
      const bg = document.createElementNS(NS, "rect");
      bg.setAttribute("x", i * step); bg.setAttribute("y", 0); bg.setAttribute("width", step); bg.setAttribute("height", H);
      bg.setAttribute("class", s.it === state.it ? "chart-bg selected" : "chart-bg");
      col.appendChild(bg);
      for (const [v, cls, off] of [[s.acc, "chart-acc", 0], [s.br / maxBr, "chart-br", 0.5]]) {
        const r = document.createElementNS(NS, "rect");
        const h = Math.max(1, v * (H - 4));
        r.setAttribute("x", i * step + off * step + 0.5); r.setAttribute("y", H - h);
        r.setAttribute("width", Math.max(1, step / 2 - 1)); r.setAttribute("height", h); r.setAttribute("class", cls);
        col.appendChild(r);
      }
      const tip = document.createElementNS(NS, "title");
      tip.textContent = "iteration " + s.it + ": solved " + fmt(s.acc) + ", branch points per group " + fmt(s.br);
      col.appendChild(tip);
      col.addEventListener("click", () => openIteration(s.it));
      svg.appendChild(col);
    });
    box.appendChild(svg);
  }
  function renderGroups() {
    const nav = $("groups");
    nav.replaceChildren();
    const row = state.rows.get(state.it);
    if (!row) return;
    const filter = $("filter").value, q = $("search").value.toLowerCase();
    row.groups.forEach((s, i) => {
      if (!FILTER_GROUP[filter](s) || (q && !(s.prompt || "").toLowerCase().includes(q))) return;
      const b = el("button", "group-item" + (i === state.g ? " selected" : ""),
        "prompt " + s.prompt_index + " · " + s.solved + "/" + s.trajectories + " solved · " +
        s.branch_points + " branch points");
      b.dataset.group = String(i);
      b.title = s.prompt || "";
      b.addEventListener("click", () => openGroup(state.it, i, null));
      nav.appendChild(b);
    });
  }

  // ------------------------------------------------------------------ the tree
  function colour(x, scale) {  // negative red, positive green
    if (x === null || x === undefined) return "#aaa";
    const a = Math.max(-1, Math.min(1, x / scale));
    return a >= 0 ? "rgb(" + Math.round(200 - 150 * a) + ",160,60)" : "rgb(200," + Math.round(160 + 100 * a) + ",60)";
  }
  function preview(node) {
    const text = node.text.map((r) => r[1]).join("");
    if (!text && node.parent === null) return "(the prompt: independent samples start here)";
    return text.length > 90 ? text.slice(0, 90) + "…" : text;
  }
  function decisionText(ds) {
    // The rule's own inputs: H_init and H now (the entropies it compared), its constants, and the draws (reference).
    return (ds || []).map((d) => "\n" + d.rule + " rule: H_init " + fmt(d.h_init, 3) + ", H " + fmt(d.h_now, 3) +
      " (dH " + fmt(d.h_now - d.h_init, 3) + "), alpha " + d.alpha + ", beta " + d.beta +
      (d.rule === "paper" ? ", threshold tau " + d.tau : ", draws " + d.draws.map((u) => fmt(u, 3)).join(" ")) +
      (d.penalty_l ? ", penalty count " + d.penalty_l : "") + " -> " + d.branches + " clone(s)").join("");
  }
  function renderTree(rec, side) {
    const box = side ? $("tree-b") : $("tree");
    box.replaceChildren();
    if (state.sources) box.appendChild(el("h3", "side-label", state.sources[side ? 1 : 0]));
    const filter = $("filter").value;
    const trajs = rec.trajectories.filter((t) => trajVisible(t, rec, filter));
    const shown = new Set(trajs.flatMap((t) => t.node_ids));
    const kids = new Map();
    for (const n of rec.nodes) {
      if (!shown.has(n.id)) continue;
      const p = n.parent === null ? -1 : n.parent;
      if (!kids.has(p)) kids.set(p, []);
      kids.get(p).push(n);
    }
    const header = el("div", "meta", "iteration " + rec.iteration + " · prompt " + rec.prompt_index + " · " +
      rec.trajectories.length + " trajectories · " + rec.nodes.length + " nodes · policy version " +
      (rec.policy_version ?? "n/a"));
    box.appendChild(header);
    box.appendChild(el("div", "prompt", rec.prompt));
    // the task's answer, recorded from the task list (the environment's info withholds it from the policy)
    const truth = rec.task ? rec.task.ground_truth : undefined;
    if (truth !== undefined && truth !== null) {
      box.appendChild(el("div", "meta answer", "answer: " + (Array.isArray(truth) ? truth.join(" | ") : truth)));
    }
    const ending = new Map();
    for (const t of trajs) ending.set(t.node_ids[t.node_ids.length - 1], (ending.get(t.node_ids[t.node_ids.length - 1]) || []).concat([t]));
    function build(parentId) {
      const ul = el("ul", "children");
      for (const n of kids.get(parentId) || []) {
        const li = el("li");
        const d = el("div", "node");
        d.dataset.node = String(n.id);
        d.tabIndex = 0;
        d.style.borderLeftColor = colour(n.advantage, 1.0);
        d.appendChild(el("span", "preview", preview(n)));
        const tools = n.text.filter((r) => r[0] === "tool").length;
        if (tools) d.appendChild(el("span", "tool-chip", tools + " tool result" + (tools > 1 ? "s" : "")));
        if (n.value !== undefined && n.value !== null) {
          // turn credit: the tree's value where this node ends (the mean of its children's values)
          const v = el("span", "value-chip", "V " + fmt(n.value));
          v.title = "value after this node (turn credit): the mean of its children's values; a trajectory's end is " +
            "worth its reward";
          d.appendChild(v);
        }
        if (n.branch) {
          const b = el("span", "branch", "branch ×" + n.branch.children.length + " · H " +
            fmt(n.branch.entropy_before) + " → " + n.branch.entropy_after.map((x) => fmt(x)).join(" / "));
          b.title = "branch point at token " + n.end + ": mean entropy of the " + "last sampled tokens before it " +
            fmt(n.branch.entropy_before, 3) + "; of the first sampled tokens of each child " +
            n.branch.entropy_after.map((x) => fmt(x, 3)).join(", ") + decisionText(n.branch.decisions);
          d.appendChild(b);
        }
        d.addEventListener("click", (ev) => { ev.stopPropagation(); showNode(rec, n.id, side); });
        li.appendChild(d);
        for (const t of ending.get(n.id) || []) {
          const leaf = el("span", "leaf " + ((t.reward || 0) > SOLVED ? "good" : "bad"),
            "trajectory " + t.id + " · reward " + fmt(t.reward) + " · " + t.finish_reason);
          leaf.dataset.traj = String(t.id);
          leaf.addEventListener("click", (ev) => { ev.stopPropagation(); showTrajectory(rec, t, side); });
          li.appendChild(leaf);
        }
        if (kids.has(n.id)) li.appendChild(build(n.id));
        ul.appendChild(li);
      }
      return ul;
    }
    box.appendChild(build(-1));
  }

  // ------------------------------------------------------------------ the detail pane
  function runs(box, text) {
    for (const [kind, t] of text) {
      if (kind === "tool") {
        const card = el("div", "toolcard");
        card.appendChild(el("div", "label", "tool result"));
        card.appendChild(el("pre", "tool-text", t));
        box.appendChild(card);
      } else {
        const m = el("div", "modeltext");
        m.appendChild(el("pre", "model-text", t));
        box.appendChild(m);
      }
    }
  }
  // Per-token colourings: the value of token i of trajectory t, and its cell's colour (null value: no colour, "n/a").
  // The learner's values are its log-probs before the update's first step; |dlogp| = |sampled - learner| shows
  // where the rollout engine and the learner disagree (saturated at 0.5 nats).
  function learnerLp(t, i) { return t.learner_logprobs ? t.learner_logprobs[i] : null; }
  function dlogp(t, i) {
    const a = t.sampled_logprobs[i], b = learnerLp(t, i);
    return a === null || b === null || b === undefined ? null : Math.abs(a - b);
  }
  const COLOURINGS = {
    entropy: [(t, i) => t.entropies[i], (v) => "rgba(200,80,0," + Math.min(1, v / 3).toFixed(3) + ")"],
    advantage: [(t, i) => (t.advantages ? t.advantages[i] : null), (v) => colour(v, 1.0)],
    learner_logprob: [learnerLp, (v) => "rgba(0,130,110," + Math.min(1, -v / 5).toFixed(3) + ")"],
    abs_dlogp: [dlogp, (v) => "rgba(200,0,140," + Math.min(1, v / 0.5).toFixed(3) + ")"],
  };
  function tokenStrip(rec, n) {
    // One cell per token of the node, coloured by the chosen value (grey: inserted tool-result tokens; blank: no
    // value recorded); the tooltip has the position and every value.
    const t = rec.trajectories.find((x) => x.node_ids.includes(n.id));
    const strip = el("div", "strip");
    const [value, paint] = COLOURINGS[state.colour] || COLOURINGS.entropy;
    for (let i = n.start; i < n.end; i++) {
      const c = el("span", "tok");
      const sampled = t.trained_mask[i] === 1;
      const v = value(t, i);
      if (!sampled) c.classList.add("inserted");
      else if (v !== null && v !== undefined) { c.style.background = paint(v); c.dataset.value = String(v); }
      c.title = "token " + i + (sampled ? "" : " (tool result)") + " · id " + t.response_ids[i] + " · entropy " +
        fmt(t.entropies[i], 3) + " · sampled log-prob " + fmt(t.sampled_logprobs[i], 3) + " · learner log-prob " +
        fmt(learnerLp(t, i), 3) + " · |dlogp| " + fmt(dlogp(t, i), 4) + " · advantage " +
        fmt(t.advantages ? t.advantages[i] : null, 3);
      strip.appendChild(c);
    }
    return strip;
  }
  function showNode(rec, id, side) {
    const n = rec.nodes.find((x) => x.id === id);
    if (!n) return;
    if (!side) state.node = id;
    for (const e of document.querySelectorAll(".node.selected")) e.classList.remove("selected");
    const d = (side ? $("tree-b") : $("tree")).querySelector('.node[data-node="' + id + '"]');
    if (d) { d.classList.add("selected"); d.scrollIntoView({ block: "nearest" }); }
    if (!side) setHash(rec.iteration, rec.group, id);
    const box = $("detail");
    box.replaceChildren();
    box.appendChild(el("h3", null, "node " + id));
    if (state.sources) box.appendChild(el("div", "meta", state.sources[side ? 1 : 0]));
    box.appendChild(el("div", "meta", "tokens " + n.start + "–" + n.end + " · depth " + n.depth + " · advantage " +
      fmt(n.advantage, 3) + " · policy version " + (n.policy_version ?? "n/a") + " · trajectories " + n.trajectories.join(", ")));
    if (n.value !== undefined && n.value !== null) box.appendChild(el("div", "meta value", "value " + fmt(n.value, 3)));
    if (n.turns && n.turns.length) {
      // turn credit: each turn's tokens got V(after) - V(before), divided by the group's reward scale when trained
      const list = el("ul", "turns");
      for (const [a, b, before, after, adv] of n.turns) {
        list.appendChild(el("li", "turn", "turn, tokens " + a + "–" + b + ": value " + fmt(before, 3) + " → " +
          fmt(after, 3) + " · advantage " + fmt(adv, 3)));
      }
      box.appendChild(list);
    }
    if (n.branch) box.appendChild(el("div", "meta", "branch point: entropy before " + fmt(n.branch.entropy_before, 3) +
      ", after " + n.branch.entropy_after.map((x) => fmt(x, 3)).join(", ") + decisionText(n.branch.decisions)));
    if (n.end > n.start) {
      const row = el("div", "meta", "per token, coloured by ");
      const sel = el("select");
      sel.id = "colour";
      for (const [v, name] of [["entropy", "entropy"], ["advantage", "advantage"], ["learner_logprob",
        "learner log-prob"], ["abs_dlogp", "|sampled - learner log-prob|"]]) {
        const o = el("option", null, name); o.value = v; sel.appendChild(o);
      }
      sel.value = state.colour || "entropy";
      sel.addEventListener("change", () => { state.colour = sel.value; showNode(rec, id, side); });
      row.appendChild(sel);
      box.appendChild(row);
      box.appendChild(tokenStrip(rec, n));
    }
    const body = el("div", "node-text");
    runs(body, n.text);
    box.appendChild(body);
  }
  function showTrajectory(rec, t, side) {
    const box = $("detail");
    box.replaceChildren();
    box.appendChild(el("h3", null, "trajectory " + t.id + " (" + t.kind + ")"));
    box.appendChild(el("div", "meta", "reward " + fmt(t.reward, 3) + " · " + t.finish_reason + " · " +
      t.tool_calls.length + " tool calls · policy version " + (t.policy_version ?? "n/a")));
    box.appendChild(el("pre", "meta", JSON.stringify(t.reward_info)));
    if (t.turn_values) {
      box.appendChild(el("div", "meta path-values", "node values along the path (token: value): " +
        t.turn_values.map(([b, v]) => b + ": " + fmt(v, 3)).join(" → ")));
    }
    const body = el("div", "node-text");
    for (const id of t.node_ids) runs(body, rec.nodes.find((x) => x.id === id).text);
    box.appendChild(body);
    if (!side) setHash(rec.iteration, rec.group, t.node_ids[t.node_ids.length - 1]);
  }

  // ------------------------------------------------------------------ navigation
  async function openGroup(it, g, node) {
    const changed = state.it !== it;
    state.it = it; state.g = g;
    if (changed) renderChart();
    $("iteration").value = String(it);
    renderGroups();
    try {
      const rec = await loadGroup(it, g);
      if (state.it !== it || state.g !== g) return;
      state.group = rec;
      renderTree(rec, 0);
      if (node !== null && node !== undefined) showNode(rec, node, 0); else setHash(it, g, null);
      if (state.sources) await renderOther(it, g);
    } catch (e) {
      $("tree").replaceChildren(el("p", "hint", String(e.message || e)));
    }
  }
  function counterpart(it, g) {
    // The other side's tree of the same prompt (same prompt index and text): in the same iteration (an evaluation:
    // the same item) when it has one, else the latest iteration that has it.
    const s = state.rows.get(it).groups[g];
    const match = (row) => row.groups.findIndex((x) => x.prompt_index === s.prompt_index && x.prompt === s.prompt);
    const its = [...state.rowsB.keys()].sort((a, b) => b - a);
    for (const i of [it, ...its]) {
      const row = state.rowsB.get(i);
      const k = row ? match(row) : -1;
      if (k >= 0) return [i, k];
    }
    return null;
  }
  async function renderOther(it, g) {
    const box = $("tree-b");
    const at = counterpart(it, g);
    if (!at) {
      box.replaceChildren(el("h3", "side-label", state.sources[1]),
        el("p", "hint", "no tree of this prompt in " + state.sources[1]));
      return;
    }
    const rec = await loadGroup(at[0], at[1], 1);
    if (state.it === it && state.g === g) renderTree(rec, 1);
  }
  function openIteration(it) {
    const row = state.rows.get(it);
    if (!row) return;
    const filter = $("filter").value;
    const g = row.groups.findIndex((s) => FILTER_GROUP[filter](s));
    if (g < 0) { state.it = it; state.g = null; renderGroups(); $("tree").replaceChildren(el("p", "hint", "no prompt matches")); return; }
    openGroup(it, g, null);
  }
  async function poll() {
    try {
      const idx = await loadIndex();
      for (const row of idx.rows) {
        state.rows.set(row.iteration, row);
        for (const k of [...state.cache.keys()]) if (k.startsWith(row.iteration + ":")) state.cache.delete(k);
      }
      state.seen = idx.total;
      if (idx.sources && idx.sources.length > 1) {
        if (!state.sources) { state.sources = idx.sources; document.body.classList.add("compare"); }
        const other = await api("/v1/index?side=1&since=" + state.seenB);
        for (const row of other.rows) {
          state.rowsB.set(row.iteration, row);
          for (const k of [...state.cache.keys()]) if (k.startsWith("b:" + row.iteration + ":")) state.cache.delete(k);
        }
        state.seenB = other.total;
      }
      renderIterations();
      if (state.it === null && state.rows.size) {
        const h = parseHash();
        if (h.it !== undefined && state.rows.has(Number(h.it))) {
          openGroup(Number(h.it), Number(h.g || 0), h.n !== undefined ? Number(h.n) : null);
        } else {
          openIteration(Math.max(...state.rows.keys()));
        }
      } else if (idx.rows.length) {
        renderGroups();
      }
      if (!state.rows.size) $("status").textContent = "waiting for the first recorded iteration";
    } catch (e) {
      $("status").textContent = String(e.message || e);
    }
  }
  $("iteration").addEventListener("change", () => openIteration(Number($("iteration").value)));
  $("filter").addEventListener("change", () => {
    renderGroups();
    if (state.group) { renderTree(state.group, 0); if (state.sources) renderOther(state.it, state.g); }
  });
  $("search").addEventListener("input", renderGroups);
  window.addEventListener("hashchange", () => {
    const h = parseHash();
    if (h.it !== undefined && state.rows.has(Number(h.it))) openGroup(Number(h.it), Number(h.g || 0), h.n !== undefined ? Number(h.n) : null);
  });
  document.addEventListener("keydown", (ev) => {
    if (ev.target.tagName === "INPUT" || ev.target.tagName === "SELECT") return;
    const row = state.rows.get(state.it);
    const its = [...state.rows.keys()].sort((a, b) => a - b);
    if (ev.key === "j" && row && state.g + 1 < row.groups.length) openGroup(state.it, state.g + 1, null);
    else if (ev.key === "k" && row && state.g > 0) openGroup(state.it, state.g - 1, null);
    else if (ev.key === "n" || ev.key === "p") {
      const i = its.indexOf(state.it) + (ev.key === "n" ? 1 : -1);
      if (i >= 0 && i < its.length) openIteration(its[i]);
    } else if (state.group && state.node !== null && ev.key.startsWith("Arrow")) {
      const nodes = [...$("tree").querySelectorAll(".node")].map((e) => Number(e.dataset.node));
      const i = nodes.indexOf(state.node) + (ev.key === "ArrowDown" || ev.key === "ArrowRight" ? 1 : -1);
      if (i >= 0 && i < nodes.length) { ev.preventDefault(); showNode(state.group, nodes[i], 0); }
    }
  });
  poll();
  if (!DATA) setInterval(poll, 2000);
})();
