// partita plan view: draws the embedded plan (see compiler/view.py) with plain DOM and SVG.
// Sections: header, device mesh, model graph, memory, schedule, alternatives, changes (with --against).
"use strict";

const SVGNS = "http://www.w3.org/2000/svg";
const FREE = new Set(["none", "slice"]); // reshards that move no bytes
const PALETTE = ["#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1", "#ff9da7",
  "#9c755f", "#bab0ac"];

// -- formatting: the same rules as compiler/report.py's fmt_bytes / fmt_time -------------------------------
function g3(x) { return String(Number(x.toPrecision(3))); }
function fmtBytes(n) {
  for (const [unit, scale] of [["TB", 1e12], ["GB", 1e9], ["MB", 1e6], ["KB", 1e3]]) {
    if (Math.abs(n) >= scale) return (n / scale).toFixed(2) + " " + unit;
  }
  return n.toFixed(0) + " B";
}
function fmtTime(s) {
  if (s === null || s === undefined) return "-";
  if (s >= 3600) return g3(s / 3600) + " h";
  if (s >= 60) return g3(s / 60) + " min";
  if (s >= 1) return g3(s) + " s";
  if (s >= 1e-3) return g3(s * 1e3) + " ms";
  return g3(s * 1e6) + " us";
}
function fmtNum(x, digits) {
  return x.toLocaleString("en-US", {minimumFractionDigits: digits, maximumFractionDigits: digits});
}
function fmtPct(x) { return (x * 100).toFixed(1) + "%"; }
function meshText(m) { return `dp=${m.dp} x tp=${m.tp} x pp=${m.pp}` + ((m.ep || 1) > 1 ? ` (ep=${m.ep})` : ""); }
function shortOp(op) { return op.replace(/^aten\./, "").replace(/\.(default|Tensor|Scalar|int)$/, ""); }
function stageColour(s) { return PALETTE[s % PALETTE.length]; }

// -- DOM helpers ----------------------------------------------------------------------------------------------
function el(tag, attrs, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k === "class") e.className = v; else if (k === "text") e.textContent = v; else e.setAttribute(k, v);
  }
  for (const c of children.flat()) if (c !== null && c !== undefined) e.append(c);
  return e;
}
function svg(tag, attrs, ...children) {
  const e = document.createElementNS(SVGNS, tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined) continue;
    if (k === "text") e.textContent = v; else e.setAttribute(k, v);
  }
  for (const c of children.flat()) if (c) e.append(c);
  return e;
}
function section(id, title, ...children) {
  return el("section", {id}, el("h2", {text: title}), ...children);
}

// -- tooltip: any element with a tip (set through tip()) shows it on hover ---------------------------------
const TIPS = new WeakMap();
function tip(e, lines) { TIPS.set(e, lines); e.classList.add("has-tip"); return e; }
function installTooltip() {
  const box = document.getElementById("tooltip");
  document.addEventListener("mouseover", ev => {
    let t = ev.target;
    while (t && !TIPS.has(t)) t = t.parentNode;
    if (!t) { box.hidden = true; return; }
    const lines = TIPS.get(t);
    box.replaceChildren(...(typeof lines === "function" ? lines() : lines).map(
      (l, i) => el("div", {class: i === 0 ? "tip-title" : "tip-line", text: l})));
    box.hidden = false;
    place(ev);
  });
  document.addEventListener("mousemove", ev => { if (!box.hidden) place(ev); });
  function place(ev) {
    const w = box.offsetWidth, h = box.offsetHeight;
    box.style.left = Math.min(ev.clientX + 14, window.innerWidth - w - 8) + "px";
    box.style.top = (ev.clientY + 16 + h > window.innerHeight ? ev.clientY - h - 10 : ev.clientY + 16) + "px";
  }
}

// -- header -----------------------------------------------------------------------------------------------------
function changedFields(diff) {
  // header field -> "was X in the baseline"
  const out = {};
  if (!diff) return out;
  if (diff.mesh) out.mesh = diff.mesh.a;
  for (const c of diff.training) {
    const key = {zero_stage: "zero", schedule: "schedule", grad_accum_steps: "microbatches"}[c.field];
    if (key) out[key] = String(c.a);
  }
  for (const c of diff.model) if (c.field === "name") out.model = c.a;
  for (const c of diff.cluster) out.cluster = String(c.a);
  for (const m of diff.metrics) {
    const key = {"step time": "step", "tokens/s": "tokens", "samples/s": "samples", "MFU": "mfu"}[m.name];
    if (key && m.changed) out[key] = m.unit === "s" ? fmtTime(m.a) : m.unit === "fraction" ? fmtPct(m.a) :
      (m.a === null ? "-" : fmtNum(m.a, 1));
  }
  return out;
}

function recomputeText(p) {
  const parts = [["full", "whole layers"], ["selective", "attention cores"]].flatMap(([mode, what]) => {
    const on = p.stages.filter(st => st.recompute === mode).map(st => st.index);
    if (!on.length) return [];
    return [`${what} on ${on.length === p.stages.length ? "every stage" : `stage(s) ${on.join(", ")}`}`];
  });
  return parts.length ? parts.join("; ") : "none";
}

