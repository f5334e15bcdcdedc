// The classroom page: a chat box that streams, a panel polling /engine/stats and, for an engine
// with a scheduler, the scheduler's requests and KV blocks from /engine/scheduler.
"use strict";
const $ = (id) => document.getElementById(id);
const HISTORY = 60;              // bars in the batch-size chart
const batches = [];

// A server started with --api-key answers 401 to the chat and, unless it has a --metrics-key,
// to both pollers. The key lives in sessionStorage: typed once per tab, kept across reloads,
// and gone when the tab closes (a classroom's shared machines should not keep it).
let apiKey = sessionStorage.getItem("apiKey") || "";
const refused = new Set();   // the routes whose last answer was a 401

function headers() {
  const h = { "Content-Type": "application/json" };
  if (apiKey) h["Authorization"] = "Bearer " + apiKey;
  return h;
}

// Every request goes through here: a 401 from any of them shows the key field at once, and the
// notice goes away when every route that refused has answered since.
async function call(route, options = {}) {
  const r = await fetch(route, { ...options, headers: headers() });
  const path = route.split("?")[0];
  if (r.status === 401) refused.add(path); else refused.delete(path);
  const form = $("key-form"), wasHidden = form.hidden;
  form.hidden = refused.size === 0;
  $("key-notice").textContent = apiKey
    ? "The server refused this API key (for " + [...refused].join(", ") + "). Check it and type it again:"
    : "This server needs an API key (it was started with --api-key). Type the one you were given:";
  if (wasHidden && !form.hidden && document.activeElement !== $("prompt")) $("api-key").focus();
  return r;
}

$("key-form").addEventListener("submit", (e) => {
  e.preventDefault();
  apiKey = $("api-key").value.trim();
  sessionStorage.setItem("apiKey", apiKey);
  $("api-key").value = "";
  tick();   // the pollers try the key at once, not at their next tick
});

// The conversation so far: every turn goes out again with the next question, as a chat client
// does (the model remembers nothing between requests). The last MAX_TURNS messages, at most.
const MAX_TURNS = 12;
let conversation = [];

function turn(role, text) {
  const div = document.createElement("div");
  div.className = "turn " + role; div.textContent = text;
  $("answer").append(div);
  $("answer").scrollTop = $("answer").scrollHeight;
  return div;
}

$("new-chat").addEventListener("click", () => { conversation = []; $("answer").replaceChildren(); });

async function ask(prompt) {
  $("ttft").textContent = "…"; $("rate").textContent = "…";
  turn("user", prompt);
  const shown = turn("assistant", "");
  const messages = [...conversation, { role: "user", content: prompt }].slice(-MAX_TURNS);
  const start = performance.now();
  let first = null, pieces = 0, tokens = null, text = "";
  const r = await call("/v1/chat/completions", { method: "POST", body: JSON.stringify(
    { messages, max_tokens: 128, stream: true }) });
  if (!r.ok) {
    const err = await r.json().catch(() => ({}));
    shown.textContent = "Error " + r.status + ": " + ((err.error || {}).message || r.statusText);
    shown.classList.add("error");
    $("ttft").textContent = "-"; $("rate").textContent = "-";
    return;
  }
  const reader = r.body.getReader(), decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { done, value } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    const events = buffer.split("\n\n"); buffer = events.pop();
    for (const event of events) {
      const data = event.replace(/^data: /, "").trim();
      if (!data || data === "[DONE]") continue;
      const obj = JSON.parse(data);
      if (obj.error) { shown.textContent += "\n[" + obj.error.message + "]"; continue; }
      const piece = ((obj.choices || [])[0] || {}).delta?.content;
      if (piece) {
        if (first === null) { first = performance.now(); $("ttft").textContent = Math.round(first - start) + " ms"; }
        text += piece; shown.textContent = text; pieces++;
        $("answer").scrollTop = $("answer").scrollHeight;   // a long answer scrolls in its box: the chat stays in view
      }
      if (obj.metrics) tokens = obj.metrics.output_tokens;
    }
  }
  // The answer's size and time, not a second tokens/s beside the engine's: one rate on the page.
  const n = tokens ?? pieces, end = performance.now();
  $("rate").textContent = n + " tokens in " + ((end - start) / 1000).toFixed(1) + " s";
  conversation = [...messages, { role: "assistant", content: text }];
}

