// Draw DATA (see frontend/tree_explorer.py) as a left-to-right tree that zooms, pans, folds and finds.
"use strict";
(function () {
  const NS = "http://www.w3.org/2000/svg";
  const W = 210, H = 34, COL = 250, ROW = 42;
  const svg = document.getElementById("canvas");
  const view = document.getElementById("view");
  const info = document.getElementById("info");
  const nodes = DATA.nodes;
  const byId = new Map(nodes.map((n) => [n.id, n]));
  const kids = new Map();
  const roots = [];
  for (const n of nodes) {
    if (n.p !== null && byId.has(n.p)) {
      if (!kids.has(n.p)) kids.set(n.p, []);
      kids.get(n.p).push(n.id);
    } else roots.push(n.id);
  }
  const size = new Map();  // nodes below each node
  const order = [];
  for (const r of roots) {
    const stack = [r];
    while (stack.length) {
      const id = stack.pop();
      order.push(id);
      for (const k of kids.get(id) || []) stack.push(k);
    }
  }
  for (let i = order.length - 1; i >= 0; i--) {
    const id = order[i];
    let s = 0;
    for (const k of kids.get(id) || []) s += 1 + size.get(k);
    size.set(id, s);
  }
  // Folded at first: pruned subtrees, and in a large tree every subtree with nothing worth a look.
  const folded = new Set();
  const opened = new Set();  // folded at first, opened by the viewer
  const closed = new Set();  // folded by the viewer
  const keep = new Set();
  const ranked = nodes.filter((n) => n.g !== null).sort((a, b) => b.g - a.g).slice(0, 40);
  for (const n of nodes) {
    if (n.k || ["queued", "running", "awaiting_approval", "merged"].includes(n.s) || ranked.includes(n)) {
      let cur = n.id;
      while (cur !== null && byId.has(cur) && !keep.has(cur)) { keep.add(cur); cur = byId.get(cur).p; }
    }
  }
  for (const n of nodes) {
    if (!size.get(n.id)) continue;
    if (n.s === "pruned" || (nodes.length > 300 && !keep.has(n.id))) folded.add(n.id);
  }

  const gains = nodes.map((n) => n.g).filter((g) => g !== null).map(Math.abs).sort((a, b) => a - b);
  const spread = gains.length ? gains[Math.floor(0.9 * (gains.length - 1))] || gains[gains.length - 1] || 1 : 1;
  const [WORSE, ZERO, BETTER] = DATA.gain;
  function mix(a, b, t) {
    const pa = [1, 3, 5].map((i) => parseInt(a.slice(i, i + 2), 16));
    const pb = [1, 3, 5].map((i) => parseInt(b.slice(i, i + 2), 16));
    return "#" + pa.map((v, i) => Math.round(v + (pb[i] - v) * t).toString(16).padStart(2, "0")).join("");
  }
  function fill(n) {  // diverging: red below 0, white at 0, blue above
    if (n.g === null) return "#ffffff";
    const t = Math.max(-1, Math.min(1, n.g / (spread || 1)));
    return t >= 0 ? mix(ZERO, BETTER, t) : mix(ZERO, WORSE, -t);
  }
  const BADGE = { human: ["H", "#7b2d26"], constraint: ["C", "#b5179e"], gate: ["G", "#6a4c93"],
                  dev: ["D", "#8d6e63"], failed: ["\u00d7", "#e63946"], pruned: ["P", "#757575"], waiting: ["?", "#e76f51"] };

  const legend = document.getElementById("legend");
  legend.innerHTML = "";
  function chip(colour, text, border) {
    const s = document.createElement("span");
    const sw = document.createElement("span");
    sw.className = "sw";
    sw.style.background = colour;
    if (border) sw.style.border = "2px solid " + border;
    s.appendChild(sw);
    s.appendChild(document.createTextNode(text));
    legend.appendChild(s);
  }
  chip(WORSE, "dev gain \u2212" + spread.toPrecision(2));
  chip(ZERO, "0", "#ccc");
  chip(BETTER, "+" + spread.toPrecision(2));
  for (const [m, [letter, colour]] of Object.entries(BADGE)) {
    if (nodes.some((n) => n.m === m)) chip(colour, letter + " " + DATA.marks[m]);
  }
  chip("#ffffff", "outline: status", "#57cc99");

  let pos = new Map();
  let rows = 0;
  function layout() {
    pos = new Map();
    let row = 0;
    for (const r of roots) {
      const stack = [[r, 0, false]];
      while (stack.length) {
        const [id, depth, done] = stack.pop();
        const below = folded.has(id) ? [] : kids.get(id) || [];
        if (!below.length) { pos.set(id, [depth * COL, row * ROW]); row++; continue; }
        if (done) {
          const a = pos.get(below[0])[1], b = pos.get(below[below.length - 1])[1];
          pos.set(id, [depth * COL, (a + b) / 2]);
          continue;
        }
        stack.push([id, depth, true]);
        for (let i = below.length - 1; i >= 0; i--) stack.push([below[i], depth + 1, false]);
      }
    }
    rows = row;
  }

  function el(name, attrs, parent) {
    const e = document.createElementNS(NS, name);
    for (const k in attrs) e.setAttribute(k, attrs[k]);
    if (parent) parent.appendChild(e);
    return e;
  }
  function short(text, n) { return text.length <= n ? text : text.slice(0, n - 1) + "\u2026"; }
  function fmt(x) { return x === null ? "" : (x >= 0 ? "+" : "\u2212") + Math.abs(x).toPrecision(3); }

  let hit = null;
  function draw() {
    layout();
    view.textContent = "";
    const edges = el("g", {}, view);
    const boxes = el("g", {}, view);
    let shown = 0;
    for (const [id, [x, y]] of pos) {
      const n = byId.get(id);
      shown++;
      if (n.p !== null && pos.has(n.p)) {
        const [px, py] = pos.get(n.p);
        const mid = px + W + (COL - W) / 2;
        el("path", { d: `M${px + W},${py + H / 2}H${mid}V${y + H / 2}H${x}`, fill: "none",
                     stroke: n.k ? "#1b7f4b" : "#b0b0b8", "stroke-width": n.k ? 3 : 1.2 }, edges);
      }
      const a = el("a", { href: DATA.url + id, target: "_top" }, boxes);
      const g = el("g", { class: "node" + (hit === id ? " hit" : ""), transform: `translate(${x},${y})`,
                          "data-id": id, "data-number": n.n }, a);
      const box = el("rect", { class: "box", width: W, height: H, rx: 6, fill: fill(n),
                               stroke: DATA.status[n.s] || "#ccc", "stroke-width": n.k ? 4.5 : 2.5 }, g);
      if (n.s === "pruned" || n.s === "cancelled") { box.setAttribute("stroke-dasharray", "5 3"); box.setAttribute("opacity", "0.7"); }
      const title = el("title", {}, g);
      title.textContent = `n${n.n} \u00b7 ${n.t}\n${n.f}` + (n.g !== null ? `\ndev gain ${fmt(n.g)}` + (n.l !== null ? ` (LCB ${fmt(n.l)})` : "") : "") +
        (n.h !== null ? `\nheld-out gain ${fmt(n.h)}` : "");
      let left = 6;
      if (n.m && BADGE[n.m]) {
        const [letter, colour] = BADGE[n.m];
        el("circle", { cx: 12, cy: H / 2, r: 8, fill: colour }, g);
        const b = el("text", { class: "badge", x: 12, y: H / 2 + 3.5, "text-anchor": "middle" }, g);
        b.textContent = letter;
        left = 24;
      }
      const label = el("text", { class: "label", x: left, y: 14 }, g);
      label.textContent = `n${n.n} \u00b7 ${n.s}`;
      const sub = el("text", { class: "sub label", x: left, y: 27 }, g);
      sub.textContent = short(n.t, 30) + (n.g !== null ? "  " + fmt(n.g) : "");
      const hidden = size.get(id);
      if (hidden) {
        const f = el("g", { class: "foldbox", transform: `translate(${x + W + 10},${y + H / 2})`, "data-fold": id }, boxes);
        el("circle", { class: "fold", r: 7 }, f);
        const t = el("text", { class: "foldtext", x: 0, y: 3.5, "text-anchor": "middle" }, f);
        t.textContent = folded.has(id) ? "+" : "\u2212";
        if (folded.has(id)) {
          const c = el("text", { class: "foldtext", x: 11, y: 3.5 }, f);
          c.textContent = `${hidden} below`;
        }
        const ft = el("title", {}, f);
        ft.textContent = (folded.has(id) ? "Open" : "Fold") + ` the ${hidden} nodes below n${n.n}`;
      }
    }
    info.textContent = `showing ${shown} of ${nodes.length} nodes` + (shown < nodes.length ? ` (${nodes.length - shown} folded)` : "") +
      ` \u00b7 zoom ${Math.round(k * 100)}%`;
  }

  let k = 1, tx = 20, ty = 20;
  function apply() {
    view.setAttribute("transform", `translate(${tx},${ty}) scale(${k})`);
    svg.classList.toggle("far", k < 0.35);
    info.textContent = info.textContent.replace(/zoom \d+%/, `zoom ${Math.round(k * 100)}%`);
    save();
  }
  // A running study's page redraws the tree as it grows: the view and the folds outlive a redraw.
  function save() {
    const state = { k, tx, ty, hit, opened: [...opened], closed: [...closed], q: search.value };
    try { sessionStorage.setItem(DATA.key, JSON.stringify(state)); } catch (e) { /* no storage */ }
  }
  function restore() {  // the viewer's choices over the default folds, which a grown tree recomputes
    let s;
    try { s = JSON.parse(sessionStorage.getItem(DATA.key) || "null"); } catch (e) { return false; }
    if (!s || typeof s.k !== "number" || !Array.isArray(s.opened) || !Array.isArray(s.closed)) return false;
    for (const id of s.opened) if (byId.has(id)) { opened.add(id); folded.delete(id); }
    for (const id of s.closed) if (size.get(id)) { closed.add(id); folded.add(id); }
    hit = byId.has(s.hit) ? s.hit : null;
    k = s.k; tx = s.tx; ty = s.ty;
    search.value = typeof s.q === "string" ? s.q : "";
    return true;
  }

  function zoomAt(factor, cx, cy) {
    const nk = Math.max(0.02, Math.min(4, k * factor));
    tx = cx - (cx - tx) * (nk / k);
    ty = cy - (cy - ty) * (nk / k);
    k = nk;
    apply();
  }
  function fit() {
    const w = svg.clientWidth || 800, h = svg.clientHeight || 500;
    let maxX = 0;
    for (const [x] of pos.values()) maxX = Math.max(maxX, x);
    const tw = maxX + W + 60, th = Math.max(1, rows) * ROW;
    k = Math.max(0.02, Math.min(1.2, (w - 40) / tw, (h - 40) / th));
    tx = 20;
    ty = Math.max(20, (h - th * k) / 2);
    apply();
  }
  function centre(id, scale) {
    if (!pos.has(id)) return;
    const [x, y] = pos.get(id);
    const w = svg.clientWidth || 800, h = svg.clientHeight || 500;
    if (scale) k = scale;
    tx = w / 2 - (x + W / 2) * k;
    ty = h / 2 - (y + H / 2) * k;
    apply();
  }
  function reveal(id) {  // open every folded ancestor of id
    let cur = byId.get(id).p;
    while (cur !== null && byId.has(cur)) { folded.delete(cur); opened.add(cur); closed.delete(cur); cur = byId.get(cur).p; }
  }

  svg.addEventListener("wheel", (e) => {
    e.preventDefault();
    const r = svg.getBoundingClientRect();
    zoomAt(Math.exp(-e.deltaY * 0.0015), e.clientX - r.left, e.clientY - r.top);
  }, { passive: false });
  let drag = null;
  svg.addEventListener("pointerdown", (e) => {
    if (e.target.closest && (e.target.closest("a") || e.target.closest(".foldbox"))) return;
    drag = [e.clientX, e.clientY, tx, ty];
    svg.classList.add("dragging");
    svg.setPointerCapture(e.pointerId);
  });
  svg.addEventListener("pointermove", (e) => {
    if (!drag) return;
    tx = drag[2] + e.clientX - drag[0];
    ty = drag[3] + e.clientY - drag[1];
    apply();
  });
  const stop = () => { drag = null; svg.classList.remove("dragging"); };
  svg.addEventListener("pointerup", stop);
  svg.addEventListener("pointercancel", stop);
  svg.addEventListener("click", (e) => {
    const f = e.target.closest && e.target.closest(".foldbox");
    if (!f) return;
    const id = Number(f.getAttribute("data-fold"));
    if (folded.has(id)) { folded.delete(id); opened.add(id); closed.delete(id); } else { folded.add(id); closed.add(id); opened.delete(id); }
    const before = pos.get(id);
    draw();
    const after = pos.get(id);
    ty += (before[1] - after[1]) * k;  // keep the clicked node where it was
    apply();
  });

  const search = document.getElementById("search");
  let matches = [], at = -1, asked = "";
  function find() {
    const q = search.value.trim().toLowerCase();
    if (!q) return;
    if (q !== asked) {
      asked = q;
      at = -1;
      const num = q.match(/^n?(\d+)$/);
      matches = num ? nodes.filter((n) => n.n === Number(num[1]))
                    : nodes.filter((n) => (n.t + " " + n.f).toLowerCase().includes(q));
    }
    if (!matches.length) { info.textContent = `no node matches \u201c${search.value.trim()}\u201d`; return; }
    at = (at + 1) % matches.length;
    hit = matches[at].id;
    reveal(hit);
    draw();
    centre(hit, Math.min(Math.max(k, 1.2), 1.6));  // readable, not blown up
    info.textContent = `n${matches[at].n}: match ${at + 1} of ${matches.length} \u00b7 ` + info.textContent;
  }
  search.addEventListener("keydown", (e) => { if (e.key === "Enter") find(); });
  document.getElementById("next").addEventListener("click", find);
  const mid = () => [(svg.clientWidth || 800) / 2, (svg.clientHeight || 500) / 2];
  document.getElementById("zin").addEventListener("click", () => zoomAt(1.4, ...mid()));
  document.getElementById("zout").addEventListener("click", () => zoomAt(1 / 1.4, ...mid()));
  document.getElementById("fit").addEventListener("click", fit);
  document.getElementById("best").addEventListener("click", () => { if (DATA.trunk !== null) { reveal(DATA.trunk); draw(); centre(DATA.trunk, Math.max(k, 1)); } });
  document.getElementById("unfold").addEventListener("click", () => { for (const id of folded) opened.add(id); folded.clear(); closed.clear(); draw(); fit(); });

  if (restore()) { draw(); apply(); } else {
    draw();
    fit();
    if (k < 0.5 && DATA.focus !== null && byId.has(DATA.focus)) centre(DATA.focus, 1);  // too small to read: open at trunk
  }
  window.groveTree = { find: (q) => { search.value = q; find(); }, state: () => ({ k, tx, ty, hit, shown: pos.size }) };
})();