function header(D) {
  const p = D.plan, t = p.training, pr = p.predicted, c = p.cluster, s = p.solver;
  const was = changedFields(D.diff);
  const fields = [
    ["model", "model", `${p.model.name} (${fmtCount(p.model.num_params)} params, ${p.model.num_nodes} graph nodes)`],
    ["cluster", "cluster", `${c.name}: ${c.nodes} node(s) x ${c.gpus_per_node} ${c.device_name || "devices"}`],
    ["mesh", "mesh", `${meshText(p.mesh)} = ${p.world_size} device(s)` + (D.tp_split ? `: ${D.tp_split.mesh}` : "")],
    ["zero", "ZeRO", D.tp_split ? D.tp_split.zero : `stage ${t.zero_stage}`],
    ["schedule", "schedule", t.schedule],
    ["recompute", "recomputation", recomputeText(p)],
    ["sequence", "sequence parallel", t.sequence_parallel ?
      "norms, dropouts and residual adds split along the sequence over tp; linears keep their input's slice and regather it in backward" : "no"],
    ["offload", "optimizer state", t.offload === "optimizer" ?
      `in host memory, stepped by the host: ${fmtBytes(pr.memory.host || 0)} per device` : "on the device"],
    ["microbatches", "micro-batches", `${t.grad_accum_steps} of ${t.micro_batch_size} sample(s) per dp rank`],
    ["step", "step time", fmtTime(pr.step_time_s)],
    ["tokens", "tokens/s", pr.tokens_per_s === null ? "-" : fmtNum(pr.tokens_per_s, 0)],
    ["samples", "samples/s", fmtNum(pr.samples_per_s, 1)],
    ["mfu", "MFU", fmtPct(pr.mfu)],
    ["solver", "solver", `${s.method}: ${s.status}, ${s.candidates} candidates, ${fmtTime(s.seconds)}`],
  ];
  const grid = el("dl", {class: "facts"});
  for (const [key, label, value] of fields) {
    const dd = el("dd", {"data-field": key, text: value});
    const item = el("div", {class: key in was ? "fact changed" : "fact"}, el("dt", {text: label}), dd);
    if (key in was) tip(item, [`${label} changed`, `baseline: ${was[key]}`, `this plan: ${value}`]);
    grid.append(item);
  }
  // where every predicted figure comes from: a preset (a data sheet, a fit with its date) or `partita calibrate`
  const sources = el("dl", {class: "sources"}, ...Object.entries(D.sources || {}).map(([figure, text]) =>
    el("div", {class: "source", "data-figure": figure}, el("dt", {text: `source: ${figure}`}), el("dd", {text}))));
  // one card per parallelism axis of the registry (core/axes), off or what the plan decided on it
  const axes = el("div", {class: "axes", id: "axes"}, ...(D.axes || []).map(a =>
    el("div", {class: a.decided ? "axis on" : "axis off", "data-axis": a.axis},
      el("strong", {text: a.axis}), el("span", {text: a.decided || "off"}))));
  const banner = D.uncalibrated ? el("p", {class: "warning", id: "uncalibrated", text: `uncalibrated: ${D.uncalibrated}`}) : "";
  return el("header", {id: "header"},
    el("h1", {}, "partita plan ", el("span", {class: "muted", text: `${p.model.name} · ${p.model.fingerprint}`})),
    banner, grid, axes, sources);
}
function fmtCount(n) {
  for (const [u, s] of [["T", 1e12], ["B", 1e9], ["M", 1e6], ["K", 1e3]]) if (Math.abs(n) >= s) return g3(n / s) + u;
  return String(n);
}

// -- device mesh ---------------------------------------------------------------------------------------------
function rankCoords(r, m) { // MESH_ORDER pp, dp, tp: tp innermost
  return {pp: Math.floor(r / (m.dp * m.tp)), dp: Math.floor(r / m.tp) % m.dp, tp: r % m.tp};
}
function stageOfRank(p) {
  const map = new Map();
  for (const st of p.stages) for (const r of st.ranks || []) map.set(r, st.index);
  return r => map.has(r) ? map.get(r) : rankCoords(r, p.mesh).pp;
}

// what a rank runs on, in the cluster's words: a GPU, or (device "cpu") a process
function deviceWord(c) { return c.device === "cpu" ? "process" : "GPU"; }
function devicesWord(dev, n) { return n === 1 ? dev : dev === "process" ? "processes" : dev + "s"; }
function meshSection(D) {
  const p = D.plan, m = p.mesh, gpn = p.cluster.gpus_per_node, world = p.world_size, dev = deviceWord(p.cluster);
  const rows = Math.max(p.cluster.nodes, Math.ceil(world / gpn));
  const big = rows > 32;
  const cw = big ? 22 : 64, ch = big ? 12 : 38, gap = big ? 3 : 6, left = 70, top = 6;
  const W = left + gpn * (cw + gap) + 10, H = top + rows * (ch + gap) + 6;
  const stageOf = stageOfRank(p);
  const root = svg("svg", {width: W, height: H, class: "mesh", viewBox: `0 0 ${W} ${H}`});
  const at = r => [left + (r % gpn) * (cw + gap), top + Math.floor(r / gpn) * (ch + gap)];
  for (let n = 0; n < rows; n++) {
    root.append(svg("text", {x: 4, y: top + n * (ch + gap) + ch / 2 + 4, class: "axis", text: `node ${n}`}));
  }
  for (let r = 0; r < rows * gpn; r++) {
    const [x, y] = at(r);
    if (r >= world) {
      root.append(tip(svg("rect", {x, y, width: cw, height: ch, rx: 4, class: "device unused"}),
        [`node ${Math.floor(r / gpn)} ${dev} ${r % gpn}`, "not used by this plan"]));
      continue;
    }
    const c = rankCoords(r, m), s = stageOf(r), ex = D.experts ? D.experts.ranks[r] : null;
    const g = svg("g", {class: "device", "data-rank": r, "data-stage": s});
    if (ex) g.dataset.expertGroup = D.experts.groups.findIndex(grp => grp.includes(r));
    g.append(svg("rect", {x, y, width: cw, height: ch, rx: 4, fill: stageColour(s), "fill-opacity": 0.8}));
    if (!big) {
      g.append(svg("text", {x: x + cw / 2, y: y + 15, class: "dev-rank", text: `r${r}`}));
      g.append(svg("text", {x: x + cw / 2, y: y + 30, class: "dev-coord", text: `s${s} d${c.dp} t${c.tp}`}));
    }
    root.append(tip(g, [`rank ${r}: node ${Math.floor(r / gpn)} ${dev} ${r % gpn}`,
      `pipeline stage ${s} (pp ${c.pp}), data-parallel rank ${c.dp}, tensor-parallel rank ${c.tp}`,
      `TP group: ranks ${r - c.tp}..${r - c.tp + m.tp - 1}`,
      ...(ex ? [`expert group: ranks ${ex.group.join(", ")}; holds ${heldText(ex.experts, D.experts.staged)}`,
                `expert gradients averaged with ranks ${ex.edp.join(", ")}`] : [])]));
  }
  // TP groups: consecutive ranks; outline each node row a group touches
  for (let g0 = 0; g0 < world; g0 += m.tp) {
    for (let r = g0; r < g0 + m.tp;) {
      const rowEnd = Math.min(g0 + m.tp, (Math.floor(r / gpn) + 1) * gpn);
      const [x, y] = at(r);
      root.append(svg("rect", {x: x - gap / 2 + 0.5, y: y - gap / 2 + 0.5, width: (rowEnd - r) * (cw + gap) - 1,
        height: ch + gap - 1, rx: 6, class: "tp-group", "data-tp-group": g0 / m.tp}));
      r = rowEnd;
    }
  }
  // expert groups (mesh.ep > 1): a dashed outline round each run of a group's ranks on one node row
  for (const [gi, grp] of (D.experts ? D.experts.groups : []).entries()) {
    for (let i = 0; i < grp.length;) {
      let j = i;
      while (j + 1 < grp.length && grp[j + 1] === grp[j] + 1 && Math.floor(grp[j + 1] / gpn) === Math.floor(grp[i] / gpn)) j++;
      const [x, y] = at(grp[i]);
      root.append(svg("rect", {x: x - gap / 2 + 2, y: y - gap / 2 + 2, width: (j - i + 1) * (cw + gap) - 4,
        height: ch + gap - 4, rx: 5, class: "ep-group", "data-ep-group": gi}));
      i = j + 1;
    }
  }
  const legend = el("div", {class: "legend"},
    ...stageList(p).map(s => el("span", {class: "key"}, el("i", {style: `background:${stageColour(s)}`}), `stage ${s}`)),
    el("span", {class: "key"}, el("i", {class: "outline"}), `TP group (${m.tp} ${devicesWord(dev, m.tp)})`),
    ...(D.experts ? [el("span", {class: "key"}, el("i", {class: "outline dashed"}), `expert group (ep=${D.experts.ep})`)] : []));
  const note = el("p", {class: "note", text:
    `${world} of ${rows * gpn} ${devicesWord(dev, rows * gpn)} (${rows} node(s) x ${gpn}); rank order pp, dp, tp with tp innermost: ` +
    `rank = (pp x ${m.dp} + dp) x ${m.tp} + tp. Labels: s = stage, d = dp rank, t = tp rank.`});
  return section("mesh", "Device mesh", legend, el("div", {class: "scroll"}, root), note, ...expertParts(D));
}
// expert parallelism (mesh.ep > 1): which ranks form each expert group, the experts each rank holds
function heldText(experts, staged) {
  const spans = [...new Set(Object.values(experts).map(([lo, hi]) => hi > lo ? `${lo}-${hi}` : `${lo}`))];
  if (!spans.length) return "no MoE layer on its stage";
  return spans.length === 1 ? `experts ${spans[0]} of every MoE layer${staged ? " on its stage" : ""}` :
    Object.entries(experts).map(([name, [lo, hi]]) => `${name}: ${lo}-${hi}`).join("; ");
}
function expertParts(D) {
  const X = D.experts;
  if (!X) return [];
  const layers = X.layers.map(l => `${l.module} (${l.experts} experts, ${l.per_rank} per rank)`).join(", ");
  const rows = X.groups.flatMap((grp, g) => grp.map(r => [r === grp[0] ? `${g}: ranks ${grp.join(", ")}` : "",
    String(r), heldText(X.ranks[r].experts, X.staged), X.ranks[r].edp.join(", ")]));
  return [el("h3", {text: `Expert parallelism (ep=${X.ep})`}),
    el("p", {class: "note", id: "experts-summary", text: `${X.layers.length} MoE layer(s): ${layers}. Each expert group ` +
      `of ${X.ep} data-parallel ranks splits every layer's experts and exchanges token rows by all-to-all; the ranks ` +
      `holding the same experts (edp) average their gradients.`}),
    table(["expert group", "rank", "holds", "gradients averaged with (edp)"], rows, "experts")];
}
function stageList(p) {
  const n = Math.max(1, p.stages.length, p.mesh.pp);
  return Array.from({length: n}, (_, i) => i);
}

