'use strict';
// grpoflow rollout explorer: a hash-routed single page over the JSON API of flows/viewing/ui.py.
//
// Security rule for this whole file: data from the API reaches the DOM only as text nodes or
// non-URL attributes, through el()/svg() below. URLs are fixed prefixes + encodeURIComponent.
// Nothing here uses innerHTML, insertAdjacentHTML, document.write, eval or Function.

const SVG_NS = 'http://www.w3.org/2000/svg';
const POLL_MS = 5000;
const PAGE_SIZE = 50;
const STATUSES = ['valid', 'invalid', 'failed', 'timeout'];
const STATUS_COLORS = {valid: '#16a34a', invalid: '#d97706', failed: '#dc2626', timeout: '#7c3aed'};
const PALETTE = ['#2563eb', '#dc2626', '#16a34a', '#9333ea', '#ea580c', '#0891b2', '#ca8a04', '#db2777',
  '#4b5563', '#65a30d'];
const KNOWN_BADGES = new Set([...STATUSES, 'running', 'completed', 'interrupted', 'unknown', 'promoted',
  'rejected', 'rollback', 'trained', 'dropped', 'truncated', 'yes', 'no']);
// Chart geometry in SVG user units; the SVG scales down with CSS (max-width: 100%).
const CH = {w: 440, h: 210, ml: 50, mr: 12, mt: 10, mb: 26};

// ---------------------------------------------------------------- DOM helpers

function append(node, children) {
  for (const c of children) {
    if (c === null || c === undefined || c === false) continue;
    if (Array.isArray(c)) append(node, c);
    else if (c instanceof Node) node.appendChild(c);
    else node.appendChild(document.createTextNode(String(c))); // strings are only ever text
  }
  return node;
}

function setAttrs(node, attrs) {
  for (const [k, v] of Object.entries(attrs || {})) {
    if (v === null || v === undefined || v === false) continue;
    if (k.startsWith('on') && typeof v === 'function') node.addEventListener(k.slice(2), v);
    else node.setAttribute(k, v === true ? '' : String(v));
  }
}

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  setAttrs(node, attrs);
  return append(node, children);
}

function svg(tag, attrs, ...children) {
  const node = document.createElementNS(SVG_NS, tag);
  setAttrs(node, attrs);
  return append(node, children);
}

const $ = (sel) => document.querySelector(sel);

function fmt(v, digits = 4) {
  if (v === null || v === undefined || (typeof v === 'number' && !Number.isFinite(v))) return '—';
  if (typeof v === 'boolean') return v ? 'true' : 'false';
  if (typeof v !== 'number') return typeof v === 'object' ? JSON.stringify(v) : String(v);
  if (Number.isInteger(v)) return String(v);
  const a = Math.abs(v);
  if (a < 1e-3 || a >= 1e6) return v.toExponential(2).replace(/\.?0+e/, 'e');
  return String(parseFloat(v.toPrecision(digits)));
}

const asText = (v) => (v === null || v === undefined ? '' : typeof v === 'string' ? v : JSON.stringify(v, null, 2));

function badge(value, title) {
  const s = String(value);
  return el('span', {class: 'badge b-' + (KNOWN_BADGES.has(s) ? s : 'other'), title}, s);
}

const errorBox = (msg) => el('div', {class: 'error-box', role: 'alert'}, 'Error: ' + msg);
const section = (title, ...body) => el('section', {class: 'section'}, el('h2', {}, title), ...body);
const pre = (text, attrs) => el('pre', Object.assign({class: 'text'}, attrs || {}), text);

function table(attrs, headers, rows) {
  return el('table', Object.assign({class: 'grid'}, attrs),
    el('thead', {}, el('tr', {}, headers.map((h) => el('th', {}, h)))),
    el('tbody', {}, rows));
}

function facts(pairs) {
  return el('dl', {class: 'facts'}, pairs.filter(Boolean).map(([k, v]) => [el('dt', {}, k), el('dd', {}, v)]));
}

function legend(items) {
  return el('div', {class: 'legend'}, items.map(({name, color, cls}) =>
    el('span', {class: 'legend-item'}, el('span', {class: 'swatch ' + (cls || ''), style: color ? `background:${color}` : null}), name)));
}

// ---------------------------------------------------------------- URLs and the API

function qs(params) {
  const parts = [];
  for (const [k, v] of Object.entries(params || {})) {
    if (v === null || v === undefined || v === '') continue;
    parts.push(encodeURIComponent(k) + '=' + encodeURIComponent(String(v)));
  }
  return parts.length ? '?' + parts.join('&') : '';
}

const seg = (v) => encodeURIComponent(String(v));
const href = {
  runs: () => '#/',
  run: (run, q) => `#/run/${seg(run)}` + qs(q),
  rollouts: (run, q) => `#/run/${seg(run)}/rollouts` + qs(q),
  rollout: (run, split, step, group, sample) =>
    `#/rollout/${seg(run)}/${seg(split)}/${seg(step)}/${seg(group)}/${seg(sample)}`,
  group: (run, split, step, group) => `#/group/${seg(run)}/${seg(split)}/${seg(step)}/${seg(group)}`,
  compare: (q) => '#/compare' + qs(q),
  sql: (q) => '#/sql' + qs(q),
};

class ApiError extends Error {}
class Stale extends Error {} // thrown when the user navigated away while a fetch was in flight

// Relative 'api/...' so the explorer works behind a proxy that mounts it under a prefix.
async function fetchJSON(path, params) {
  let resp;
  try {
    resp = await fetch('api/' + path + qs(params), {credentials: 'same-origin'});
  } catch (e) {
    throw new ApiError(`could not reach the explorer server (${path}): ${e.message}`);
  }
  let body = null;
  try { body = await resp.json(); } catch (e) { /* not JSON: reported below */ }
  if (!resp.ok) {
    throw new ApiError(body && body.error ? String(body.error) : `${path}: HTTP ${resp.status} ${resp.statusText}`);
  }
  if (body === null) throw new ApiError(`${path}: the server's answer is not JSON`);
  return body;
}

// ---------------------------------------------------------------- router and page state

const state = {gen: 0, pollTimer: null};

function setPageState(s, msg) {
  const ps = $('#page-status');
  ps.setAttribute('data-state', s);
  ps.textContent = s === 'loading' ? 'loading…' : s === 'error' ? msg : '';
}

function setCrumbs(items) {
  const parts = [];
  items.forEach(([label, link], i) => {
    if (i) parts.push(el('span', {class: 'sep'}, '›'));
    parts.push(link && i < items.length - 1 ? el('a', {href: link}, label) : el('span', {}, label));
  });
  $('#crumbs').replaceChildren(...parts);
  document.title = (items.length ? items[items.length - 1][0] + ' · ' : '') + 'grpoflow explorer';
}