// The engine's features as one line: on/off switches by name, settings with their value
// (its class is in the title already).
function describeFeatures(features) {
  return Object.entries(features).filter(([k, v]) => k !== "engine" && v !== false && v !== null).map(([k, v]) => {
    const name = k.replace(/_/g, " ");
    if (v === true) return name;
    if (k.endsWith("memory") && typeof v === "number") return name + " " + Math.round(v / 2 ** 20) + " MiB";
    return name + " " + v;
  }).join(" · ");
}

// The batch-size chart: one bar per engine step, each step drawn once. The page asks for the steps
// after the last one it has (?since=), so a poll never brings back history it already drew.
let lastStep = -1, scheduling = null;   // null: not known yet (the first answers may come in any order)

function drawBars() {
  batches.splice(0, Math.max(0, batches.length - HISTORY));
  const top = Math.max(1, ...batches);
  $("y-top").textContent = top;   // the axis: 0 at the bottom, the tallest bar's requests at the top
  $("x-left").textContent = scheduling ? "-" + batches.length + " steps" : "-" + batches.length / 2 + " s";
  $("x-unit").textContent = scheduling ? "engine steps, newest at the right" : "time, newest at the right";
  $("batches").replaceChildren(...batches.map((b) => {
    const bar = document.createElement("div"); bar.style.height = (100 * b / top) + "%"; bar.title = b; return bar;
  }));
}

async function poll() {
  try {
    const r = await call("/engine/stats");
    if (!r.ok) return;   // 401: the key field is up; anything else: try again on the next tick
    const s = await r.json();
    $("engine-name").textContent = s.engine;
    if (s.features) { $("features").hidden = false; $("features").textContent = describeFeatures(s.features); }
    for (const k of ["waiting", "running", "served"]) $(k).textContent = s[k];
    $("tokens-per-s").textContent = s.tokens_per_s; $("window").textContent = s.window_s;
    if (s.kv_blocks_used !== undefined) { $("kv").hidden = false; $("kv-blocks").textContent = s.kv_blocks_used; }
    if (scheduling === false) { batches.push(s.running); drawBars(); }   // no steps to show: who runs now, sampled
  } catch (e) { /* the server restarting: try again on the next tick */ }
}

// The scheduler (Chapter 9's engine): a row per request, the KV pool as a grid coloured by owner.
const STATES = { waiting: "waiting", prefill: "prefill", decode: "decode", preempted: "preempted", finished: "finished" };
// A request's colour: golden-angle hues, so neighbouring ids get distant ones, in three shades
// (hues alone repeat too closely for thirty requests).
function paint(el, id) {
  el.style.setProperty("--hue", Math.round((id * 137.508) % 360));
  el.style.setProperty("--shade", (id % 3 - 1) * 12 + "%");
}

function stateCell(row) {
  const td = document.createElement("td"), badge = document.createElement("span");
  badge.className = "state " + (STATES[row.state] || "waiting");
  badge.textContent = row.state === "finished" ? (row.finish_reason || "aborted") : row.state;
  td.append(badge);
  if (row.state === "prefill") {   // chunk by chunk: how much of its prompt has K/V already
    const bar = document.createElement("progress");
    bar.max = row.total; bar.value = row.computed; bar.title = row.computed + " / " + row.total + " tokens";
    const n = document.createElement("span"); n.className = "progress"; n.textContent = row.computed + "/" + row.total;
    td.append(bar, n);
  }
  if (row.preemptions) td.append(" ↺" + row.preemptions);
  return td;
}

function drawRows(s) {
  $("requests").tBodies[0].replaceChildren(...s.rows.map((row) => {
    const tr = document.createElement("tr");
    tr.className = row.state; tr.dataset.id = row.id;
    const id = document.createElement("td"), swatch = document.createElement("i");
    swatch.className = "swatch"; paint(swatch, row.id);
    id.append(swatch, "r" + row.id);
    const cell = (text) => { const td = document.createElement("td"); td.textContent = text; return td; };
    tr.append(id, stateCell(row), cell(row.prompt_tokens + (row.cached_tokens ? " (" + row.cached_tokens + " cached)" : "")),
              cell(row.tokens + " / " + row.budget), cell(row.ttft_ms === null ? "-" : Math.round(row.ttft_ms) + " ms"));
    return tr;
  }));
  $("rows-note").hidden = s.rows_total <= s.rows.length;
  $("rows-note").textContent = "showing " + s.rows.length + " of " + s.rows_total + " requests";
}