// -- model graph ----------------------------------------------------------------------------------------------
function repeatedPrefixes(model) {
  return (model.repeated_layers || []).map(s => s.split(" ")[0]).filter(Boolean);
}
function groupKeyOf(module, prefixes) {
  for (const pre of prefixes) {
    if (module.startsWith(pre + ".")) {
      const idx = module.slice(pre.length + 1).split(".")[0];
      if (/^\d+$/.test(idx)) return pre + "." + idx;
    }
  }
  if (!module) return "(model)";
  return module.split(".").slice(0, 2).join(".");
}
function paramSplit(p) {
  // a parameter's TP split in words: Linear weights (out, in) shard(0) = col, shard(1) = row; embeddings: vocab
  const lay = (p.layout || {}).tp || "replicate";
  if (lay === "replicate") return "replicate";
  if (lay === "shard(0)") return /emb|wte|tok|vocab|lm_head/.test(p.name) && p.shape.length === 2 ? "vocab" : "col";
  if (lay === "shard(1)" && p.shape.length === 2) return "row";
  return lay;
}
function collectivesOf(e) {
  const out = [];
  if (!FREE.has(e.fwd)) out.push({dir: "forward", kind: e.fwd, bytes: e.bytes});
  if (!FREE.has(e.bwd)) out.push({dir: "backward", kind: e.bwd, bytes: e.bytes});
  return out;
}
const WEIGHT_OP = /linear|addmm|\bmm\b|^mm|matmul|bmm|embedding|conv/;

function buildGraph(p) {
  const prefixes = repeatedPrefixes(p.model);
  const paramsByModule = new Map();
  for (const q of p.params) {
    const mod = q.name.includes(".") ? q.name.slice(0, q.name.lastIndexOf(".")) : "(root)";
    if (!paramsByModule.has(mod)) paramsByModule.set(mod, []);
    paramsByModule.get(mod).push(q);
  }
  const fromNodes = p.nodes.length > 0;
  // ops: the plan's nodes, or (a plan without per-op decisions) its parameters in order
  const ops = fromNodes ? p.nodes.map(n => ({
    name: n.name, op: shortOp(n.op), module: n.module, stage: n.stage || 0, strategy: n.strategy, ins: n.ins || [],
    internal: n.internal || [], out: n.out, compute_s: n.compute_s || 0, group: n.layer || groupKeyOf(n.module, prefixes),
    weighted: WEIGHT_OP.test(n.op) && paramsByModule.has(n.module) || ["col", "row", "vocab"].includes(n.strategy),
    params: paramsByModule.get(n.module) || [],
  })) : p.params.map(q => {
    const mod = q.name.includes(".") ? q.name.slice(0, q.name.lastIndexOf(".")) : "";
    return {name: q.name, op: `param [${q.shape.join(", ")}] ${q.dtype}`, module: mod, stage: q.stage || 0,
      strategy: paramSplit(q), ins: [], internal: [], out: [], compute_s: 0, group: groupKeyOf(mod, prefixes),
      weighted: true, params: [q]};
  });
  const index = new Map(ops.map((o, i) => [o.name, i]));
  const moduleGroup = new Map();
  for (const o of ops) if (!moduleGroup.has(o.module)) moduleGroup.set(o.module, o.group);
  const groups = [], byKey = new Map();
  ops.forEach((o, i) => {
    if (!byKey.has(o.group)) {
      const g = {key: o.group, ops: [], stages: new Set(), layer: prefixes.some(pr => o.group.startsWith(pr + "."))};
      byKey.set(o.group, g); groups.push(g);
    }
    const g = byKey.get(o.group);
    g.ops.push(i); g.stages.add(o.stage);
  });
  groups.forEach((g, i) => { g.index = i; g.stage = Math.min(...g.stages); });
  // edges: node inputs from other nodes (placeholders, i.e. inputs and parameters, are not drawn)
  const edges = [];
  ops.forEach((o, j) => o.ins.forEach(e => {
    const i = index.get(e.src);
    if (i !== undefined) edges.push({from: i, to: j, layout: e, coll: collectivesOf(e)});
  }));
  const groupEdges = new Map();
  for (const e of edges) {
    const a = byKey.get(ops[e.from].group).index, b = byKey.get(ops[e.to].group).index;
    if (a === b) continue;
    const k = a + ">" + b;
    if (!groupEdges.has(k)) groupEdges.set(k, {a, b, edges: [], coll: []});
    const ge = groupEdges.get(k);
    ge.edges.push(e); ge.coll.push(...e.coll);
  }
  if (!fromNodes) { // no data flow in the plan: connect modules in parameter order
    for (let i = 0; i + 1 < groups.length; i++) groupEdges.set(i + ">" + (i + 1), {a: i, b: i + 1, edges: [], coll: []});
  }
  for (const g of groups) {
    g.inner = edges.filter(e => ops[e.from].group === g.key && ops[e.to].group === g.key);
    g.innerColl = g.inner.flatMap(e => e.coll).concat(g.ops.flatMap(i => ops[i].internal.map(parseInternal)));
    g.splits = new Map();
    for (const i of g.ops) if (ops[i].weighted) g.splits.set(ops[i].strategy, (g.splits.get(ops[i].strategy) || 0) + 1);
    g.params = [...paramsByModule.entries()].filter(([m]) => groupKeyOf(m, prefixes) === g.key).flatMap(([, v]) => v);
  }
  return {ops, groups, edges, groupEdges: [...groupEdges.values()], fromNodes,
    groupOf: m => moduleGroup.get(m) || groupKeyOf(m, prefixes)};
}
function parseInternal(s) {
  const [kind, n] = s.split(":");
  return {dir: "inside the op", kind, bytes: Number(n)};
}
function collSummary(coll) {
  const bytes = coll.reduce((s, c) => s + c.bytes, 0);
  const kinds = [...new Set(coll.map(c => c.kind))];
  const dir = {forward: "fwd", backward: "bwd"}[coll[0].dir] || "in-op";
  return coll.length === 1 ? `${dir} ${coll[0].kind} ${fmtBytes(bytes)}` :
    `${coll.length} collectives (${kinds.join(", ")}) ${fmtBytes(bytes)}`;
}
function edgeTip(ops, list) {
  const lines = [];
  for (const e of list.slice(0, 12)) {
    const l = e.layout;
    lines.push(`${ops[e.from].name} -> ${ops[e.to].name}: ${fmtBytes(l.bytes)} tensor`);
    lines.push(`  forward ${l.fwd} (${l.have} -> ${l.need}); backward ${l.bwd} (${l.grad} -> ${l.grad_need})`);
  }
  if (list.length > 12) lines.push(`... ${list.length - 12} more edges`);
  return lines;
}