function parseHash() {
  const h = location.hash.replace(/^#/, '');
  const qi = h.indexOf('?');
  const path = qi >= 0 ? h.slice(0, qi) : h;
  const dec = (s) => { try { return decodeURIComponent(s); } catch (e) { return s; } };
  return {parts: path.split('/').filter(Boolean).map(dec), query: new URLSearchParams(qi >= 0 ? h.slice(qi + 1) : '')};
}

function pickPage(parts) {
  const [head, ...rest] = parts;
  if (!head) return [pageRuns, []];
  if (head === 'run' && rest.length === 1) return [pageRun, rest];
  if (head === 'run' && rest.length === 2 && rest[1] === 'rollouts') return [pageRollouts, [rest[0]]];
  if (head === 'rollout' && rest.length === 5) return [pageRollout, rest];
  if (head === 'group' && rest.length === 4) return [pageGroup, rest];
  if (head === 'compare' && !rest.length) return [pageCompare, []];
  if (head === 'sql' && !rest.length) return [pageSql, []];
  return null;
}

// Navigate; re-render even when the hash is unchanged (e.g. "Apply" with the same filters).
function go(hash) {
  if (location.hash === hash || (hash === '#/' && !location.hash)) route();
  else location.hash = hash;
}

async function route() {
  const gen = ++state.gen;
  clearTimeout(state.pollTimer);
  const {parts, query} = parseHash();
  const main = $('#main');
  main.replaceChildren(el('p', {class: 'muted placeholder'}, 'Loading…'));
  document.querySelectorAll('.topnav a').forEach((a) =>
    a.classList.toggle('active', a.dataset.nav === (parts[0] === 'sql' ? 'sql' : 'runs')));
  setCrumbs([['Runs', href.runs()]]);
  setPageState('loading');
  const ctx = {
    query,
    showError: null, // a page may route its errors to its own box (the SQL page does)
    alive: () => gen === state.gen,
    async api(path, params) {
      const data = await fetchJSON(path, params);
      if (gen !== state.gen) throw new Stale();
      return data;
    },
  };
  try {
    const picked = pickPage(parts);
    if (!picked) throw new ApiError('no such page: ' + location.hash);
    await picked[0](ctx, ...picked[1]);
    if (ctx.alive()) setPageState('ready');
  } catch (e) {
    if (e instanceof Stale || !ctx.alive()) return;
    if (!(e instanceof ApiError)) console.error(e);
    const msg = e.message || String(e);
    if (ctx.showError) ctx.showError(msg);
    else {
      const ph = main.querySelector('.placeholder');
      if (ph) ph.remove();
      main.prepend(errorBox(msg));
    }
    setPageState('error', msg);
  }
}

// Re-fetch every POLL_MS while running(data). Background refreshes leave #page-status alone (the
// page stays usable) and re-render only when the answer changed, so identical polls touch nothing.
function keepFresh(ctx, first, load, render, running) {
  let last = JSON.stringify(first);
  const schedule = () => { state.pollTimer = setTimeout(tick, POLL_MS); };
  async function tick() {
    let data;
    try {
      data = await load();
    } catch (e) {
      if (!ctx.alive()) return;
      pollWarning('refresh failed (retrying): ' + e.message);
      return schedule();
    }
    if (!ctx.alive()) return;
    pollWarning(null);
    const s = JSON.stringify(data);
    if (s !== last) { last = s; render(data); }
    if (running(data)) schedule();
  }
  if (running(first)) schedule();
}

function pollWarning(msg) {
  const old = $('#main > .warn-box');
  if (old) old.remove();
  if (msg) $('#main').prepend(el('div', {class: 'warn-box'}, msg));
}

// ---------------------------------------------------------------- charts (inline SVG)

const scale = (d0, d1, r0, r1) => (v) => r0 + ((v - d0) / (d1 - d0 || 1)) * (r1 - r0);

function extent(values) {
  let lo = Infinity, hi = -Infinity;
  for (const v of values) if (v !== null && Number.isFinite(v)) { lo = Math.min(lo, v); hi = Math.max(hi, v); }
  return lo <= hi ? [lo, hi] : [0, 1];
}

function padDomain([lo, hi]) {
  if (hi === lo) { const d = lo === 0 ? 1 : Math.abs(lo) * 0.1; return [lo - d, hi + d]; }
  const pad = (hi - lo) * 0.06;
  return [lo - pad, hi + pad];
}

function niceTicks(lo, hi, n, integer) {
  if (!(hi > lo)) return [lo];
  let step = Math.pow(10, Math.floor(Math.log10((hi - lo) / n)));
  const err = (hi - lo) / n / step;
  if (err >= 7.5) step *= 10; else if (err >= 3.5) step *= 5; else if (err >= 1.5) step *= 2;
  if (integer) step = Math.max(1, Math.round(step));
  const out = [];
  for (let v = Math.ceil(lo / step) * step; v <= hi + step * 1e-9; v += step) out.push(+v.toPrecision(12));
  return out;
}

const plotArea = () => ({x: CH.ml, y: CH.mt, w: CH.w - CH.ml - CH.mr, h: CH.h - CH.mt - CH.mb});

// Grid, tick labels and frame. xTicks are [svgX, label] pairs so line and bar charts share this.
function drawAxes(root, plot, xTicks, yTicks, sy) {
  const g = svg('g', {class: 'axes'});
  for (const t of yTicks) {
    const y = sy(t);
    g.append(svg('line', {class: 'gridline', x1: plot.x, x2: plot.x + plot.w, y1: y, y2: y}),
      svg('text', {class: 'tick', x: plot.x - 5, y: y + 3.5, 'text-anchor': 'end'}, fmt(t, 3)));
  }
  const yb = plot.y + plot.h;
  for (const [x, label] of xTicks) {
    g.append(svg('line', {class: 'tickmark', x1: x, x2: x, y1: yb, y2: yb + 4}),
      svg('text', {class: 'tick', x, y: yb + 15, 'text-anchor': 'middle'}, label));
  }
  g.append(svg('rect', {class: 'frame', x: plot.x, y: plot.y, width: plot.w, height: plot.h}));
  root.append(g);
}

function chartShell(title) {
  const root = svg('svg', {class: 'chart', 'data-title': title, viewBox: `0 0 ${CH.w} ${CH.h}`,
    width: CH.w, height: CH.h, role: 'img', 'aria-label': title});
  const box = el('div', {class: 'chart-box'}, el('h3', {}, title), root);
  return {box, root};
}

// Hover: an invisible rect over the plot finds the nearest x position; show(i) draws the guide
// and returns the tooltip's children (show(-1) clears it). The tooltip is HTML, positioned in the box.
function attachHover(box, root, plot, xsPx, show) {
  const tip = el('div', {class: 'chart-tip', hidden: true});
  box.append(tip);
  const overlay = svg('rect', {class: 'hover-overlay', x: plot.x, y: plot.y, width: plot.w, height: plot.h});
  root.append(overlay);
  overlay.addEventListener('mousemove', (ev) => {
    if (!xsPx.length) return;
    const r = root.getBoundingClientRect();
    const k = r.width / CH.w;
    const x = (ev.clientX - r.left) / k;
    let best = 0;
    for (let i = 1; i < xsPx.length; i++) if (Math.abs(xsPx[i] - x) < Math.abs(xsPx[best] - x)) best = i;
    tip.replaceChildren(...show(best));
    tip.hidden = false;
    const br = box.getBoundingClientRect();
    const px = r.left - br.left + xsPx[best] * k;
    // Keep the tooltip inside the box: right of the guide in the left half, left of it otherwise.
    if (xsPx[best] < CH.w / 2) { tip.style.left = px + 12 + 'px'; tip.style.right = ''; }
    else { tip.style.right = br.width - px + 12 + 'px'; tip.style.left = ''; }
    tip.style.top = r.top - br.top + 6 + 'px';
  });
  overlay.addEventListener('mouseleave', () => { tip.hidden = true; show(-1); });
}

function tipRow(color, name, value) {
  return el('div', {class: 'tip-row'}, el('span', {class: 'swatch', style: `background:${color}`}),
    el('span', {class: 'tip-name'}, name), el('span', {class: 'tip-val'}, value));
}

// series: [{name, points: [[step, value|null], ...]}]. Nulls break the line.
function lineChart(title, series) {
  const plot = plotArea();
  const {box, root} = chartShell(title);
  const steps = [...new Set(series.flatMap((s) => s.points.map((p) => p[0])))].sort((a, b) => a - b);
  let [x0, x1] = extent(steps);
  if (x0 === x1) { x0 -= 1; x1 += 1; }
  const [y0, y1] = padDomain(extent(series.flatMap((s) => s.points.map((p) => p[1]))));
  const sx = scale(x0, x1, plot.x, plot.x + plot.w);
  const sy = scale(y0, y1, plot.y + plot.h, plot.y);
  drawAxes(root, plot, niceTicks(x0, x1, 6, true).map((t) => [sx(t), String(t)]), niceTicks(y0, y1, 5), sy);
  const colors = series.map((s, i) => PALETTE[i % PALETTE.length]);
  const lookup = series.map((s) => new Map(s.points.map((p) => [p[0], p[1]])));
  series.forEach((s, i) => {
    let d = '', pen = false;
    for (const [x, y] of s.points) {
      if (y === null || !Number.isFinite(y)) { pen = false; continue; }
      d += (pen ? 'L' : 'M') + sx(x).toFixed(1) + ' ' + sy(y).toFixed(1);
      pen = true;
    }
    root.append(svg('path', {class: 'series', d, stroke: colors[i]}));
    if (s.points.length <= 30) { // few points: dots, so a lone point is visible at all
      for (const [x, y] of s.points) if (y !== null) root.append(svg('circle', {cx: sx(x), cy: sy(y), r: 2.2, fill: colors[i]}));
    }
  });
  const guide = svg('line', {class: 'guide', y1: plot.y, y2: plot.y + plot.h, visibility: 'hidden'});
  const marks = svg('g', {class: 'marks'});
  root.append(guide, marks);
  attachHover(box, root, plot, steps.map(sx), (i) => {
    marks.replaceChildren();
    if (i < 0) { guide.setAttribute('visibility', 'hidden'); return []; }
    const step = steps[i];
    setAttrs(guide, {x1: sx(step), x2: sx(step), visibility: 'visible'});
    const rows = series.map((s, j) => {
      const v = lookup[j].get(step);
      if (v !== undefined && v !== null) marks.append(svg('circle', {cx: sx(step), cy: sy(v), r: 3.5, fill: colors[j]}));
      return tipRow(colors[j], s.name, fmt(v));
    });
    return [el('div', {class: 'tip-head'}, 'step ' + step), ...rows];
  });
  box.append(legend(series.map((s, i) => ({name: s.name, color: colors[i]}))));
  return box;
}

// rows: [{step, valid, invalid, failed, timeout}] sorted by step. One band per row (steps are
// bucketed evenly by the API), so bars stay legible whatever the run's length.
function statusMixChart(title, rows, bucket) {
  const plot = plotArea();
  const {box, root} = chartShell(title);
  const totals = rows.map((r) => STATUSES.reduce((a, s) => a + (r[s] || 0), 0));
  const yTicks = niceTicks(0, Math.max(1, ...totals), 4, true);
  const sy = scale(0, Math.max(1, ...totals, yTicks[yTicks.length - 1]), plot.y + plot.h, plot.y);
  const band = plot.w / Math.max(1, rows.length);
  const gap = band > 4 ? 1 : 0;
  const cx = (i) => plot.x + (i + 0.5) * band;
  const every = Math.max(1, Math.ceil(rows.length / 7));
  drawAxes(root, plot, rows.map((r, i) => [cx(i), String(r.step)]).filter((_, i) => i % every === 0), yTicks, sy);
  const bars = svg('g', {class: 'bars'});
  rows.forEach((r, i) => {
    let acc = 0;
    for (const s of STATUSES) {
      const v = r[s] || 0;
      if (v > 0) bars.append(svg('rect', {x: plot.x + i * band + gap / 2, width: Math.max(0.5, band - gap),
        y: sy(acc + v), height: sy(acc) - sy(acc + v), fill: STATUS_COLORS[s]}));
      acc += v;
    }
  });
  const guide = svg('rect', {class: 'band-guide', y: plot.y, height: plot.h, width: band, visibility: 'hidden'});
  root.append(bars, guide);
  attachHover(box, root, plot, rows.map((r, i) => cx(i)), (i) => {
    if (i < 0) { guide.setAttribute('visibility', 'hidden'); return []; }
    setAttrs(guide, {x: plot.x + i * band, visibility: 'visible'});
    const r = rows[i];
    const head = bucket > 1 ? `steps ${r.step}–${r.step + bucket - 1}` : `step ${r.step}`;
    return [el('div', {class: 'tip-head'}, head),
      ...STATUSES.map((s) => tipRow(STATUS_COLORS[s], s, String(r[s] || 0))),
      el('div', {class: 'tip-row tip-total'}, `total ${totals[i]}`)];
  });
  return box;
}

function sparkline(points) {
  const w = 110, h = 26;
  const pts = (points || []).filter((p) => p[1] !== null);
  const root = svg('svg', {class: 'spark', viewBox: `0 0 ${w} ${h}`, width: w, height: h});
  if (!pts.length) return root;
  const [x0, x1] = extent(pts.map((p) => p[0]));
  const [y0, y1] = padDomain(extent(pts.map((p) => p[1])));
  const sx = scale(x0, x1, 2, w - 2), sy = scale(y0, y1, h - 2, 2);
  const last = pts[pts.length - 1];
  root.append(
    svg('title', {}, `reward mean: ${fmt(pts[0][1])} at step ${pts[0][0]} → ${fmt(last[1])} at step ${last[0]}`),
    svg('polyline', {points: pts.map((p) => `${sx(p[0]).toFixed(1)},${sy(p[1]).toFixed(1)}`).join(' ')}),
    svg('circle', {cx: sx(last[0]), cy: sy(last[1]), r: 2}));
  return root;
}

// ---------------------------------------------------------------- page: runs

async function pageRuns(ctx) {
  setCrumbs([['Runs']]);
  const data = await ctx.api('runs');
  const render = (d) => $('#main').replaceChildren(el('h1', {}, 'Runs'),
    d.runs.length ? runsTable(d.runs) : el('p', {class: 'muted'}, 'No runs in this store yet.'));
  render(data);
  keepFresh(ctx, data, () => ctx.api('runs'), render, (d) => d.runs.some((r) => r.status === 'running'));
}

function lastPromotion(promotions) {
  // The API doesn't promise an order; the newest decision is the one with the latest created_at.
  return [...(promotions || [])].sort((a, b) => String(a.created_at || '').localeCompare(String(b.created_at || ''))).pop();
}

function runsTable(runs) {
  const rows = runs.map((r) => {
    const last = lastPromotion(r.promotions);
    return el('tr', {'data-run': r.run_id},
      el('td', {}, el('a', {href: href.run(r.run_id), class: 'mono'}, r.run_id),
        r.replay_of ? el('span', {class: 'muted replay-of'}, ` replay of ${r.replay_of}`) : null),
      el('td', {}, badge(r.status)),
      el('td', {class: 'num'}, fmt(r.steps)),
      el('td', {class: 'num'}, fmt(r.last_step)),
      el('td', {class: 'num'}, fmt(r.completions)),
      el('td', {class: 'num'}, fmt(r.last_reward)),
      el('td', {}, sparkline(r.trend)),
      el('td', {class: 'mono'}, r.lineage || '—'),
      el('td', {}, (r.promotions || []).length ? [String(r.promotions.length), ' · ', badge(last.decision, last.reason || null),
        last.candidate_run ? ` ${last.candidate_run} @ ${fmt(last.candidate_step)}` : ''] : '—'));
  });
  return table({id: 'runs-table'}, ['Run', 'Status', 'Steps', 'Last step', 'Completions', 'Last reward',
    'Reward trend', 'Lineage', 'Promotions'], rows);
}

// ---------------------------------------------------------------- page: run

async function pageRun(ctx, run) {
  setCrumbs([['Runs', href.runs()], [run]]);
  const split = ctx.query.get('split') || 'train';
  const load = () => Promise.all([ctx.api('run', {run}), ctx.api('curves', {run}), ctx.api('status_mix', {run, split})]);
  const first = await load();
  const render = ([info, curves, mix]) => $('#main').replaceChildren(
    runHeader(info), curvesSection(curves), statusMixSection(run, info, mix, split), rescoresSection(run, info.rescores),
    promotionsSection(info.promotions));
  render(first);
  keepFresh(ctx, first, load, render, ([info]) => info.status === 'running');
}

function runHeader(info) {
  const run = info.run_id;
  const steps = info.first_step === null || info.first_step === undefined ? fmt(info.steps)
    : `${fmt(info.steps)} (steps ${fmt(info.first_step)}–${fmt(info.last_step)})`;
  return el('div', {class: 'page-head'},
    el('h1', {}, el('span', {id: 'run-title', class: 'mono'}, run), ' ', badge(info.status)),
    facts([['base model', info.base_model || '—'], ['steps', steps], ['created', info.created_at || '—'],
      ['updated', info.updated_at || '—'], ['reward functions', (info.reward_names || []).join(', ') || '—'],
      ['servers', (info.servers || []).join(', ') || '—'],
      (info.flow_runs || []).length ? ['flow runs', info.flow_runs.join(', ')] : null,
      info.replay_of ? ['replay of', el('a', {href: href.run(info.replay_of), id: 'replay-of', class: 'mono'}, info.replay_of)] : null,
      info.replay_where ? ['replayed groups', el('span', {class: 'mono'}, info.replay_where)] : null]),
    el('div', {class: 'links'},
      el('a', {href: href.rollouts(run), class: 'button'}, 'Rollouts'),
      info.has_eval ? el('a', {href: href.rollouts(run, {split: 'eval'}), class: 'button'}, 'Eval rollouts') : null,
      el('a', {href: href.sql({canned: 'reward_curve', run}), class: 'button'}, 'SQL')),
    info.config ? el('details', {class: 'config'}, el('summary', {}, 'Resolved config'),
      pre(JSON.stringify(info.config, null, 2))) : null);
}

function curvesSection(curves) {
  const charts = (curves.panels || []).map((p) => lineChart(p.title,
    p.names.map((n) => ({name: n, points: (curves.series || {})[n] || []})).filter((s) => s.points.length)));
  return section('Curves',
    curves.bucket > 1 ? el('p', {class: 'muted'}, `Each point is the mean of ${curves.bucket} steps.`) : null,
    el('div', {id: 'curves', class: 'charts'}, charts.length ? charts : el('p', {class: 'muted'}, 'No step metrics yet.')));
}

function statusMixSection(run, info, mix, split) {
  const byName = new Map((mix.reward_names || []).map((n) => [n, []]));
  for (const r of mix.rows || []) {
    if (!byName.has(r.reward_name)) byName.set(r.reward_name, []);
    byName.get(r.reward_name).push(r);
  }
  const charts = [...byName].filter(([, rows]) => rows.length)
    .map(([name, rows]) => statusMixChart(name, rows.sort((a, b) => a.step - b.step), mix.bucket || 1));
  const splits = info.splits && info.splits.length > 1 ? info.splits : null;
  return section('Reward status mix',
    el('div', {class: 'toolbar'},
      legend(STATUSES.map((s) => ({name: s, color: STATUS_COLORS[s]}))),
      splits ? el('label', {}, 'split ', selectInput('mix_split', splits.map((s) => [s, s]), split,
        {onchange: (ev) => go(href.run(run, {split: ev.target.value === 'train' ? '' : ev.target.value}))})) : null,
      mix.bucket > 1 ? el('span', {class: 'muted'}, `bars sum ${mix.bucket} steps each`) : null),
    el('div', {id: 'status-mix', class: 'charts'},
      charts.length ? charts : el('p', {class: 'muted'}, `No reward cells in the ${split} split yet.`)));
}

// grpoflow rescore: each rescore's cells per reward beside the mean of the run's own reward of that name.
function rescoresSection(run, rescores) {
  if (!rescores || !rescores.length) return null;
  return section('Rescores', table({id: 'rescores-table'}, ['Rescore', 'Version', 'Reward', 'Cells', 'Valid', 'Not valid',
    'Mean', "Run's own mean"], rescores.map((r) => el('tr', {'data-rescore': r.rescore, 'data-version': r.version, 'data-reward': r.reward_name},
      el('td', {class: 'mono'}, r.rescore), el('td', {class: 'num'}, fmt(r.version)), el('td', {class: 'mono'}, r.reward_name),
      el('td', {class: 'num'}, fmt(r.cells)), el('td', {class: 'num'}, fmt(r.valid)), el('td', {class: 'num'}, fmt(r.not_valid)),
      el('td', {class: 'num'}, fmt(r.mean)), el('td', {class: 'num'}, fmt(r.own_mean))))),
    el('p', {}, el('a', {href: href.sql({canned: 'rescore_disagreements', run}), class: 'button'}, 'Where a rescore disagrees')));
}

function promotionsSection(promotions) {
  if (!promotions || !promotions.length) return section('Promotions', el('p', {class: 'muted'}, 'No promotion decisions for this lineage.'));
  return section('Promotions', table({id: 'promotions-table'}, ['When', 'Decision', 'Candidate', 'Step', 'Reason', 'Id'],
    promotions.map((p) => el('tr', {},
      el('td', {class: 'mono'}, p.created_at || '—'), el('td', {}, badge(p.decision)),
      el('td', {}, p.candidate_run ? el('a', {href: href.run(p.candidate_run), class: 'mono'}, p.candidate_run) : '—'),
      el('td', {class: 'num'}, fmt(p.candidate_step)), el('td', {}, p.reason || ''),
      el('td', {class: 'mono muted'}, fmt(p.decision_id))))));
}

// ---------------------------------------------------------------- page: rollouts

const FILTER_KEYS = ['split', 'step_min', 'step_max', 'reward_min', 'reward_max', 'status', 'reward_name',
  'truncated', 'tool_failed', 'server', 'text'];

function selectInput(name, options, current, attrs) {
  const opts = options.slice();
  // A value from a shared link that isn't among the choices stays visible rather than silently dropped.
  if (current && !opts.some(([v]) => v === current)) opts.push([current, current]);
  return el('select', Object.assign({name}, attrs || {}),
    opts.map(([v, label]) => el('option', {value: v, selected: v === (current || '')}, label)));
}

async function pageRollouts(ctx, run) {
  const f = Object.fromEntries(FILTER_KEYS.map((k) => [k, ctx.query.get(k) || '']));
  const offset = Math.max(0, parseInt(ctx.query.get('offset') || '0', 10) || 0);
  const split = f.split || 'train';
  setCrumbs([['Runs', href.runs()], [run, href.run(run)], [`rollouts (${split})`]]);
  const [info, data] = await Promise.all([ctx.api('run', {run}),
    ctx.api('rollouts', Object.assign({run}, f, {offset, limit: PAGE_SIZE}))]);
  const names = info.reward_names || [];
  $('#main').replaceChildren(
    el('h1', {}, 'Rollouts of ', el('a', {href: href.run(run), class: 'mono'}, run)),
    filterForm(run, f, info),
    el('div', {class: 'toolbar'}, el('span', {}, el('span', {id: 'rollout-total'}, totalText(data.total)), ' rollouts match'),
      pager(run, f, data)),
    el('div', {class: 'table-wrap'}, table({id: 'rollouts-table'},
      ['Step', 'Group', 'Sample', 'Reward', 'Advantage', 'Trained', 'Trunc.', 'Tools (fail)', ...names, 'Completion'],
      data.rows.length ? data.rows.map((r) => rolloutRow(run, r, names))
        : el('tr', {}, el('td', {colspan: 9 + names.length, class: 'muted'}, 'No rollouts match these filters.')))),
    el('div', {class: 'toolbar'}, pager(run, f, data)));
  // A text search answers its page first; its total (every row's text read) follows on its own.
  if (data.total === null) {
    ctx.api('rollouts_count', Object.assign({run}, f)).then((c) => {
      data.total = c.total;
      $('#rollout-total').textContent = totalText(c.total);
      document.querySelectorAll('.pager').forEach((p) => p.replaceWith(pager(run, f, data)));
    }).catch(() => {}); // a newer page, or a failed count: the rows stand without it
  }
}

function totalText(total) {
  return total === null || total === undefined ? 'counting…' : String(total);
}

function filterForm(run, f, info) {
  const splits = [...new Set(['train', 'eval', ...(info.splits || [])])];
  const num = (name, ph, step) => el('input', {type: 'number', name, value: f[name], placeholder: ph, step, class: 'narrow'});
  const field = (label, input) => el('label', {class: 'field'}, el('span', {}, label), input);
  const form = el('form', {id: 'filters', class: 'filters', onsubmit: (ev) => {
    ev.preventDefault();
    const params = {};
    for (const [k, v] of new FormData(form)) if (v !== '') params[k] = v;
    if (params.split === 'train') delete params.split; // the API's default; keeps links short
    go(href.rollouts(run, params)); // a new filter starts at the first page
  }},
  field('split', selectInput('split', splits.map((s) => [s, s]), f.split || 'train')),
  field('step', el('span', {class: 'range'}, num('step_min', 'min', 1), '–', num('step_max', 'max', 1))),
  field('reward', el('span', {class: 'range'}, num('reward_min', 'min', 'any'), '–', num('reward_max', 'max', 'any'))),
  field('cell status', selectInput('status', [['', 'any'], ...STATUSES.map((s) => [s, s])], f.status)),
  field('of reward', selectInput('reward_name', [['', 'any reward'], ...(info.reward_names || []).map((n) => [n, n])], f.reward_name)),
  field('truncated', selectInput('truncated', [['', 'any'], ['1', 'yes'], ['0', 'no']], f.truncated)),
  field('tool failure', el('input', {type: 'checkbox', name: 'tool_failed', value: '1', checked: f.tool_failed === '1'})),
  field('server', selectInput('server', [['', 'any'], ...(info.servers || []).map((s) => [s, s])], f.server)),
  field('text', el('input', {type: 'search', name: 'text', value: f.text, placeholder: 'in prompt or completion'})),
  el('div', {class: 'field buttons'}, el('button', {type: 'submit', id: 'apply-filters'}, 'Apply'),
    el('a', {href: href.rollouts(run)}, 'clear')));
  return form;
}

function pager(run, f, data) {
  const at = (offset) => href.rollouts(run, Object.assign({}, f, {offset: offset || ''}));
  const prev = data.offset > 0, next = data.more;
  const of = data.total === null ? '' : ` of ${data.total}`;
  return el('span', {class: 'pager'},
    prev ? el('a', {href: at(Math.max(0, data.offset - PAGE_SIZE)), class: 'prev'}, '‹ prev') : el('span', {class: 'disabled'}, '‹ prev'),
    el('span', {}, data.rows.length ? `${data.offset + 1}–${data.offset + data.rows.length}${of}` : '0'),
    next ? el('a', {href: at(data.offset + PAGE_SIZE), class: 'next'}, 'next ›') : el('span', {class: 'disabled'}, 'next ›'));
}

function cellBadge(name, cell) {
  if (!cell) return el('span', {class: 'muted'}, '—');
  const shown = cell.status === 'valid' ? fmt(cell.value, 3) : cell.status;
  return el('span', {class: 'badge b-' + (KNOWN_BADGES.has(cell.status) ? cell.status : 'other'),
    title: `${name}: ${cell.status} ${fmt(cell.value)}${cell.reason ? ' — ' + cell.reason : ''}`}, shown);
}

function trainedCell(r) {
  // A drop reason can list every broken reward: cut to one line here, whole on hover and on the rollout page.
  return r.trained ? badge('trained') : el('span', {class: 'badge b-dropped clip', title: r.drop_reason || 'dropped'}, r.drop_reason || 'dropped');
}

function rolloutRow(run, r, names) {
  const link = href.rollout(run, r.split, r.step, r.group_id, r.sample_index);
  const tr = el('tr', {class: 'clickable', 'data-step': r.step, 'data-group': r.group_id, 'data-sample': r.sample_index},
    el('td', {class: 'num'}, fmt(r.step)),
    el('td', {class: 'num'}, el('a', {href: href.group(run, r.split, r.step, r.group_id), class: 'group-link'}, fmt(r.group_id))),
    el('td', {class: 'num'}, el('a', {href: link, class: 'open-rollout'}, fmt(r.sample_index))),
    el('td', {class: 'num'}, r.reward_valid ? fmt(r.reward) : badge('invalid')),
    el('td', {class: 'num'}, fmt(r.advantage, 3)),
    el('td', {}, trainedCell(r)),
    el('td', {}, r.truncated ? badge('yes') : ''),
    el('td', {class: 'num'}, r.tool_calls ? [String(r.tool_calls), r.tool_failures ? el('span', {class: 'fail'}, ` (${r.tool_failures})`) : ''] : ''),
    names.map((n) => el('td', {}, cellBadge(n, (r.cells || {})[n]))),
    el('td', {class: 'preview', title: r.prompt_preview || null}, r.completion_preview));
  // The whole row opens the rollout; real links inside it keep their own targets.
  tr.addEventListener('click', (ev) => { if (!ev.target.closest('a')) location.hash = link; });
  return tr;
}

// ---------------------------------------------------------------- page: rollout

async function pageRollout(ctx, run, split, step, group, sample) {
  setCrumbs([['Runs', href.runs()], [run, href.run(run)],
    [`rollouts (${split})`, href.rollouts(run, {split: split === 'train' ? '' : split})],
    [`step ${step} · group ${group}`, href.group(run, split, step, group)], [`sample ${sample}`]]);
  const r = await ctx.api('rollout', {run, split, step, group, sample});
  const cmp = href.compare({row_id: r.row_id, split, a_run: run, a_step: r.step});
  $('#main').replaceChildren(
    el('div', {class: 'page-head'},
      el('h1', {}, 'Rollout ', el('span', {class: 'mono'}, `${run} · ${split} · step ${step} · group ${group} · sample ${sample}`)),
      el('div', {class: 'links'}, el('a', {href: href.group(run, split, r.step, r.group_id), class: 'button'}, 'Group'),
        el('a', {href: cmp, class: 'button compare-link'}, 'Compare'),
        el('a', {href: href.rollouts(run, {split: split === 'train' ? '' : split, step_min: r.step, step_max: r.step}), class: 'button'}, 'Rollouts of this step'))),
    el('div', {class: 'two-col'},
      el('div', {class: 'col-main'},
        section('Prompt', pre(asText(r.prompt), {id: 'prompt-text'})),
        section('Trajectory', messagesView(r.messages || [])),
        section('Tool calls', toolCallsTable(r.tool_calls || [])),
        section('Reward cells', rewardCellsTable(r.cells || [])),
        (r.rescored_cells || []).length ? section('Rescored cells', rewardCellsTable(r.rescored_cells, 'rescored-cells-table')) : null,
        section('Completion', pre(asText(r.completion), {id: 'completion-text'})),
        section('Tokens', tokensView(r.tokens || [], r.tokenizer))),
      el('aside', {class: 'col-side'}, section('Facts', rolloutFacts(r)), turnsTable(r.turns || []))));
}

function rolloutFacts(r) {
  const pv = r.policy_version_end !== undefined && r.policy_version_end !== r.policy_version
    ? `${fmt(r.policy_version)}..${fmt(r.policy_version_end)}` : fmt(r.policy_version);
  return facts([
    ['reward', [fmt(r.reward), ' ', badge(r.reward_valid ? 'valid' : 'invalid')]],
    r.reward_valid ? null : ['invalid reason', r.invalid_reason || '—'],
    ['advantage', fmt(r.advantage)],
    ['trained', r.trained ? 'yes' : ['no — ', r.drop_reason || 'dropped']],
    ['policy version', pv], ['staleness', fmt(r.staleness)], ['server', r.server || '—'],
    ['finish reason', r.finish_reason || '—'],
    ['truncated', r.truncated ? ['yes', r.truncation_reason ? ` (${r.truncation_reason})` : ''] : 'no'],
    ['completion tokens', fmt(r.completion_tokens)], ['gen seconds', fmt(r.gen_seconds, 3)],
    ['row id', fmt(r.row_id)], ['prompt index', fmt(r.prompt_index)], ['created', r.created_at || '—']]);
}

function turnsTable(turns) {
  if (turns.length < 1) return null;
  return section('Turns', table({id: 'turns-table'}, ['#', 'prompt tok', 'output tok', 'seconds', 'finish'],
    turns.map((t, i) => el('tr', {}, el('td', {class: 'num'}, String(i)), el('td', {class: 'num'}, fmt(t.prompt_tokens)),
      el('td', {class: 'num'}, fmt(t.output_tokens)), el('td', {class: 'num'}, fmt(t.duration_s, 3)),
      el('td', {}, t.finish_reason || '—')))));
}

function messagesView(messages) {
  return el('div', {id: 'messages'}, messages.length ? messages.map((m) =>
    el('div', {class: 'msg' + (m.is_completion ? ' completion' : ''), 'data-role': m.role || ''},
      el('div', {class: 'msg-head'}, el('span', {class: 'role'}, m.role || '?'),
        m.is_completion ? el('span', {class: 'tag'}, 'completion (generated)') : el('span', {class: 'tag muted'}, 'context')),
      pre(asText(m.content)))) : el('p', {class: 'muted'}, 'No trajectory messages.'));
}

function toolCallsTable(calls) {
  return table({id: 'tool-calls-table'}, ['Turn', 'Name', 'Arguments', 'Result / error', 'Failed', 'Seconds'],
    calls.length ? calls.map((c) => el('tr', {class: c.failed ? 'failed-row' : null, 'data-failed': c.failed ? '1' : '0'},
      el('td', {class: 'num'}, fmt(c.turn)), el('td', {class: 'mono'}, c.name || '—'),
      el('td', {}, pre(asText(c.arguments), {class: 'text small'})),
      el('td', {}, c.failed || c.error ? pre(asText(c.error || c.result), {class: 'text small fail'}) : pre(asText(c.result), {class: 'text small'})),
      el('td', {}, c.failed ? badge('failed') : 'no'), el('td', {class: 'num'}, fmt(c.duration_s, 3))))
      : el('tr', {}, el('td', {colspan: 6, class: 'muted'}, 'No tool calls.')));
}

function rewardCellsTable(cells, id = 'reward-cells-table') {
  return table({id}, ['Reward', 'Weight', 'Value', 'Status', 'Reason', 'Imputed', 'Seconds', 'Extra'],
    cells.length ? cells.map((c) => el('tr', {'data-reward': c.reward_name, 'data-status': c.status},
      el('td', {class: 'mono'}, c.rescore ? `${c.reward_name} (${c.rescore} v${c.version})` : c.reward_name), el('td', {class: 'num'}, fmt(c.weight)), el('td', {class: 'num'}, fmt(c.value)),
      el('td', {}, badge(c.status)), el('td', {}, c.reason ? pre(asText(c.reason), {class: 'text small'}) : ''),
      el('td', {}, c.imputed ? `yes → ${fmt(c.imputed_value)}` : 'no'), el('td', {class: 'num'}, fmt(c.duration_s, 3)),
      el('td', {}, c.extra ? pre(JSON.stringify(c.extra, null, 1), {class: 'text small'}) : '')))
      : el('tr', {}, el('td', {colspan: 8, class: 'muted'}, 'No reward cells.')));
}

// exp(logprob) is the probability the policy gave the sampled token: white when confident,
// increasingly red as it drops. Masked tokens (not trained) get a neutral grey via CSS instead.
function tokenColor(p) {
  return `rgba(239, 68, 68, ${((1 - p) * 0.85).toFixed(3)})`;
}

function tokensView(tokens, tokenizer) {
  const box = el('div', {id: 'tokens', class: 'tokens'});
  const frag = document.createDocumentFragment();
  let trained = 0, lpSum = 0;
  for (const t of tokens) {
    const lp = typeof t.logprob === 'number' ? t.logprob : null;
    const masked = t.mask === 0;
    const p = lp === null ? null : Math.exp(Math.min(0, lp));
    if (!masked && lp !== null) { trained++; lpSum += lp; }
    // Without a tokenizer there is no text: show the id. Newlines get a visible mark, then break.
    const shown = t.text === null || t.text === undefined ? `⟨${t.id}⟩` : t.text === '' ? '∅' : t.text.replace(/\n/g, '↵\n');
    const span = el('span', {class: 'tok' + (masked ? ' masked' : ''), 'data-logprob': lp === null ? '' : lp,
      'data-id': t.id, title: `id ${t.id} · ${JSON.stringify(t.text)} · logprob ${lp === null ? '—' : lp.toFixed(4)}` +
        (p === null ? '' : ` · p=${p.toFixed(3)}`) + (masked ? ' · masked (not trained)' : '')}, shown);
    if (!masked && p !== null) span.style.backgroundColor = tokenColor(p);
    frag.append(span);
  }
  box.append(frag);
  const stops = [0.01, 0.1, 0.3, 0.5, 0.7, 0.9, 1];
  return el('div', {},
    el('div', {class: 'toolbar'},
      el('span', {class: 'legend'}, 'p = exp(logprob): ', stops.map((p) =>
        el('span', {class: 'legend-item'}, el('span', {class: 'swatch tok-swatch', style: `background:${tokenColor(p)}`}), String(p))),
      el('span', {class: 'legend-item'}, el('span', {class: 'tok masked'}, 'masked'), ' not trained (tool results, template)')),
      el('span', {class: 'muted'}, `${tokens.length} tokens, ${trained} trained` +
        (trained ? `, mean logprob ${fmt(lpSum / trained)}` : '') + (tokenizer ? ` · text from ${tokenizer}` : ' · no tokenizer: ids shown'))),
    tokens.length ? box : [box, el('p', {class: 'muted'}, 'No tokens stored.')]);
}

// ---------------------------------------------------------------- page: group

async function pageGroup(ctx, run, split, step, group) {
  setCrumbs([['Runs', href.runs()], [run, href.run(run)],
    [`rollouts (${split})`, href.rollouts(run, {split: split === 'train' ? '' : split})], [`step ${step} · group ${group}`]]);
  const g = await ctx.api('group', {run, split, step, group});
  $('#main').replaceChildren(
    el('div', {class: 'page-head'},
      el('h1', {}, 'Group ', el('span', {class: 'mono'}, `${run} · ${split} · step ${step} · group ${group}`)),
      el('div', {class: 'links'},
        el('a', {href: href.compare({row_id: g.row_id, split, a_run: run, a_step: g.step}), class: 'button compare-link'}, 'Compare'),
        el('a', {href: href.rollouts(run, {split: split === 'train' ? '' : split, step_min: g.step, step_max: g.step}), class: 'button'}, 'Rollouts of this step')),
      groupSummary(g)),
    section('Prompt', pre(asText(g.prompt), {id: 'prompt-text'})),
    section('Completions (highest advantage first)',
      el('div', {id: 'group-columns', class: 'group-columns'}, (g.completions || []).map((c) => groupCol(g, c, false)))));
}

function groupSummary(g, oneLine) {
  const cs = g.completions || [];
  const valid = cs.filter((c) => c.reward_valid && c.reward !== null);
  const mean = valid.length ? valid.reduce((a, c) => a + c.reward, 0) / valid.length : null;
  const trained = cs.filter((c) => c.trained).length;
  if (oneLine) {
    return el('p', {class: 'muted'}, `${cs.length} completions · valid ${valid.length}/${cs.length} · ` +
      `reward mean ${fmt(mean, 3)} · trained ${trained}`);
  }
  return facts([['completions', String(cs.length)], ['valid', `${valid.length} / ${cs.length}`],
    ['reward mean (valid)', fmt(mean)], ['trained', String(trained)],
    ['row id', fmt(g.row_id)], ['prompt index', fmt(g.prompt_index)]]);
}

// One completion of a group; `compact` (the compare page) caps the text's height.
function groupCol(g, c, compact) {
  const run = g.run_id;
  return el('div', {class: 'group-col' + (compact ? ' compact' : ''), 'data-sample': c.sample_index, 'data-advantage': c.advantage},
    el('div', {class: 'col-head'},
      el('a', {href: href.rollout(run, g.split, g.step, g.group_id, c.sample_index), class: 'open-rollout'}, `sample ${c.sample_index}`),
      el('span', {}, 'adv ', el('b', {}, fmt(c.advantage, 3))),
      el('span', {}, 'reward ', c.reward_valid ? el('b', {}, fmt(c.reward, 3)) : badge('invalid')),
      trainedCell(c), c.truncated ? badge('truncated') : null,
      c.tool_calls ? el('span', {class: c.tool_failures ? 'fail' : 'muted'}, `${c.tool_calls} tool calls, ${c.tool_failures} failed`) : null),
    el('div', {class: 'col-cells'}, Object.entries(c.cells || {}).map(([n, cell]) =>
      el('span', {class: 'cell'}, el('span', {class: 'mono small'}, n), ' ', cellBadge(n, cell)))),
    pre(asText(c.completion), {class: 'text completion'}));
}

// ---------------------------------------------------------------- page: compare

async function pageCompare(ctx) {
  const q = ctx.query;
  const rowId = q.get('row_id'), split = q.get('split') || 'train';
  setCrumbs([['Runs', href.runs()], ['compare']]);
  const main = $('#main');
  if (!rowId) {
    const input = el('input', {type: 'text', name: 'row_id', placeholder: 'row id'});
    main.replaceChildren(el('h1', {}, 'Compare a prompt across runs and steps'),
      el('form', {class: 'filters', onsubmit: (ev) => { ev.preventDefault(); go(href.compare({row_id: input.value, split})); }},
        el('label', {class: 'field'}, el('span', {}, 'row id'), input), el('button', {type: 'submit'}, 'Find')),
      el('p', {class: 'muted'}, 'Open a rollout or group and use its "Compare" link to start from it.'));
    return;
  }
  const occ = (await ctx.api('occurrences', {row_id: rowId, split})).occurrences || [];
  if (!occ.length) throw new ApiError(`prompt row ${rowId} was never sampled in the ${split} split`);
  const find = (run, step) => occ.findIndex((o) => o.run_id === run && (step === null || String(o.step) === step));
  let a = q.get('a_run') ? find(q.get('a_run'), q.get('a_step')) : -1;
  if (a < 0) a = 0;
  let b = q.get('b_run') ? find(q.get('b_run'), q.get('b_step')) : -1;
  if (b < 0) b = defaultB(occ, a);
  const params = (ia, ib) => ({row_id: rowId, split: split === 'train' ? '' : split, a_run: occ[ia].run_id,
    a_step: occ[ia].step, b_run: occ[ib].run_id, b_step: occ[ib].step});
  // Record the defaults in the address (without a history entry) so the view is a shareable link.
  const resolved = href.compare(params(a, b));
  if (location.hash !== resolved) history.replaceState(null, '', resolved);

  const picker = (side, index) => selectInput('pick_' + side,
    occ.map((o, i) => [String(i), `${o.run_id} @ ${o.step} (${fmt(o.reward_mean, 3)})`]), String(index),
    {class: 'compare-pick', onchange: (ev) => go(href.compare(side === 'a' ? params(+ev.target.value, b) : params(a, +ev.target.value)))});
  const colA = el('div', {id: 'compare-a', class: 'compare-col'}, el('div', {class: 'pick'}, el('b', {}, 'A '), picker('a', a)));
  const colB = el('div', {id: 'compare-b', class: 'compare-col'}, el('div', {class: 'pick'}, el('b', {}, 'B '), picker('b', b)));
  const promptBox = el('div', {});
  main.replaceChildren(el('h1', {}, 'Compare prompt row ', el('span', {class: 'mono'}, rowId)),
    el('p', {class: 'muted'}, `sampled ${occ.length} time(s) in the ${split} split`), promptBox,
    el('div', {class: 'compare'}, colA, colB));
  const cmp = await ctx.api('compare', Object.assign(params(a, b), {split}));
  promptBox.append(section('Prompt', pre(asText(cmp.prompt), {id: 'prompt-text'})));
  colA.append(compareGroup(cmp.a));
  colB.append(compareGroup(cmp.b));
}

// B defaults to the latest occurrence in another run, else the latest other step of A's run.
function defaultB(occ, a) {
  const others = occ.map((o, i) => i).filter((i) => i !== a);
  const otherRun = others.filter((i) => occ[i].run_id !== occ[a].run_id);
  const pool = otherRun.length ? otherRun : others;
  if (!pool.length) return a;
  return pool.reduce((best, i) => (occ[i].step > occ[best].step ? i : best), pool[0]);
}

function compareGroup(g) {
  return el('div', {class: 'compare-group'},
    el('div', {class: 'links'}, el('a', {href: href.group(g.run_id, g.split, g.step, g.group_id)},
      `group ${g.group_id} of ${g.run_id} @ step ${g.step}`)),
    groupSummary(g, true),
    el('div', {class: 'compare-list'}, (g.completions || []).map((c) => groupCol(g, c, true))));
}

// ---------------------------------------------------------------- page: SQL

async function pageSql(ctx) {
  setCrumbs([['Runs', href.runs()], ['SQL']]);
  const q = ctx.query;
  const canned = (await ctx.api('canned')).queries || {};
  const cannedName = q.get('canned') && canned[q.get('canned')] !== undefined ? q.get('canned') : '';
  const text = el('textarea', {id: 'sql-text', name: 'q', rows: 10, spellcheck: 'false',
    placeholder: 'SELECT run_id, step, avg(reward) FROM rollouts GROUP BY ALL ORDER BY ALL'});
  text.value = q.get('q') || (cannedName ? canned[cannedName].trim() : '');
  const runInput = el('input', {type: 'text', name: 'run', value: q.get('run') || '', placeholder: 'run (canned queries only)', class: 'run-input'});
  const select = selectInput('canned', [['', 'canned queries…'], ...Object.keys(canned).map((n) => [n, n])], cannedName, {id: 'sql-canned'});
  const csv = el('a', {id: 'sql-csv', class: 'button'}, 'Download CSV');
  const errBox = el('div', {id: 'sql-error', class: 'error-box', hidden: true, role: 'alert'});
  const result = el('div', {class: 'sql-result'}, el('table', {id: 'sql-result', class: 'grid'}));
  ctx.showError = (msg) => {
    errBox.textContent = msg;
    errBox.hidden = false;
    result.replaceChildren(el('table', {id: 'sql-result', class: 'grid'})); // no stale rows under an error
  };

  // A canned query whose text is untouched runs by name (so the server binds $run); anything
  // edited runs as plain SQL text.
  const current = () => {
    const name = select.value;
    if (name && text.value.trim() === String(canned[name]).trim()) return {canned: name, run: runInput.value.trim()};
    return {q: text.value};
  };
  const syncCsv = () => {
    const p = current();
    if (p.canned || p.q.trim()) { csv.setAttribute('href', 'api/sql' + qs(Object.assign({}, p, {format: 'csv'}))); csv.classList.remove('disabled'); }
    else { csv.removeAttribute('href'); csv.classList.add('disabled'); }
  };
  let seq = 0;
  const execute = async (params) => {
    const mine = ++seq;
    const data = await ctx.api('sql', params);
    if (mine !== seq) return; // a later Run superseded this one
    errBox.hidden = true;
    result.replaceChildren(...sqlResult(data));
  };
  // Run in place (the form and its elements stay), recording the query in the address so the
  // result is a link and Back returns to the previous query (hashchange re-renders then).
  const run = async () => {
    const p = current();
    if (!p.canned && !p.q.trim()) return;
    if (location.hash !== href.sql(p)) history.pushState(null, '', href.sql(p));
    setPageState('loading');
    try {
      await execute(p);
      if (ctx.alive()) setPageState('ready');
    } catch (e) {
      if (e instanceof Stale || !ctx.alive()) return;
      ctx.showError(e.message);
      setPageState('error', e.message);
    }
  };
  select.addEventListener('change', () => { if (select.value) text.value = String(canned[select.value]).trim(); syncCsv(); });
  text.addEventListener('input', syncCsv);
  runInput.addEventListener('input', syncCsv);
  text.addEventListener('keydown', (ev) => { if (ev.key === 'Enter' && (ev.ctrlKey || ev.metaKey)) { ev.preventDefault(); run(); } });
  syncCsv();

  $('#main').replaceChildren(el('h1', {}, 'SQL'),
    el('p', {class: 'muted'}, 'Read-only DuckDB over the store: rollouts, rewards, tool_calls, steps, … Ctrl+Enter runs.'),
    el('div', {class: 'toolbar'}, select, runInput),
    text,
    el('div', {class: 'toolbar'}, el('button', {id: 'sql-run', type: 'button', onclick: run}, 'Run'), csv),
    errBox, result);
  text.focus();
  if (cannedName) await execute({canned: cannedName, run: q.get('run') || ''});
  else if (q.get('q')) await execute({q: q.get('q')});
}

function sqlResult(data) {
  const cell = (v) => el('td', {class: typeof v === 'number' ? 'num' : v === null ? 'muted' : null},
    typeof v === 'number' ? fmt(v, 6) : v === null ? 'NULL' : fmt(v));
  return [
    el('div', {class: 'toolbar'}, el('span', {id: 'sql-count'}, `${data.row_count} row${data.row_count === 1 ? '' : 's'}`),
      data.truncated ? el('span', {class: 'warn-box inline', id: 'sql-truncated'},
        `truncated: showing the first ${data.rows.length} rows; Download CSV has every row`) : null),
    el('div', {class: 'table-wrap'}, table({id: 'sql-result'}, data.columns, data.rows.map((row) => el('tr', {}, row.map(cell)))))];
}

// ---------------------------------------------------------------- start

window.addEventListener('hashchange', route);
window.addEventListener('DOMContentLoaded', route);