function drawBlocks(b) {
  const grid = $("kv-grid");
  if (grid.children.length !== b.shown) {   // cells are made once and restyled on every poll
    grid.replaceChildren(...Array.from({ length: b.shown }, () => document.createElement("i")));
  }
  fitCells(grid, b.shown);
  const owners = b.owner;
  for (let i = 0; i < b.shown; i++) {
    const cell = grid.children[i], o = owners[i], refs = b.refs[i], cached = b.cached.length ? b.cached[i] : 0;
    // -2: another tenant's block (a tenant's key sees its own requests only, and how full the pool is)
    const cls = "kv" + (o >= 0 ? " owned" : o === -2 ? " others" : "") + (refs > 1 ? " shared" : "") + (o < 0 && cached ? " cached" : "");
    if (cell.className !== cls) cell.className = cls;
    if (o >= 0) { paint(cell, o); cell.dataset.owner = o; }
    else { delete cell.dataset.owner; }
    cell.title = "block " + i + (o >= 0 ? ": r" + o + (refs > 1 ? ", " + refs + " requests" : "") : o === -2 ? ": another key's" : cached ? ": cached" : ": free");
  }
  const used = owners.filter((o) => o >= 0).length;
  $("legend-others").hidden = !owners.includes(-2);
  $("kv-summary").textContent = (b.total - b.free) + " of " + b.total + " blocks in use · " + b.block_size +
    " tokens each" + (b.prefix_caching ? " · prefix caching on" : "");
  $("kv-note").hidden = b.shown === b.total;
  $("kv-note").textContent = "drawing the first " + b.shown + " of " + b.total + " blocks (" + used + " of them in use)";
}

// The largest square cell with which the whole pool fits the grid's box (its width, and the height
// its column leaves it), so the pool is on screen at once, however many blocks it has.
function fitCells(grid, n) {
  const projector = window.innerWidth > 900;   // style.css: there the grid's box has the height it may use
  const w = grid.clientWidth, h = projector ? grid.clientHeight : Infinity;
  let cell = 28;
  while (cell > 4 && Math.floor((w + 2) / (cell + 2)) * Math.floor((h + 2) / (cell + 2)) < n) cell--;
  const px = cell + "px";
  if (grid.style.getPropertyValue("--cell") !== px) grid.style.setProperty("--cell", px);
}

async function pollScheduler() {
  try {
    const r = await call("/engine/scheduler?since=" + lastStep);
    if (!r.ok) return;
    const s = await r.json();
    if (s.available === null) return;   // a first step still running: ask again
    scheduling = !!s.available;
    $("scheduler").hidden = !scheduling;
    document.body.classList.toggle("scheduling", scheduling);   // the panel's copies of its figures step aside
    if (!scheduling) return;
    if (s.step < lastStep) { lastStep = -1; batches.length = 0; }   // a new server: start the chart again
    for (const [n, size] of s.steps) if (n > lastStep) { batches.push(size); lastStep = n; }
    $("batches-title").textContent = "batch size (requests in one step) of the last " + HISTORY + " steps";
    drawBars();
    $("step").textContent = s.step; $("steps-per-s").textContent = s.steps_per_s;
    $("gen-per-s").textContent = s.tokens_per_s; $("gen-window").textContent = s.window_s;
    $("sched-running").textContent = s.running + " / " + s.max_num_seqs;
    $("sched-waiting").textContent = s.waiting; $("sched-preemptions").textContent = s.preemptions;
    drawRows(s); drawBlocks(s.blocks);
  } catch (e) { /* as above */ }
}

$("ask").addEventListener("submit", (e) => { e.preventDefault(); ask($("prompt").value); });
// Twice a second; the next poll starts when this one has ended, so a slow server never piles them up.
// A key typed in starts the next one at once, or right after the one in flight.
let polling = false, again = false, timer = null;
async function tick() {
  clearTimeout(timer);
  if (polling) { again = true; return; }
  polling = true;
  try { await Promise.all([pollScheduler(), poll()]); } finally { polling = false; }
  timer = setTimeout(tick, again ? 0 : 500); again = false;
}
tick();