function changedModules(diff) {
  const out = new Map();
  if (!diff) return out;
  for (const lc of diff.layouts) {
    for (const c of [...lc.params, ...lc.nodes]) {
      if (!out.has(lc.module)) out.set(lc.module, []);
      out.get(lc.module).push(`${c.field}: ${c.a ?? "(absent)"} -> ${c.b ?? "(absent)"}`);
    }
  }
  return out;
}

function graphSection(D) {
  const p = D.plan, G = buildGraph(p);
  const changed = changedModules(D.diff);
  const changesOf = new Map(); // group -> changes of the modules in it
  for (const [m, lines] of changed) {
    const key = G.groupOf(m === "(root)" ? "" : m);
    changesOf.set(key, (changesOf.get(key) || []).concat(lines));
  }
  const groupChanges = g => changesOf.get(g.key) || [];
  const expanded = new Set();
  const holder = el("div", {class: "scroll graph-scroll"});
  const X0 = 190, W = 470, BH = 30, GAP = 26, OH = 21, ARC0 = X0 + W + 8, BADGE = X0 + W + 150;
  function draw() {
    // layout: a column of module boxes; an expanded one lists its ops under its header
    let y = 10;
    const pos = G.groups.map(g => {
      const top = y, n = expanded.has(g.key) ? g.ops.length : 0;
      const h = BH + (n ? n * OH + 8 : 0);
      y += h + GAP;
      return {top, h, bottom: top + h};
    });
    const opY = new Map();
    G.groups.forEach((g, gi) => {
      if (expanded.has(g.key)) g.ops.forEach((i, k) => opY.set(i, pos[gi].top + BH + 4 + k * OH + OH / 2));
    });
    const H = y + 10, maxSkip = Math.max(0, ...G.groupEdges.map(e => e.b - e.a));
    const Wsvg = BADGE + 300;
    const root = svg("svg", {width: Wsvg, height: H, class: "graph", viewBox: `0 0 ${Wsvg} ${H}`});
    root.append(svg("defs", {}, svg("marker", {id: "arrow", viewBox: "0 0 8 8", refX: 7, refY: 4, markerWidth: 7,
      markerHeight: 7, orient: "auto-start-reverse"}, svg("path", {d: "M0,0 L8,4 L0,8 z", class: "arrowhead"}))));
    const edgeLayer = svg("g", {class: "edges"}), boxLayer = svg("g", {class: "boxes"});
    root.append(edgeLayer, boxLayer);
    // module-to-module edges; a module feeding many later ones (rotary tables, masks) gets one bus line
    const skipsFrom = new Map();
    for (const ge of G.groupEdges) if (ge.b !== ge.a + 1) skipsFrom.set(ge.a, (skipsFrom.get(ge.a) || 0) + 1);
    const busLane = new Map();
    for (const [a, n] of skipsFrom) if (n >= 3) busLane.set(a, busLane.size);
    for (const [a, lane] of busLane) {
      const xb = X0 - 14 - 10 * lane, last = Math.max(...G.groupEdges.filter(e => e.a === a).map(e => e.b));
      edgeLayer.append(svg("path", {d: `M${X0},${pos[a].top + BH / 2} H${xb} V${pos[last].top + BH / 2}`, class: "bus"}));
    }
    for (const ge of G.groupEdges) {
      const a = pos[ge.a], b = pos[ge.b], hasColl = ge.coll.length > 0;
      let d, bx, by;
      if (busLane.has(ge.a) && ge.b !== ge.a + 1) {
        const xb = X0 - 14 - 10 * busLane.get(ge.a), yb = b.top + BH / 2;
        d = `M${xb},${yb} H${X0 - 2}`;
        bx = xb - 4; by = yb;
      } else if (ge.b === ge.a + 1) {
        const x = X0 + 28;
        d = `M${x},${a.bottom} L${x},${b.top - 1}`;
        bx = x + 10; by = (a.bottom + b.top) / 2;
      } else {
        const xa = X0, k = Math.abs(ge.b - ge.a), w = 16 + (X0 - 30) * Math.min(1, k / Math.max(4, maxSkip));
        const ya = a.top + BH / 2, yb = b.top + BH / 2;
        d = `M${xa},${ya} C${xa - w},${ya} ${xa - w},${yb} ${xa - 2},${yb}`;
        bx = xa - w * 0.75 - 4; by = (ya + yb) / 2;
      }
      const g = svg("g", {class: "edge" + (hasColl ? " coll" : "") + (ge.b === ge.a + 1 ? "" : " skip") +
        (busLane.has(ge.a) && ge.b !== ge.a + 1 ? " bus-tap" : ""),
        "data-from": G.groups[ge.a].key, "data-to": G.groups[ge.b].key});
      g.append(svg("path", {d, class: "line", "marker-end": "url(#arrow)"}), svg("path", {d, class: "hit"}));
      if (hasColl) g.append(badge(bx, by, collSummary(ge.coll), ge.b !== ge.a + 1));
      const title = `${G.groups[ge.a].key} -> ${G.groups[ge.b].key}`;
      tip(g, () => [title, hasColl ? collSummary(ge.coll) + " inserted on this edge" :
        (G.fromNodes ? "no collective: placements already match" : "modules in parameter order (no per-op data flow in this plan)"),
        ...(hasColl ? ge.coll.map(c => `${c.dir} ${c.kind}: ${fmtBytes(c.bytes)}`) : []), ...edgeTip(G.ops, ge.edges)]);
      edgeLayer.append(g);
    }
    // module boxes
    G.groups.forEach((g, gi) => {
      const P = pos[gi], open = expanded.has(g.key), changes = groupChanges(g);
      const box = svg("g", {class: "module" + (g.layer ? " layer" : "") + (open ? " open" : "") +
        (changes.length ? " changed" : ""), "data-group": g.key, "data-stage": g.stage, transform: `translate(${X0},${P.top})`});
      box.append(svg("rect", {width: W, height: P.h, rx: 6, class: "frame", fill: stageColour(g.stage)}));
      const head = svg("g", {class: "head", role: "button"});
      head.append(svg("rect", {width: W, height: BH, rx: 6, class: "headbg", fill: stageColour(g.stage)}));
      head.append(svg("text", {x: 10, y: 19, class: "mname", text: (open ? "▾ " : "▸ ") + g.key}));
      const stages = [...g.stages].sort((x, y) => x - y);
      head.append(svg("text", {x: W - 8, y: 19, class: "mmeta", "text-anchor": "end",
        text: `${g.ops.length} ${G.fromNodes ? "op" : "param"}${g.ops.length === 1 ? "" : "s"} · stage ${stages.join(",")}`}));
      let cx = 10 + Math.min(250, 8.4 * (g.key.length + 2));
      for (const [s, n] of [...g.splits.entries()].sort()) {
        cx += chip(head, cx, 8, n > 1 ? `${s} ×${n}` : s, s) + 4;
      }
      if (g.innerColl.length) cx += chip(head, cx, 8, `⇄ ${g.innerColl.length}`, "coll") + 4;
      if (changes.length) chip(head, cx, 8, "changed", "changed");
      tip(head, () => [`${g.key}: ${g.ops.length} ${G.fromNodes ? "graph nodes" : "parameters"}, stage ${stages.join(", ")}`,
        ...(g.splits.size ? ["splits: " + [...g.splits.entries()].map(([s, n]) => `${s} x${n}`).join(", ")] : []),
        ...g.params.slice(0, 10).map(q => `${q.name} [${q.shape.join(", ")}]: tp ${(q.layout || {}).tp || "replicate"} (${paramSplit(q)})`),
        ...(g.params.length > 10 ? [`... ${g.params.length - 10} more parameters`] : []),
        ...(g.innerColl.length ? [`collectives inside: ${collSummary(g.innerColl)}`] : []),
        ...changes.map(c => "changed: " + c),
        open ? "click to collapse" : "click to expand"]);
      head.addEventListener("click", () => { open ? expanded.delete(g.key) : expanded.add(g.key); draw(); });
      box.append(head);
      if (open) g.ops.forEach((i, k) => box.append(opRow(G.ops[i], BH + 4 + k * OH, g)));
      boxLayer.append(box);
    });
    // edges inside expanded modules (arcs right of the column) and collectives into expanded ops
    for (const e of G.edges) {
      if (!opY.has(e.to)) continue;
      const yb = opY.get(e.to);
      if (opY.has(e.from) && G.ops[e.from].group === G.ops[e.to].group) {
        const ya = opY.get(e.from), w = Math.min(130, 10 + 3 * Math.sqrt(Math.abs(yb - ya)) * 2);
        const d = `M${ARC0},${ya} C${ARC0 + w},${ya} ${ARC0 + w},${yb} ${ARC0 + 2},${yb}`;
        const g = svg("g", {class: "edge op-edge" + (e.coll.length ? " coll" : ""), "data-from": G.ops[e.from].name,
          "data-to": G.ops[e.to].name});
        g.append(svg("path", {d, class: "line", "marker-end": "url(#arrow)"}), svg("path", {d, class: "hit"}));
        if (e.coll.length) g.append(badge(BADGE, yb, collSummary(e.coll), false));
        tip(g, () => [`${G.ops[e.from].name} -> ${G.ops[e.to].name}`,
          e.coll.length ? collSummary(e.coll) + " inserted on this edge" : "no collective", ...edgeTip(G.ops, [e])]);
        edgeLayer.append(g);
      } else if (e.coll.length) {
        const g = svg("g", {class: "edge op-edge coll external", "data-from": G.ops[e.from].name, "data-to": G.ops[e.to].name});
        g.append(badge(BADGE, yb, "← " + collSummary(e.coll), false));
        tip(g, () => [`${G.ops[e.from].name} (${G.ops[e.from].group}) -> ${G.ops[e.to].name}`,
          collSummary(e.coll) + " inserted on this edge", ...edgeTip(G.ops, [e])]);
        edgeLayer.append(g);
      }
    }
    holder.replaceChildren(root);
  }
  function badge(x, y, text, anchorEnd) {
    const w = 7 * text.length + 12;
    const x0 = anchorEnd ? x - w : x;
    return svg("g", {class: "badge"}, svg("rect", {x: x0, y: y - 9, width: w, height: 18, rx: 9}),
      svg("text", {x: x0 + 6, y: y + 4, class: "badge-text", text}));
  }
  function chip(parent, x, y, text, kind) {
    const w = 6.2 * text.length + 10;
    parent.append(svg("g", {class: `chip chip-${kind.replace(/[^a-z]/g, "")}`, "data-split": kind},
      svg("rect", {x, y, width: w, height: 15, rx: 7}), svg("text", {x: x + 5, y: y + 11, text})));
    return w;
  }
  function opRow(o, y, g) {
    const row = svg("g", {class: "op", "data-node": o.name, transform: `translate(0,${y})`});
    row.append(svg("rect", {x: 6, width: W - 12, height: OH - 3, rx: 3, class: "opbg"}));
    row.append(svg("text", {x: 14, y: 13, class: "opname", text: o.name.length > 36 ? "…" + o.name.slice(-35) : o.name}));
    row.append(svg("text", {x: 262, y: 13, class: "optype", text: o.op.length > 20 ? o.op.slice(0, 19) + "…" : o.op}));
    if (o.weighted || o.strategy !== "replicate") chip(row, W - 84, 2, o.strategy, o.strategy);
    const stageNote = o.stage !== g.stage ? ` (stage ${o.stage})` : "";
    tip(row, () => [`${o.name}: ${o.op}${stageNote}`, `module ${o.module || "(root)"}, strategy ${o.strategy}`,
      ...(o.out.length ? [`out: ${o.out.join(", ")}`] : []),
      ...o.ins.map(e => `in ${e.src}: ${e.have} -> ${e.need} (fwd ${e.fwd}, bwd ${e.bwd}, ${fmtBytes(e.bytes)})`),
      ...o.internal.map(s => `inside: ${parseInternal(s).kind} ${fmtBytes(parseInternal(s).bytes)}`),
      ...o.params.map(q => `param ${q.name} [${q.shape.join(", ")}]: ${Object.entries(q.layout).map(([k, v]) => `${k}=${v}`).join(", ")}`),
      ...(o.compute_s ? [`compute ${fmtTime(o.compute_s)} (forward + backward, one device)`] : [])]);
    return row;
  }
  draw();
  const nColl = G.edges.reduce((s, e) => s + e.coll.length, 0);
  // collectives the plan inserts around ops rather than on an edge (expert all-to-alls), counted beside them
  const nAround = p.collectives.filter(c => c.axis === "ep").length;
  const intro = el("p", {class: "note", text: G.fromNodes ?
    `${G.ops.length} graph nodes in ${G.groups.length} modules (${G.groups.filter(g => g.layer).length} repeated layers), ` +
    `${G.edges.length} edges, ${nColl} inserted collectives` + (nAround ? ` (and ${nAround} expert all-to-all kinds around the MoE layers)` : "") + `. Click a module to list its ops; hover an edge or a badge ` +
    `for its collective and bytes.` :
    `This plan has no per-op decisions (data parallel: every op replicated, no collectives inside the model). ` +
    `Modules are shown from the plan's ${p.params.length} parameters, in order; click one to list them.`});
  const legend = el("div", {class: "legend"},
    ...stageList(p).map(s => el("span", {class: "key"}, el("i", {style: `background:${stageColour(s)}`}), `stage ${s}`)),
    ...["col", "row", "vocab", "heads", "replicate"].map(s => el("span", {class: `key split-${s}`, text: s})),
    el("span", {class: "key split-coll", text: "⇄ collectives"}));
  return section("graph", "Model graph", intro, legend, holder);
}

