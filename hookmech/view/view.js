// hookmech view: draws the page from the JSON in #hookmech-data (hookmech/view/*.py collects it).
// Plain SVG (charts, heatmaps) and canvas (effective-attention maps); no library, no network.
"use strict";
(function () {
  const SVGNS = "http://www.w3.org/2000/svg";
  const TYPED = { f4: Float32Array, f8: Float64Array, u1: Uint8Array, u2: Uint16Array, i4: Int32Array };
  const ROLE_ORDER = ["key", "value", "query", "divider"];
  const ROLE_COLORS = { key: "#e8890c", value: "#2f6fd0", query: "#2c9a2c", divider: "#777" };
  const PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"];
  const POS_COLORS = { key: "#ff7f0e", value: "#1f77b4", query: "#2ca02c" };
  const HEATMAP_KEY = "Colour: attribution from blue (\u22121) through white (0) to red (+1); grey: undefined (p_clean = p_corrupt).";

  // -- small helpers -------------------------------------------------------------------------
  function unpack(packed) {
    let bytes;
    if (typeof Uint8Array.fromBase64 === "function") {
      bytes = Uint8Array.fromBase64(packed.b64); // native: about 10x faster than atob on large maps
    } else {
      const text = atob(packed.b64);
      bytes = new Uint8Array(text.length);
      for (let i = 0; i < text.length; i++) bytes[i] = text.charCodeAt(i);
    }
    return new TYPED[packed.dtype](bytes.buffer);
  }
  const cache = new Map();
  function unpacked(packed) { // decode each packed array once
    if (!cache.has(packed)) cache.set(packed, unpack(packed));
    return cache.get(packed);
  }
  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [name, value] of Object.entries(attrs || {})) {
      if (name === "text") node.textContent = value;
      else if (name.startsWith("on")) node.addEventListener(name.slice(2), value);
      else if (value !== null && value !== undefined) node.setAttribute(name, value);
    }
    for (const child of children) if (child !== null && child !== undefined) node.append(child);
    return node;
  }
  function sv(tag, attrs, ...children) {
    const node = document.createElementNS(SVGNS, tag);
    for (const [name, value] of Object.entries(attrs || {})) {
      if (name === "text") node.textContent = value;
      else if (name.startsWith("on")) node.addEventListener(name.slice(2), value);
      else if (value !== null && value !== undefined) node.setAttribute(name, value);
    }
    for (const child of children) if (child !== null && child !== undefined) node.append(child);
    return node;
  }
  function titled(node, text) { node.append(sv("title", { text })); return node; }
  function fmt(value, digits = 3) {
    if (value === null || value === undefined || Number.isNaN(value)) return "\u2013";
    if (typeof value === "boolean") return value ? "yes" : "no";
    if (typeof value !== "number") return String(value);
    if (Number.isInteger(value)) return String(value);
    if (value !== 0 && Math.abs(value) < 0.01) return value.toPrecision(digits);
    return value.toFixed(digits);
  }
  function minOf(values, start = Infinity) { let m = start; for (const v of values) if (v < m) m = v; return m; }
  function maxOf(values, start = -Infinity) { let m = start; for (const v of values) if (v > m) m = v; return m; }
  function section(title, ...children) {
    return el("section", {}, el("h2", { text: title }), ...children);
  }
  const tip = document.getElementById("tip");
  function showTip(event, text) {
    tip.textContent = text;
    tip.hidden = false;
    const x = Math.min(event.clientX + 14, window.innerWidth - tip.offsetWidth - 4);
    const y = Math.min(event.clientY + 14, window.innerHeight - tip.offsetHeight - 4);
    tip.style.left = x + "px";
    tip.style.top = y + "px";
  }
  function hideTip() { tip.hidden = true; }

  // colors: diverging blue-white-red on [-1, 1], sequential white-blue on [0, 1]
  function mix(a, b, t) { return a.map((v, i) => Math.round(v + (b[i] - v) * t)); }
  const BLUE = [33, 102, 172], WHITE = [247, 247, 247], RED = [178, 24, 43], DARK = [8, 48, 107];
  function diverging(value) {
    const v = Math.max(-1, Math.min(1, value));
    return v < 0 ? mix(WHITE, BLUE, -v) : mix(WHITE, RED, v);
  }
  function sequential(value) { return mix(WHITE, DARK, Math.max(0, Math.min(1, value))); }
  function rgb(c) { return `rgb(${c[0]},${c[1]},${c[2]})`; }
  // colour tables for the maps (a colour per pixel would allocate 842,724 arrays for a 918-token map)
  const LUT_SEQUENTIAL = Array.from({ length: 256 }, (_, i) => sequential(i / 255));
  const LUT_DIVERGING = Array.from({ length: 256 }, (_, i) => diverging(i / 127.5 - 1));
  const packed = (c) => ((255 << 24) | (c[2] << 16) | (c[1] << 8) | c[0]) >>> 0;
  const LUT32_SEQUENTIAL = Uint32Array.from(LUT_SEQUENTIAL, packed);
  const LUT32_DIVERGING = Uint32Array.from(LUT_DIVERGING, packed);
  function lutIndex(value, signed) {
    const index = Math.round(signed ? (value + 1) * 127.5 : value * 255);
    return index < 0 ? 0 : index > 255 ? 255 : index;
  }

  // -- charts (SVG) --------------------------------------------------------------------------
  function niceTicks(low, high, count = 5) {
    if (!(high > low)) return [low];
    const step0 = (high - low) / count;
    const power = Math.pow(10, Math.floor(Math.log10(step0)));
    const step = [1, 2, 5, 10].map((m) => m * power).find((s) => s >= step0);
    const ticks = [];
    for (let v = Math.ceil(low / step) * step; v <= high + step * 1e-9; v += step) ticks.push(Math.abs(v) < step * 1e-9 ? 0 : v);
    return ticks;
  }
  function logTicks(low, high, base, values) {
    const distinct = [...new Set(values)].sort((a, b) => a - b);
    if (distinct.length && distinct.length <= 8) return distinct;
    const ticks = [];
    for (let e = Math.floor(Math.log(low) / Math.log(base)); Math.pow(base, e) <= high * 1.0001; e++) {
      if (Math.pow(base, e) >= low * 0.9999) ticks.push(Math.pow(base, e));
    }
    return ticks;
  }
  function tickLabel(v) {
    if (v === 0) return "0";
    if (Math.abs(v) >= 1e4 || Math.abs(v) < 1e-2) return v.toExponential(0).replace("e+", "e");
    return String(Math.round(v * 1e6) / 1e6);
  }

  // chart({title, xlabel, ylabel, xlog (base), ylog, ylim, yticks: [[value, label]] (named ticks
  // instead of numbers), width, height, series: [{name, color, points: [{x, y, lo, hi, tip}], line,
  // band, bars, marker, dash}], extra(svg, sx, sy)})
  function chart(spec) {
    const width = spec.width || 460, height = spec.height || 300;
    const margin = { left: 58, right: spec.legendRight === false ? 12 : spec.legendWidth || 150, top: spec.title ? 26 : 10, bottom: 42 };
    const all = spec.series.flatMap((s) => s.points).filter((p) => p.x !== null && p.y !== null && p.y !== undefined);
    const fx = spec.xlog ? (v) => Math.log(v) : (v) => v;
    const fy = spec.ylog ? (v) => Math.log(v) : (v) => v;
    const xs = all.map((p) => p.x), ys = all.flatMap((p) => [p.y, p.lo, p.hi].filter((v) => v !== null && v !== undefined));
    let [x0, x1] = xs.length ? [minOf(xs), maxOf(xs)] : [0, 1];
    let [y0, y1] = spec.ylim || (ys.length ? [minOf(ys), maxOf(ys)] : [0, 1]);
    if (spec.xlim) [x0, x1] = spec.xlim;
    if (fx(x1) - fx(x0) <= 0) { x0 = spec.xlog ? x0 / 2 : x0 - 1; x1 = spec.xlog ? x1 * 2 : x1 + 1; }
    if (fy(y1) - fy(y0) <= 0) { y0 = spec.ylog ? y0 / 2 : y0 - 0.5; y1 = spec.ylog ? y1 * 2 : y1 + 0.5; }
    const padX = (fx(x1) - fx(x0)) * 0.05;
    const X0 = fx(x0) - padX, X1 = fx(x1) + padX;
    const padY = spec.ylim ? 0 : (fy(y1) - fy(y0)) * 0.05;
    const Y0 = fy(y0) - padY, Y1 = fy(y1) + padY;
    const plotW = width - margin.left - margin.right, plotH = height - margin.top - margin.bottom;
    const sx = (v) => margin.left + ((fx(v) - X0) / (X1 - X0)) * plotW;
    const sy = (v) => margin.top + plotH - ((fy(v) - Y0) / (Y1 - Y0)) * plotH;
    const svg = sv("svg", { width, height, viewBox: `0 0 ${width} ${height}` });
    if (spec.title) svg.append(sv("text", { x: margin.left, y: 16, class: "title", text: spec.title }));
    const xt = spec.xlog ? logTicks(x0, x1, spec.xlog, xs) : niceTicks(x0, x1);
    const yt = spec.yticks ? spec.yticks.map(([v]) => v) : spec.ylog ? logTicks(Math.exp(Y0), Math.exp(Y1), 10, []) : niceTicks(spec.ylim ? y0 : Y0, spec.ylim ? y1 : Y1);
    const ylabelOf = spec.yticks ? new Map(spec.yticks) : null;
    for (const v of xt) {
      svg.append(sv("line", { x1: sx(v), x2: sx(v), y1: margin.top, y2: margin.top + plotH, class: "grid" }));
      svg.append(sv("text", { x: sx(v), y: margin.top + plotH + 14, "text-anchor": "middle", text: tickLabel(v) }));
    }
    for (const v of yt) {
      svg.append(sv("line", { x1: margin.left, x2: margin.left + plotW, y1: sy(v), y2: sy(v), class: "grid" }));
      svg.append(sv("text", { x: margin.left - 5, y: sy(v) + 4, "text-anchor": "end", class: "ytick", text: ylabelOf ? ylabelOf.get(v) : tickLabel(v) }));
    }
    svg.append(sv("rect", { x: margin.left, y: margin.top, width: plotW, height: plotH, fill: "none", class: "axis" }));
    svg.append(sv("text", { x: margin.left + plotW / 2, y: height - 6, "text-anchor": "middle", text: spec.xlabel || "" }));
    svg.append(sv("text", { transform: `translate(13 ${margin.top + plotH / 2}) rotate(-90)`, "text-anchor": "middle", text: spec.ylabel || "" }));
    if (spec.extra) spec.extra(svg, sx, sy);
    spec.series.forEach((series, index) => {
      const group = sv("g", {});
      const points = series.points.filter((p) => p.x !== null && p.y !== null && p.y !== undefined);
      if (series.band && points.length) {
        const upper = points.map((p) => `${sx(p.x)},${sy(p.hi)}`);
        const lower = points.slice().reverse().map((p) => `${sx(p.x)},${sy(p.lo)}`);
        group.append(sv("polygon", { points: upper.concat(lower).join(" "), fill: series.color, opacity: 0.18 }));
      }
      if (series.line !== false && points.length > 1) {
        const d = points.map((p, i) => `${i ? "L" : "M"}${sx(p.x)},${sy(p.y)}`).join("");
        group.append(sv("path", { d, fill: "none", stroke: series.color, "stroke-width": 1.8, "stroke-dasharray": series.dash || null }));
      }
      for (const p of points) {
        if (series.errorbars && p.lo !== null && p.lo !== undefined) {
          group.append(sv("line", { x1: sx(p.x), x2: sx(p.x), y1: sy(p.lo), y2: sy(p.hi), stroke: series.color, "stroke-width": 1.2 }));
        }
        if (series.marker !== false) {
          const dot = sv("circle", { cx: sx(p.x), cy: sy(p.y), r: series.radius || 3.5, fill: series.color, opacity: series.opacity || 1 });
          if (p.tip) titled(dot, p.tip);
          if (p.onclick) { dot.style.cursor = "pointer"; dot.addEventListener("click", p.onclick); }
          group.append(dot);
        }
      }
      svg.append(group);
      if (spec.legendRight !== false) {
        const y = margin.top + 8 + index * 16;
        const item = sv("g", { class: "legend" },
          sv("rect", { x: width - margin.right + 10, y: y - 8, width: 10, height: 10, fill: series.color }),
          sv("text", { x: width - margin.right + 25, y: y + 1, text: series.name }));
        item.addEventListener("click", () => {
          const off = group.style.display === "none";
          group.style.display = off ? "" : "none";
          item.classList.toggle("off", !off);
        });
        svg.append(item);
      }
    });
    return svg;
  }

  // grouped bars with whiskers: groups [{label, bars: [{name, value, lo, hi, color, tip}]}]
  function barChart(spec) {
    const groups = spec.groups, names = spec.names;
    const width = Math.max(560, 110 * groups.length + 200), height = 320;
    const margin = { left: 58, right: 110, top: 26, bottom: 52 };
    const plotW = width - margin.left - margin.right, plotH = height - margin.top - margin.bottom;
    const values = groups.flatMap((g) => g.bars.flatMap((b) => [b.value, b.lo, b.hi])).filter((v) => v !== null && v !== undefined);
    const low = minOf(values, 0), high = maxOf(values, 1);
    const sy = (v) => margin.top + plotH - ((v - low) / (high - low)) * plotH;
    const svg = sv("svg", { width, height });
    svg.append(sv("text", { x: margin.left, y: 16, class: "title", text: spec.title }));
    for (const v of niceTicks(low, high)) {
      svg.append(sv("line", { x1: margin.left, x2: margin.left + plotW, y1: sy(v), y2: sy(v), class: "grid" }));
      svg.append(sv("text", { x: margin.left - 5, y: sy(v) + 4, "text-anchor": "end", text: tickLabel(v) }));
    }
    svg.append(sv("line", { x1: margin.left, x2: margin.left + plotW, y1: sy(0), y2: sy(0), stroke: "#000" }));
    const slot = plotW / groups.length, barW = (slot * 0.8) / names.length;
    groups.forEach((group, gi) => {
      const x0 = margin.left + gi * slot + slot * 0.1;
      group.bars.forEach((bar, bi) => {
        const x = x0 + bi * barW;
        if (bar.value === null || bar.value === undefined) return;
        const rect = sv("rect", { x, width: barW - 2, y: Math.min(sy(0), sy(bar.value)), height: Math.abs(sy(0) - sy(bar.value)), fill: bar.color });
        svg.append(titled(rect, bar.tip));
        if (bar.lo !== null && bar.lo !== undefined) {
          const cx = x + (barW - 2) / 2;
          svg.append(sv("line", { x1: cx, x2: cx, y1: sy(bar.lo), y2: sy(bar.hi), stroke: "#222" }));
          svg.append(sv("line", { x1: cx - 3, x2: cx + 3, y1: sy(bar.lo), y2: sy(bar.lo), stroke: "#222" }));
          svg.append(sv("line", { x1: cx - 3, x2: cx + 3, y1: sy(bar.hi), y2: sy(bar.hi), stroke: "#222" }));
        }
      });
      svg.append(sv("text", { x: margin.left + gi * slot + slot / 2, y: margin.top + plotH + 16, "text-anchor": "middle", text: group.label }));
      svg.append(sv("text", { x: margin.left + gi * slot + slot / 2, y: margin.top + plotH + 30, "text-anchor": "middle", text: group.sublabel || "" }));
    });
    names.forEach((name, i) => {
      svg.append(sv("rect", { x: width - margin.right + 12, y: margin.top + i * 16, width: 10, height: 10, fill: spec.colors[name] }));
      svg.append(sv("text", { x: width - margin.right + 27, y: margin.top + i * 16 + 9, text: name }));
    });
    svg.append(sv("text", { transform: `translate(13 ${margin.top + plotH / 2}) rotate(-90)`, "text-anchor": "middle", text: spec.ylabel }));
    return svg;
  }

  // site x position attribution heatmap (SVG): records in site-major order; onClick(index) when given
  function heatmap(records, onClick) {
    const sites = [...new Set(records.map((r) => r.site))];
    const positions = [...new Set(records.map((r) => r.pos))];
    const cellW = positions.length > 40 ? Math.max(4, Math.floor(900 / positions.length)) : 64, cellH = 22;
    const left = 12 + 7 * Math.max(...sites.map((s) => s.length)), top = 30;
    const width = left + cellW * positions.length + 20, height = top + cellH * sites.length + 10;
    const svg = sv("svg", { width, height, class: "heatmap" });
    positions.forEach((pos, j) => {
      if (cellW >= 30 || j % Math.ceil(30 / cellW) === 0) {
        svg.append(sv("text", { x: left + j * cellW + cellW / 2, y: top - 8, "text-anchor": "middle", text: pos }));
      }
    });
    sites.forEach((site, i) => svg.append(sv("text", { x: left - 6, y: top + i * cellH + cellH / 2 + 4, "text-anchor": "end", text: site })));
    const cells = [];
    records.forEach((record, index) => {
      const i = sites.indexOf(record.site), j = positions.indexOf(record.pos);
      const value = record.attribution;
      const fill = value === null ? "#ddd" : rgb(diverging(value));
      const rect = sv("rect", {
        x: left + j * cellW, y: top + i * cellH, width: cellW, height: cellH, fill, class: "cell",
        "data-site": record.site, "data-pos": record.pos, "data-index": index,
      });
      titled(rect, `${record.site} @ ${record.pos}\nattribution ${fmt(record.attribution)}\np_clean ${fmt(record.p_clean)}  p_corrupt ${fmt(record.p_corrupt)}  p_patched ${fmt(record.p_patched)}\nn ${record.n}, passes filter: ${fmt(record.passes_filter)}`);
      if (onClick) rect.addEventListener("click", () => { cells.forEach((c) => c.classList.remove("selected")); rect.classList.add("selected"); onClick(index); });
      else rect.style.cursor = "default";
      cells.push(rect);
      svg.append(rect);
      if (cellW >= 30 && value !== null) {
        svg.append(sv("text", { x: left + j * cellW + cellW / 2, y: top + i * cellH + cellH / 2 + 4, "text-anchor": "middle", class: "cellvalue", fill: Math.abs(value) > 0.6 ? "#fff" : "#111", style: `fill:${Math.abs(value) > 0.6 ? "#fff" : "#111"}`, text: value.toFixed(2) }));
      }
    });
    return { svg, cells };
  }

  // -- the checkpoint page -------------------------------------------------------------------
  function renderCheckpoint(D, page) {
    const rows = D.rows, vocab = D.vocab, N = rows.n, T = rows.pos;
    const tokens = unpacked(rows.tokens), corrupt = unpacked(rows.corrupt_tokens);
    const pClean = unpacked(rows.p_clean), pCorrupt = unpacked(rows.p_corrupt);
    const roles = Object.keys(rows.roles).sort((a, b) => ROLE_ORDER.indexOf(a) - ROLE_ORDER.indexOf(b));
    const about = D.about || {};
    document.getElementById("about").textContent = [
      about.source ? `source ${about.source}` : null,
      `model: ${D.model.n_layers} layers (${D.model.mixers.join(", ")}), d_model ${D.model.d_model}`,
      `task: ${Object.entries(D.task).map(([k, v]) => `${k}=${v}`).join(", ")}`,
      `${N} examples` + (about.seed !== undefined && about.seed !== null ? ` (seed ${about.seed})` : ""),
    ].filter(Boolean).join(" \u00b7 ");

    function rowRoles(r) {
      const marks = {};
      for (const role of roles) {
        const p = rows.roles[role][r];
        (marks[p] = marks[p] || []).push(role);
      }
      return marks;
    }
    function tokenLine(r) { // the row's tokens in the task's names, roles marked; long rows: windows around the roles
      const length = rows.lengths[r], marks = rowRoles(r), box = el("div", { class: "tokens" });
      let shown = null;
      if (length > 80) {
        shown = new Set([0]);
        for (const p of Object.keys(marks)) for (let q = +p - 6; q <= +p + 6; q++) if (q >= 0 && q < length) shown.add(q);
      }
      let gap = false;
      for (let p = 0; p < length; p++) {
        if (shown && !shown.has(p)) { if (!gap) box.append(el("span", { class: "gap", text: " \u2026 " })); gap = true; continue; }
        gap = false;
        const clean = tokens[r * T + p], dirty = corrupt[r * T + p];
        const roleNames = marks[p] || [];
        const span = el("span", { class: ["tok", ...roleNames, clean !== dirty ? "changed" : ""].join(" ").trim(), title: `position ${p}${roleNames.length ? " (" + roleNames.join(", ") + ")" : ""}${clean !== dirty ? `: corrupt run has ${vocab[dirty]}` : ""}` },
          clean !== dirty ? `${vocab[clean]}\u2192${vocab[dirty]}` : vocab[clean]);
        if (roleNames.length) span.append(el("sup", { text: roleNames.join("+") }));
        box.append(span, " ");
      }
      box.append(el("span", { text: `\u21d2 answer ${vocab[rows.answers[r]]}` }));
      return box;
    }

    // attribution heatmap and drill-down
    const drill = el("div", { id: "drill" });
    const { svg, cells } = heatmap(D.records, showCell);
    page.append(section("Attribution: site \u00d7 position",
      el("p", { class: "note", text: "Interchange interventions: the corrupt run with one site at one position restored from the clean run; attribution = (p_patched \u2212 p_corrupt) / (p_clean \u2212 p_corrupt), means over the examples (the numbers of hookmech patch --json). Click a cell for its examples." }),
      el("div", { class: "scroll" }, svg), el("p", { class: "note", text: HEATMAP_KEY }), drill));

    function exampleTable(indices, title, p) {
      const table = el("table", { "data-list": title },
        el("tr", {}, ...["row", "p_clean", "p_corrupt", "p_patched", "effect", "tokens (clean\u2192corrupt marked)"].map((h) => el("th", { text: h }))));
      for (const r of indices) {
        const link = D.maps.examples && D.maps.examples.includes(r)
          ? el("a", { class: "row-link", text: String(r), title: "show its effective attention", onclick: () => showMaps(r) })
          : el("span", { text: String(r) });
        table.append(el("tr", { "data-row": r }, el("td", {}, link),
          el("td", { class: "num", text: fmt(pClean[r]) }), el("td", { class: "num", text: fmt(pCorrupt[r]) }),
          el("td", { class: "num", text: fmt(p[r]) }), el("td", { class: "num", text: fmt(p[r] - pCorrupt[r]) }),
          el("td", {}, tokenLine(r))));
      }
      return el("div", {}, el("h3", { text: title }), table);
    }

    function showCell(index) {
      const record = D.records[index], cell = D.cells[index], p = unpacked(cell.p_patched);
      drill.replaceChildren();
      drill.dataset.site = record.site;
      drill.dataset.pos = record.pos;
      const fields = ["attribution", "p_clean", "p_corrupt", "p_patched", "n", "passes_filter"];
      const table = el("table", { class: "means" }, el("tr", {}, ...fields.map((f) => el("th", { text: f }))),
        el("tr", {}, ...fields.map((f) => el("td", { class: "num", "data-field": f, "data-exact": JSON.stringify(record[f]), text: fmt(record[f], 4) }))));
      const strips = [["p_clean", pClean, "#555"], ["p_corrupt", pCorrupt, "#c2553a"], ["p_patched", p, "#2f6fd0"]];
      const series = strips.map(([name, values, color], k) => ({
        name: `${name} (mean ${fmt(record[name], 4)})`, color, line: false, radius: 2.6, opacity: 0.55,
        points: Array.from(values, (v, r) => ({ x: v, y: k + 0.7 * ((((r * 2654435761) >>> 0) % 1000) / 1000 - 0.5), tip: `row ${r}: ${name} ${fmt(v, 4)}`, onclick: D.maps.examples && D.maps.examples.includes(r) ? () => showMaps(r) : null })),
      }));
      const strip = chart({
        title: `${record.site} @ ${record.pos}: p(answer) per example (${N} rows)`, xlabel: "p(answer)", ylabel: "",
        series, ylim: [-0.6, 2.6], yticks: [[0, "clean"], [1, "corrupt"], [2, "patched"]], xlim: [minOf(p, 0), maxOf(p, 1)], width: 760, height: 210, legendWidth: 230,
        extra: (svg, sx, sy) => strips.forEach(([name, , color], k) => {
          svg.append(sv("line", { x1: sx(record[name]), x2: sx(record[name]), y1: sy(k - 0.45), y2: sy(k + 0.45), stroke: color, "stroke-width": 2.5 }));
        }),
      });
      strip.classList.add("strip");
      drill.append(el("h3", { text: `${record.site} (${record.hook}) at ${record.pos}` }), table, strip,
        el("p", { class: "note", text: "Effect of a row = its p_patched \u2212 p_corrupt. Bars in the strips: the means. Underlined rows have their effective attention below." }),
        el("div", { class: "row" }, exampleTable(cell.largest, "largest effect", p), exampleTable(cell.smallest, "smallest effect", p)));
    }

    // effective attention
    mark("heatmap");
    const mapsSection = section("Effective attention");
    page.append(mapsSection);
    let showMaps = () => {};
    if (D.maps.error) {
      mapsSection.append(el("p", { class: "error", text: D.maps.error }));
    } else {
      const M = D.maps;
      const exampleSelect = el("select", { id: "map-example" }, ...M.examples.map((r, i) => el("option", { value: i, text: `row ${r} (${rows.lengths[r]} tokens)` })));
      const holder = el("div", {});
      mapsSection.append(
        el("p", { class: "note", text: "Each layer's sequence mixing as a matrix M[query, key] on the example's clean tokens (hookmech.attention_maps): per head, or the channel mean of per-channel mixers" + (M.channels ? " (every channel: choose it)" : "") + ". Hover for values; ticks mark the roles." }),
        el("label", { text: "example " }, exampleSelect), holder);
      const drawExample = () => {
        const i = +exampleSelect.value, r = M.examples[i];
        holder.replaceChildren(tokenLine(r));
        M.layers.forEach((layer, l) => holder.append(mapPanel(layer, i, r, l)));
      };
      exampleSelect.addEventListener("change", drawExample);
      showMaps = (r) => { exampleSelect.value = M.examples.indexOf(r); drawExample(); mapsSection.scrollIntoView(); };
      drawExample();
    }

    function mapPanel(layer, i, r, l) {
      const length = rows.lengths[r], size = (length * (length + 1)) / 2;
      const options = [];
      for (let h = 0; h < layer.n; h++) options.push({ label: layer.axis === "head" ? `head ${h}` : "channel mean", get: () => unpacked(D.maps.values[i][l]).subarray(h * size, (h + 1) * size) });
      for (let c = 0; c < layer.channels; c++) options.push({ label: `channel ${c}`, get: () => unpacked(D.maps.channels[i][l]).subarray(c * size, (c + 1) * size) });
      const select = el("select", {}, ...options.map((o, k) => el("option", { value: k, text: o.label })));
      const canvasBox = el("div", { class: "scroll" });
      const box = el("div", { class: "mapbox", "data-layer": layer.layer },
        el("h3", { text: `layer ${layer.layer}: ${layer.mixer}` }), options.length > 1 ? select : null, canvasBox);
      const draw = () => canvasBox.replaceChildren(mapCanvas(options[+select.value].get(), length, r, `layer ${layer.layer} ${options[+select.value].label}`));
      select.addEventListener("change", draw);
      draw();
      return box;
    }

    function mapCanvas(values, length, r, label) {
      const cell = Math.max(1, Math.min(22, Math.floor(560 / length)));
      const names = Array.from({ length }, (_, p) => vocab[tokens[r * T + p]]);
      const labelled = cell >= 9;
      const margin = labelled ? 8 + 6 * Math.max(...names.map((n) => n.length)) : 34;
      const side = length * cell;
      const canvas = el("canvas", { width: margin + side + 4, height: margin + side + 4 });
      const ctx = canvas.getContext("2d");
      let peak = 0, negative = false;
      for (const v of values) { peak = Math.max(peak, Math.abs(v)); if (v < 0) negative = true; }
      peak = peak || 1;
      const image = ctx.createImageData(side, side);
      const pixels = new Uint32Array(image.data.buffer); // one RGBA pixel per element (little-endian: ABGR)
      pixels.fill(0xffffffff); // above the diagonal: white
      const lut = negative ? LUT32_DIVERGING : LUT32_SEQUENTIAL;
      for (let t = 0; t < length; t++) {
        const base = (t * (t + 1)) / 2;
        for (let s = 0; s <= t; s++) {
          const color = lut[lutIndex(values[base + s] / peak, negative)];
          if (cell === 1) { pixels[t * side + s] = color; continue; }
          for (let dy = 0; dy < cell; dy++) pixels.fill(color, (t * cell + dy) * side + s * cell, (t * cell + dy) * side + (s + 1) * cell);
        }
      }
      ctx.putImageData(image, margin, margin);
      ctx.fillStyle = "#333";
      ctx.font = "10px monospace";
      const marks = rowRoles(r);
      for (let p = 0; p < length; p++) {
        const center = margin + p * cell + cell / 2;
        const role = (marks[p] || [])[0];
        if (labelled) {
          ctx.fillStyle = role ? ROLE_COLORS[role] : "#333";
          ctx.textAlign = "right";
          ctx.fillText(names[p], margin - 3, center + 3);
          ctx.save(); ctx.translate(center + 3, margin - 3); ctx.rotate(-Math.PI / 2); ctx.textAlign = "left"; ctx.fillText(names[p], 0, 0); ctx.restore();
        } else if (role) {
          ctx.fillStyle = ROLE_COLORS[role];
          ctx.fillRect(margin - 6, margin + p * cell, 5, Math.max(2, cell));
          ctx.fillRect(margin + p * cell, margin - 6, Math.max(2, cell), 5);
        }
      }
      canvas.addEventListener("mousemove", (event) => {
        const box = canvas.getBoundingClientRect();
        const t = Math.floor((event.clientY - box.top - margin) / cell), s = Math.floor((event.clientX - box.left - margin) / cell);
        if (t < 0 || s < 0 || t >= length || s >= length) { hideTip(); return; }
        const value = s > t ? 0 : values[(t * (t + 1)) / 2 + s];
        const roleOf = (p) => (marks[p] ? ` (${marks[p].join(", ")})` : "");
        showTip(event, `${label}\nquery ${t} ${names[t]}${roleOf(t)} \u2190 key ${s} ${names[s]}${roleOf(s)}\nM = ${value.toPrecision(4)}`);
      });
      canvas.addEventListener("mouseleave", hideTip);
      return el("div", {}, canvas, el("div", { class: "note", text: `${negative ? "blue negative, red positive" : "white 0, dark blue"} up to |M| = ${peak.toPrecision(3)}` }));
    }

    // induction scores
    mark("maps");
    const induction = section("Induction scores");
    page.append(induction);
    if (D.induction.error) induction.append(el("p", { class: "error", text: D.induction.error }));
    else {
      const I = D.induction, U = I.uniform;
      const scoreCell = (score) => el("td", { class: "num" }, el("span", { class: "bar" + (score < 0 ? " neg" : ""), style: `width:${Math.round(Math.min(1, Math.abs(score)) * 120)}px` }), " ", fmt(score, 4));
      const head = (layer, h) => (layer.per_channel ? "channel mean" : `head ${h}`);
      induction.append(el("p", { class: "note", text: `On the first ${I.n} examples, the mean weight of each layer's M (the effective attention) from the query on the value of its pair (query \u2192 value: an induction head reads the answer where its key was stored) and from the value on its key (value \u2192 key: the previous-token step that stores the key at the value; where the value comes first, the key on its value). Induction is value \u2192 key high in an earlier layer and query \u2192 value high in a later one. Uniform causal attention would score ${fmt(U["query->value"], 3)} and ${fmt(U["value->key"], 3)} on these rows (uniform over a window of w tokens: 1/w). Per-channel mixers: the channel mean of M, which can be negative.` }));
      const table = el("table", { id: "induction" }, el("tr", {}, el("th", { text: "layer" }), el("th", { text: "mixer" }), el("th", { text: "head / channel mean" }),
        ...I.names.map((name) => el("th", { text: name.replace("->", " \u2192 ") }))));
      for (const layer of I.layers) {
        layer.scores[I.names[0]].forEach((_, h) => table.append(el("tr", {},
          el("td", { text: String(layer.layer) }), el("td", { text: layer.mixer }), el("td", { text: head(layer, h) }),
          ...I.names.map((name) => scoreCell(layer.scores[name][h])))));
      }
      induction.append(table);
      if (I.random_repeat) {
        const R = I.random_repeat;
        induction.append(el("h3", { text: "Prefix matching on random repeated tokens (out of the task's distribution)" }),
          el("p", { class: "note", text: `Olsson et al. (2022): on ${R.rows} random sequences of ${R.seq_len} distinct tokens repeated twice, the mean weight of M from each token of the second half to the token after its previous occurrence; 1: a perfect induction head. A model trained on a task never saw such sequences: a low score here does not contradict induction on the task's documents above.` }));
        const random = el("table", { id: "induction-random-repeat" }, el("tr", {}, el("th", { text: "layer" }), el("th", { text: "mixer" }), el("th", { text: "head / channel mean" }), el("th", { text: "prefix matching" })));
        for (const layer of R.layers) {
          layer.scores.forEach((score, h) => random.append(el("tr", {},
            el("td", { text: String(layer.layer) }), el("td", { text: layer.mixer }), el("td", { text: head(layer, h) }), scoreCell(score))));
        }
        induction.append(random);
      }
    }

    // start with the strongest cell that passes the filter
    let first = 0, best = -Infinity;
    D.records.forEach((record, index) => {
      const score = record.attribution === null ? -Infinity : Math.abs(record.attribution) + (record.passes_filter ? 1e6 : 0);
      if (score > best) { best = score; first = index; }
    });
    if (D.records.length) { cells[first].classList.add("selected"); showCell(first); }
    mark("drill-down");
  }

  // -- the sweep page ------------------------------------------------------------------------
  const LAZY_RUNS = 12;

  function drawRun(box, run) {
    if (run.heatmap) box.append(el("div", { class: "scroll" }, heatmap(run.heatmap, null).svg), el("p", { class: "note", text: HEATMAP_KEY }));
    if (run.heatmap && run.weights) box.append(el("p", { class: "note weights", text: `Weights: ${run.weights}.` }));
    if (run.dynamics) {
      const dyn = run.dynamics, steps = dyn.step;
      const pts = (values) => steps.map((s, k) => ({ x: s, y: values[k], tip: `step ${s}: ${fmt(values[k], 4)}` })).filter((p) => p.y !== null);
      const names = Object.keys(dyn.attr);
      box.append(el("div", { class: "row" },
        chart({ title: "train loss", xlabel: "training step", ylabel: "loss", ylog: true, series: [{ name: "train loss", color: "#111", marker: false, points: pts(dyn.loss).filter((p) => p.y > 0) }], width: 400, height: 240 }),
        chart({ title: "dev accuracy", xlabel: "training step", ylabel: "", ylim: [-0.02, 1.02], series: [
          { name: "dev accuracy", color: "#d62728", marker: false, points: pts(dyn.dev_acc) },
          { name: "dev p(answer)", color: "#9467bd", marker: false, dash: "4 3", points: pts(dyn.dev_p_answer) }], width: 400, height: 240 }),
        chart({ title: "attributions", xlabel: "training step", ylabel: "attribution", series: names.map((n, k) => ({ name: n, color: PALETTE[k % PALETTE.length], radius: 2, points: pts(dyn.attr[n]) })), width: 460, height: 240 })));
    }
    if (run.no_heatmap) box.append(el("p", { class: "note missing", text: `No heatmap: ${run.no_heatmap}.` }));
    if (!run.heatmap && !run.no_heatmap && !run.dynamics) box.append(el("p", { class: "note", text: "no heatmap (--no-heatmaps) and no attributions in metrics.jsonl" }));
  }

  function renderSweep(D, page) {
    const about = D.about;
    document.getElementById("about").textContent = `${about.runs} runs in ${about.runs_dir} (${Object.entries(about.status).map(([k, v]) => `${v} ${k}`).join(", ")}); series: ${D.keys.filter((k) => !["d_model", "lr", "seed"].includes(k)).join(", ") || "\u2014"}`;
    const seriesNames = [...new Set(D.summary.map((e) => e.series).concat(D.bars.map((b) => b.series)))];
    const color = (name) => PALETTE[seriesNames.indexOf(name) % PALETTE.length];
    const summary = D.summary;

    // headline table
    const hasTest = summary.some((e) => e.test_acc !== undefined), hasAttr = summary.some((e) => e.n_pass !== undefined);
    const head = ["series", "d_model", "best lr", "dev acc (mean \u00b1 sd)"].concat(hasTest ? ["test acc"] : [], hasAttr ? ["attr value", "attr query", "attr key", "pass filter"] : []);
    const table = el("table", {}, el("tr", {}, ...head.map((h) => el("th", { text: h }))));
    for (const e of summary) {
      const cells = [e.series, fmt(e.d_model), fmt(e.lr), `${e.dev_acc.toFixed(3)} \u00b1 ${e.dev_sd.toFixed(3)} (n=${e.n_seeds})`];
      if (hasTest) cells.push(fmt(e.test_acc));
      if (hasAttr) cells.push(fmt(e.attr_value), fmt(e.attr_query), fmt(e.attr_key), `${e.n_pass || 0}/${e.n_seeds}`);
      table.append(el("tr", {}, ...cells.map((c) => el("td", { text: c }))));
    }
    page.append(section("Headline", el("p", { class: "note", text: `Best lr per (series, d_model) by mean dev accuracy over seeds.${D.site ? ` Attributions: ${D.site}, mean over the best-lr seeds passing the filter.` : ""}` }), table));

    // accuracy vs d_model
    const accuracy = section("Accuracy vs d_model");
    const withD = summary.filter((e) => e.d_model !== null && e.d_model !== undefined);
    if (!withD.length) accuracy.append(el("p", { class: "note", text: "The grid has no d_model: see the headline table." }));
    const accRow = el("div", { class: "row" });
    for (const [key, label] of [["dev", "dev"], ["test", "test (held-out pairs)"]]) {
      if (!withD.length || (key === "test" && !hasTest)) continue;
      const series = seriesNames.map((name) => ({
        name, color: color(name), errorbars: true,
        points: withD.filter((e) => e.series === name && e[`${key}_acc`] !== undefined).map((e) => ({
          x: e.d_model, y: e[`${key}_acc`], lo: e[`${key}_min`], hi: e[`${key}_max`],
          tip: `${name}, d_model ${e.d_model}: ${label} acc ${fmt(e[`${key}_acc`])} (min ${fmt(e[`${key}_min`])}, max ${fmt(e[`${key}_max`])}) at lr ${e.lr}, ${e.n_seeds} seeds`,
        })),
      })).filter((s) => s.points.length);
      accRow.append(chart({ title: `${label} accuracy at the best lr (mean, min\u2013max over seeds)`, xlabel: "d_model", ylabel: `${label} accuracy`, xlog: 2, ylim: [-0.02, 1.02], series }));
    }
    accuracy.append(accRow);
    page.append(accuracy);

    // lr sensitivity
    const lrSection = section("Learning-rate sensitivity");
    const dModels = [...new Set(D.lr_curves.map((c) => c.d_model))].sort((a, b) => (a || 0) - (b || 0));
    const lrRow = el("div", { class: "row" });
    for (const name of [...new Set(D.lr_curves.map((c) => c.series))]) {
      const series = D.lr_curves.filter((c) => c.series === name).map((c) => {
        const k = dModels.indexOf(c.d_model), shade = rgb(mix([68, 1, 84], [94, 201, 98], dModels.length > 1 ? k / (dModels.length - 1) : 0));
        return {
          name: `d_model ${c.d_model === null ? "\u2013" : c.d_model}`, color: shade, band: true,
          points: c.points.map((p) => ({ x: p.lr, y: p.mean, lo: p.min, hi: p.max, tip: `${name}, d_model ${c.d_model}, lr ${p.lr}: dev acc ${fmt(p.mean)} (min ${fmt(p.min)}, max ${fmt(p.max)}, ${p.n} seeds)` })),
        };
      });
      lrRow.append(chart({ title: name, xlabel: "learning rate", ylabel: "dev accuracy", xlog: 10, ylim: [-0.02, 1.02], series, width: 400, height: 270 }));
    }
    const lrNote = D.lr_curves.length ? "Dev accuracy against the learning rate: mean over seeds, band min\u2013max. Click a legend entry to hide it." : "results.csv has no lr: no learning-rate curves.";
    lrSection.append(el("p", { class: "note", text: lrNote }), lrRow);
    page.append(lrSection);

    if (D.site) {
      const mech = section(`Mechanisms (${D.site})`);
      const byName = seriesNames.map((name) => ({
        name: `${name} (${D.value_query.filter((p) => p.series === name).length} runs)`, color: color(name), line: false, opacity: 0.8,
        points: D.value_query.filter((p) => p.series === name).map((p) => ({ x: p.value, y: p.query, tip: `${p.run_id}\nd_model ${fmt(p.d_model)}, lr ${fmt(p.lr)}, seed ${fmt(p.seed)}\nvalue ${fmt(p.value)}, query ${fmt(p.query)}` })),
      }));
      const scatter = chart({
        title: "attribution at the value vs the query, runs passing the filter", xlabel: "value (induction)", ylabel: "query (direct retrieval)",
        series: byName, ylim: [minOf(D.value_query.map((p) => p.query), -0.1), maxOf(D.value_query.map((p) => p.query), 1.1)],
        xlim: [minOf(D.value_query.map((p) => p.value), -0.1), maxOf(D.value_query.map((p) => p.value), 1.1)], width: 560, height: 400, legendWidth: 190,
        extra: (svg, sx, sy) => svg.append(sv("line", { x1: sx(0), y1: sy(1), x2: sx(1), y2: sy(0), stroke: "#999", "stroke-dasharray": "3 3" })),
      });
      const positions = ["key", "value", "query"];
      const bars = barChart({
        title: "mean attribution by position, 95% bootstrap CI (runs passing the filter)", ylabel: `attribution at ${D.site}`,
        names: positions, colors: POS_COLORS,
        groups: D.bars.map((b) => ({
          label: b.series, sublabel: `n=${b.n}`,
          bars: positions.map((pos) => {
            const c = b.positions[pos];
            return { name: pos, value: c.mean, lo: c.low, hi: c.high, color: POS_COLORS[pos], tip: `${b.series} @ ${pos}: mean ${fmt(c.mean)}, 95% CI [${fmt(c.low)}, ${fmt(c.high)}], ${c.n} runs` };
          }),
        })),
      });
      mech.append(el("div", { class: "row" }, scatter, bars));
      page.append(mech);
    }

    // selected runs: heatmaps and dynamics
    const selected = section("Selected runs", el("p", { class: "note", text: `Runs: ${about.selection}. Heatmaps: every block-level site \u00d7 role on ${about.heatmap_examples} examples (seed ${about.heatmap_seed}); hover a cell for its numbers (per-example drill-down: hookmech view --ckpt). Dynamics: runs trained with --mech-every.` }));
    // many runs: each behind a <details> element, drawn when first opened (the page stays quick to load)
    const lazy = D.selected.length > LAZY_RUNS;
    if (lazy) selected.append(el("p", { class: "note", text: `${D.selected.length} runs: open one to draw it.` }));
    for (const run of D.selected) {
      const label = `${run.run_id}: ${run.series}, d_model ${fmt(run.d_model)}, lr ${fmt(run.lr)}, seed ${fmt(run.seed)} (dev acc ${fmt(run.dev_acc)})`;
      if (!lazy) {
        const box = el("div", { "data-run": run.run_id }, el("h3", { text: label }));
        drawRun(box, run);
        selected.append(box);
        continue;
      }
      const box = el("details", { "data-run": run.run_id }, el("summary", { text: label }));
      box.addEventListener("toggle", () => {
        if (box.open && !box.dataset.drawn) { box.dataset.drawn = "1"; drawRun(box, run); }
      });
      selected.append(box);
    }
    page.append(selected);
  }

  // -- the page of a patch --json file ----------------------------------------------------------
  function renderRecords(D, page) {
    const about = D.about;
    const axes = about.paths ? "sender \u00d7 receiver" : "site \u00d7 position";
    document.getElementById("about").textContent = `${about.records} records from ${about.source} (hookmech patch --json)`;
    const { svg } = heatmap(D.records, null);
    page.append(section(`Attribution: ${axes}`,
      el("p", { class: "note", text: "The records of the file; hover a cell for its numbers. Per-example drill-down needs the checkpoint: hookmech view --ckpt CKPT." }),
      el("div", { class: "scroll" }, svg), el("p", { class: "note", text: HEATMAP_KEY })));
    const place = about.paths ? ["sender", "receiver"] : ["site", "pos"];
    const head = [...place, "attribution", "p_clean", "p_corrupt", "p_patched", "n", "passes_filter", ...D.columns.filter((c) => !place.includes(c))];
    const table = el("table", { id: "records" }, el("tr", {}, ...head.map((h) => el("th", { text: h }))));
    for (const record of D.records) {
      const value = (field) => (about.paths && field === "receiver" ? record.pos : about.paths && field === "sender" ? record.site : record[field]);
      table.append(el("tr", {}, ...head.map((field) => el("td", { class: typeof value(field) === "number" ? "num" : null, text: fmt(value(field), 4) }))));
    }
    page.append(section("Records", table));
  }

  // milliseconds each part of drawing took (window.hookmechTimings; bench/view_pages.py prints them)
  const timings = {};
  let lastMark = performance.now();
  function mark(name) { const now = performance.now(); timings[name] = now - lastMark; lastMark = now; }

  function main() {
    const started = performance.now();
    const D = JSON.parse(document.getElementById("hookmech-data").textContent);
    mark("parse");
    const page = document.getElementById("page");
    page.replaceChildren();
    if (D.kind === "checkpoint") renderCheckpoint(D, page);
    else if (D.kind === "sweep") renderSweep(D, page);
    else if (D.kind === "records") renderRecords(D, page);
    else throw new Error(`unknown page kind ${D.kind}`);
    window.hookmechRenderMs = performance.now() - started;
    window.hookmechTimings = timings;
    window.hookmechReadyMs = performance.now();
    document.body.dataset.ready = "1";
  }

  try {
    main();
  } catch (error) {
    document.getElementById("page").replaceChildren(el("p", { class: "error", text: `hookmech view: the page failed to draw: ${error}` }));
    console.error("hookmech view:", error && error.stack ? error.stack : error);
  }
})();