// -- memory ---------------------------------------------------------------------------------------------------
const MEM_KINDS = [["params", "#4e79a7"], ["grads", "#59a14f"], ["optimizer", "#f28e2b"], ["activations", "#b07aa1"],
  ["extra", "#e15759"], ["allocator", "#bab0ac"]];
const MEM_LABELS = {extra: "transient and buffers", allocator: "allocator"};
function memorySection(D) {
  const rows = D.memory, cap = Math.max(...rows.map(r => r.capacity));
  // far below capacity, the bars use the space and capacity is marked off scale
  const most = Math.max(...rows.map(r => r.total)), offScale = cap > 4 * most;
  const scaleMax = offScale ? most * 1.1 : Math.max(cap, most) * 1.02;
  const L = 150, BW = 620, RH = 26, H = 24 + rows.length * (RH + 8) + 20;
  const root = svg("svg", {width: L + BW + 170, height: H, class: "memory"});
  const sx = v => L + BW * v / scaleMax;
  rows.forEach((r, i) => {
    const y = 20 + i * (RH + 8);
    const g = svg("g", {class: "mem-bar", "data-stage": r.stage});
    const mode = (D.plan.stages[r.stage] || {}).recompute || "none";
    const rc = (mode !== "none" ? ` · recomputes ${mode}` : "") +
      (D.plan.training.offload === "optimizer" ? " · state on host" : "");
    g.append(svg("text", {x: 4, y: y + 17, class: "axis", text: `stage ${r.stage} · ${rankRange(r.ranks)}${rc}`}));
    g.append(svg("rect", {x: L, y, width: BW, height: RH, class: "mem-bg"}));
    let x = L;
    for (const [kind, colour] of MEM_KINDS) {
      const w = sx(r[kind]) - L;
      const seg = svg("rect", {x, y, width: Math.max(0, w), height: RH, fill: colour, class: "mem-seg", "data-kind": kind,
        "data-bytes": r[kind]});
      tip(seg, [`stage ${r.stage}: ${MEM_LABELS[kind] || kind} ${fmtBytes(r[kind])} per device`,
        r.exact ? "from the plan's breakdown of its most loaded device" :
          "estimated: state scaled by the stage's parameters, activations the rest of its total"]);
      g.append(seg);
      if (w > 70) g.append(svg("text", {x: x + 5, y: y + 17, class: "seg-text", text: fmtBytes(r[kind])}));
      x += w;
    }
    g.append(svg("text", {x: L + BW + 8, y: y + 17, class: "mem-total",
      text: `${fmtBytes(r.total)} (${fmtPct(r.total / r.capacity)})${r.exact ? "" : " ≈"}`}));
    root.append(g);
  });
  if (offScale) {
    root.append(svg("text", {x: L + BW, y: 10, class: "capacity-text", "text-anchor": "end",
      text: `capacity ${fmtBytes(cap)} (off scale, ${g3(cap / most)}x the most loaded) →`}));
  } else {
    const xc = sx(cap);
    root.append(svg("line", {x1: xc, x2: xc, y1: 12, y2: H - 14, class: "capacity"}));
    root.append(svg("text", {x: xc, y: 10, class: "capacity-text", "text-anchor": "middle", text: `capacity ${fmtBytes(cap)}`}));
  }
  const table = el("table", {class: "mem-table"},
    el("thead", {}, el("tr", {}, ...["stage", "ranks", ...MEM_KINDS.map(k => MEM_LABELS[k[0]] || k[0]), "total", "capacity", "fits"].map(
      t => el("th", {text: t})))),
    el("tbody", {}, ...rows.map(r => el("tr", {"data-stage": r.stage, class: r.exact ? "" : "estimated"},
      el("td", {text: String(r.stage)}), el("td", {text: rankRange(r.ranks)}),
      ...MEM_KINDS.map(([k]) => el("td", {"data-kind": k, text: fmtBytes(r[k]) + (r.exact || k === "activations" ? "" : " ≈")})),
      el("td", {"data-kind": "total", text: fmtBytes(r.total)}), el("td", {text: fmtBytes(r.capacity)}),
      el("td", {class: r.total <= r.capacity ? "ok" : "bad", text: r.total <= r.capacity ? "yes" : "no"})))));
  const legend = el("div", {class: "legend"}, ...MEM_KINDS.map(([k, c]) =>
    el("span", {class: "key"}, el("i", {style: `background:${c}`}), MEM_LABELS[k] || k)));
  return section("memory", "Memory per device", legend, root, table, el("p", {class: "note", text:
    `At the step's peak, the most loaded device: ${D.memory_terms}. ` +
    "Every device of a stage holds the same. The most loaded stage has the plan's exact breakdown; " +
    "for the others (≈) params, grads and optimizer state are scaled by the stage's parameter count and " +
    "activations are the rest of the stage's total. " + (D.sources && D.sources.memory ? `Source: ${D.sources.memory}.` : "")}));
}
function rankRange(ranks) {
  if (!ranks.length) return "-";
  const contiguous = ranks.every((r, i) => i === 0 || r === ranks[i - 1] + 1);
  return ranks.length === 1 ? `rank ${ranks[0]}` : contiguous ? `ranks ${ranks[0]}–${ranks[ranks.length - 1]}` :
    `${ranks.length} ranks`;
}

// -- schedule -------------------------------------------------------------------------------------------------
function niceStep(span, n) {
  const raw = span / n, mag = Math.pow(10, Math.floor(Math.log10(raw)));
  return [1, 2, 5, 10].map(m => m * mag).find(s => s >= raw) || raw;
}
function timelineSvg(T, span, label, cls) {
  const L = 80, TW = 900, RH = 20, top = 22, H = top + T.stages * (RH + 6) + 24;
  const root = svg("svg", {width: L + TW + 140, height: H, class: "timeline " + cls, "data-source": T.source});
  const sx = t => L + TW * t / span;
  root.append(svg("text", {x: 4, y: 14, class: "tl-title", text: label}));
  const chunked = (T.chunks || 1) > 1;  // rows are pipeline ranks running several virtual stages
  for (let s = 0; s < T.stages; s++) {
    const y = top + s * (RH + 6);
    root.append(svg("text", {x: 4, y: y + 14, class: "axis", text: chunked ? `rank ${s}` : `stage ${s}`}));
    root.append(tip(svg("rect", {x: L, y, width: sx(T.makespan) - L, height: RH, class: "idle"}),
      [`stage ${s}: idle (bubble) ${fmtPct(T.bubble[s])} of the step`]));
    root.append(svg("text", {x: L + TW + 8, y: y + 14, class: "bubble-text", "data-stage": s,
      text: `bubble ${fmtPct(T.bubble[s])}`}));
  }
  const slots = svg("g", {class: "slots"});
  for (const [s, k, mb, t0, t1, c] of T.slots) {
    const y = top + s * (RH + 6), x = sx(t0), w = Math.max(0.5, sx(t1) - x), vs = c === undefined ? s : c;
    const g = svg("g", {class: "slot " + (k ? "bwd" : "fwd"), "data-stage": s, "data-mb": mb, "data-chunk": vs});
    g.append(svg("rect", {x, y, width: w, height: RH, fill: stageColour(vs), "fill-opacity": k ? 1 : 0.55}));
    if (w > 14) g.append(svg("text", {x: x + w / 2, y: y + 14, class: "slot-text",
      text: (k ? "B" : "F") + mb + (chunked ? `.${vs}` : "")}));
    tip(g, [(chunked ? `rank ${s}, virtual stage ${vs}` : `stage ${s}`) +
      ` ${k ? "backward" : "forward"} of micro-batch ${mb}`,
      `${fmtTime(t0)} – ${fmtTime(t1)} (${fmtTime(t1 - t0)})`]);
    slots.append(g);
  }
  root.append(slots);
  const step = niceStep(span, 8), yAxis = top + T.stages * (RH + 6) + 2;
  for (let t = 0; t <= span * 1.0001; t += step) {
    root.append(svg("line", {x1: sx(t), x2: sx(t), y1: yAxis, y2: yAxis + 4, class: "tick"}));
    root.append(svg("text", {x: sx(t), y: yAxis + 16, class: "axis", "text-anchor": "middle", text: t ? fmtTime(t) : "0"}));
  }
  return root;
}
// the header's step time against this timeline's span, term by term: the two are different sums, and the page says how
function scheduleGap(p, T) {
  const pr = p.predicted, comm = pr.comm_s || {};
  const bubble = comm.pp_bubble || 0, sends = comm.pp_send_recv || 0;
  const rest = Object.entries(comm).filter(([k]) => k !== "pp_bubble" && k !== "pp_send_recv")
    .reduce((a, [, v]) => a + v, 0);
  const gap = pr.compute_s + bubble - T.makespan;
  return `The plan's step time ${fmtTime(pr.step_time_s)} = compute ${fmtTime(pr.compute_s)} (every micro-batch on the ` +
    `slowest stage, with each micro-batch's fixed overhead) + pipeline bubble ${fmtTime(bubble)} (priced as ` +
    `${g3((T.stages - 1) / (T.chunks || 1))} slot(s) of that stage, each its forward and backward) + stage sends ${fmtTime(sends)} + other exposed ` +
    `communication ${fmtTime(rest)} + optimizer ${fmtTime(pr.optimizer_s)}. This timeline plays each stage's own ` +
    `forward and backward times without the per-micro-batch overhead, sends or optimizer, so its span differs from ` +
    `compute + bubble by ${fmtTime(Math.abs(gap))} (${gap >= 0 ? "the plan's sum is longer" : "the timeline is longer"}).`;
}
function scheduleSection(D) {
  const p = D.plan, T = D.timeline, M = D.measured;
  const span = Math.max(T.makespan, M ? M.makespan : 0) || 1;
  const name = {none: "no pipeline schedule", gpipe: "GPipe", "1f1b": "1F1B",
    "interleaved-1f1b": "interleaved 1F1B"}[T.schedule] || T.schedule;
  const over = (T.chunks || 1) > 1
    ? `${T.stages} ranks of ${T.chunks} virtual stages each (stage c on rank c mod ${T.stages}; a slot reads F<micro-batch>.<stage>)`
    : `${T.stages} stage(s)`;
  const parts = [el("p", {class: "note", id: "schedule-summary", text:
    `${name}, ${T.microbatches} micro-batch(es) of ${p.training.micro_batch_size} over ${over}: ` +
    `predicted compute span ${fmtTime(T.makespan)} per step. Forward light, backward dark, grey is idle.`}),
    el("p", {class: "note", id: "schedule-gap", text: scheduleGap(p, T)}),
    el("div", {class: "scroll"}, timelineSvg(T, span, `predicted · ${fmtTime(T.makespan)}`, "predicted"))];
  if (M) {
    parts.push(el("div", {class: "scroll"}, timelineSvg(M, span,
      `measured · ${fmtTime(M.makespan)} (${(M.makespan / T.makespan).toFixed(2)}x predicted) · ${M.source}`, "measured")));
  }
  return section("schedule", "Pipeline schedule", ...parts);
}

// -- alternatives ---------------------------------------------------------------------------------------------
// a candidate branch and bound left unsolved has no step time or memory of its own (its reason says why)
function unsolved(a) { return !a.fits && a.step_time_s === null && !a.memory_bytes; }
function alternativesSection(D) {
  const alts = D.plan.alternatives;
  if (!alts.length) return section("alternatives", "Alternatives weighed", el("p", {class: "note", text: "The plan records none."}));
  const rows = alts.map((a, i) => el("tr", {class: a.chosen ? "chosen" : a.fits ? "" : "nofit", "data-index": i},
    el("td", {text: meshText(a.mesh)}), el("td", {text: String(a.micro_batch_size)}), el("td", {text: String(a.grad_accum_steps)}),
    el("td", {text: String(a.zero_stage)}), el("td", {class: "num", text: fmtTime(a.step_time_s)}),
    el("td", {class: "num", text: unsolved(a) ? "-" : fmtBytes(a.memory_bytes)}), el("td", {text: a.fits ? "yes" : "no"}),
    el("td", {text: a.reason})));
  const table = el("table", {class: "alts"}, el("thead", {}, el("tr", {}, ...["mesh", "micro-batch", "accum", "ZeRO",
    "step time", "memory/device", "fits", "why"].map(t => el("th", {text: t})))), el("tbody", {}, ...rows));
  const fits = alts.filter(a => a.fits).length;
  return section("alternatives", "Alternatives weighed", el("p", {class: "note", text:
    `${alts.length} of the ${D.plan.solver.candidates} candidates solved are listed (the header's count), ${fits} of ` +
    `them fit memory; the chosen one is highlighted, those that do not fit are red, and "-" marks one not solved ` +
    `(its reason says why).`}),
    el("div", {class: "scroll tall"}, table));
}

// -- changes from the baseline ---------------------------------------------------------------------------------
function diffSection(D) {
  const d = D.diff, A = D.against;
  const step = d.metrics.find(m => m.name === "step time");
  const parts = [el("p", {class: "note", id: "diff-summary", text: d.identical ?
    `Same decisions and predictions as the baseline ${A.name} (${A.mesh}).` :
    `Compared with the baseline ${A.name} (${A.mesh}, ${A.fingerprint}): ${d.layouts.length} module(s) with layout changes, ` +
    `${d.stages.length} stage change(s), +${d.collectives_added.length} / -${d.collectives_removed.length} collectives; ` +
    `step time ${fmtTime(step.a)} -> ${fmtTime(step.b)}` + (step.ratio ? ` (${g3(step.ratio)}x)` : "") + "."})];
  if (!d.model.every(c => c.field !== "fingerprint")) parts.push(el("p", {class: "warn", text:
    "The plans were made for different graphs (fingerprints differ): layouts are matched by name and may not correspond."}));
  const fields = [...d.model.map(c => ["model " + c.field, c]), ...d.cluster.map(c => ["cluster " + c.field, c]),
    ...(d.mesh ? [["mesh", d.mesh]] : []), ...d.training.map(c => ["training " + c.field, c])];
  if (fields.length) parts.push(table(["what", "baseline", "this plan"], fields.map(([k, c]) => [k, String(c.a), String(c.b)]), "diff-fields"));
  parts.push(table(["predicted", "baseline", "this plan", "ratio"], d.metrics.map(m => [m.name, fmtMetric(m.unit, m.a),
    fmtMetric(m.unit, m.b), m.ratio === null ? "-" : g3(m.ratio) + "x"]), "diff-metrics",
    d.metrics.map(m => m.better === null ? "" : m.better ? "better" : "worse")));
  const lrows = d.layouts.flatMap(lc => [...lc.params, ...lc.nodes].map(c => [lc.module, c.field, c.a ?? "-", c.b ?? "-"]));
  if (lrows.length) parts.push(table(["module", "param / node", "baseline", "this plan"], lrows.slice(0, 200), "diff-layouts"));
  if (d.stages.length) parts.push(table(["stage", "baseline", "this plan"], d.stages.map(s => [String(s.index), s.a ?? "-", s.b ?? "-"]), "diff-stages"));
  for (const [title, items, cls] of [["collectives added", d.collectives_added, "added"], ["collectives removed", d.collectives_removed, "removed"]]) {
    if (!items.length) continue;
    parts.push(el("details", {class: "diff-" + cls}, el("summary", {text: `${title} (${items.length})`}),
      el("ul", {}, ...items.slice(0, 500).map(t => el("li", {text: t})))));
  }
  return section("diff", "Changes from the baseline", ...parts);
}
function fmtMetric(unit, v) {
  if (v === null || v === undefined) return "-";
  return unit === "s" ? fmtTime(v) : unit === "bytes" ? fmtBytes(v) : unit === "fraction" ? fmtPct(v) : fmtNum(v, 1);
}
function table(head, rows, cls, rowClasses) {
  return el("table", {class: cls}, el("thead", {}, el("tr", {}, ...head.map(h => el("th", {text: h})))),
    el("tbody", {}, ...rows.map((r, i) => el("tr", {class: rowClasses ? rowClasses[i] : null}, ...r.map(c => el("td", {text: c}))))));
}

// -- start -----------------------------------------------------------------------------------------------------
async function unpack() {
  const b64 = document.getElementById("partita-data").textContent.trim();
  const bytes = Uint8Array.from(atob(b64), c => c.charCodeAt(0));
  if (typeof DecompressionStream === "undefined") throw new Error("this browser cannot unpack the page (no DecompressionStream)");
  const stream = new Blob([bytes]).stream().pipeThrough(new DecompressionStream("gzip"));
  return JSON.parse(await new Response(stream).text());
}
async function main() {
  const app = document.getElementById("app");
  try {
    const D = await unpack();
    installTooltip();
    const nav = el("nav", {}, ...[["mesh", "mesh"], ["graph", "graph"], ["memory", "memory"], ["schedule", "schedule"],
      ["alternatives", "alternatives"], ...(D.diff ? [["diff", "changes"]] : [])].map(([id, t]) => el("a", {href: "#" + id, text: t})));
    const sections = [header(D), nav];
    if (D.diff) sections.push(diffSection(D));
    sections.push(meshSection(D), graphSection(D), memorySection(D), scheduleSection(D), alternativesSection(D));
    app.replaceChildren(...sections);
    document.body.dataset.ready = "1";
  } catch (e) {
    app.replaceChildren(el("p", {class: "warn", text: "partita view could not draw this plan: " + e.message}));
    document.body.dataset.ready = "error";
    throw e;
  }
}
main();
