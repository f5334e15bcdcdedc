// The classroom page: a chat box that streams, and a panel polling /engine/stats.
"use strict";
const $ = (id) => document.getElementById(id);
const HISTORY = 60;              // bars in the batch-size chart
const batches = [];

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = $("api-key").value || localStorage.getItem("apiKey");
  if (key) h["Authorization"] = "Bearer " + key;
  return h;
}

async function ask(prompt) {
  $("answer").textContent = ""; $("ttft").textContent = "…"; $("rate").textContent = "…";
  if ($("api-key").value) localStorage.setItem("apiKey", $("api-key").value);
  const start = performance.now();
  let first = null, pieces = 0, tokens = null;
  const r = await fetch("/v1/chat/completions", { method: "POST", headers: headers(), body: JSON.stringify(
    { messages: [{ role: "user", content: prompt }], max_tokens: 128, stream: true }) });
  if (!r.ok) {
    const err = await r.json().catch(() => ({}));
    if (r.status === 401) $("api-key").hidden = false;
    $("answer").textContent = "Error " + r.status + ": " + ((err.error || {}).message || r.statusText);
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
      if (obj.error) { $("answer").textContent += "\n[" + obj.error.message + "]"; continue; }
      const piece = ((obj.choices || [])[0] || {}).delta?.content;
      if (piece) {
        if (first === null) { first = performance.now(); $("ttft").textContent = Math.round(first - start) + " ms"; }
        $("answer").textContent += piece; pieces++;
      }
      if (obj.metrics) tokens = obj.metrics.output_tokens;
    }
  }
  const n = tokens ?? pieces, end = performance.now();
  if (first !== null && n > 1) $("rate").textContent = ((n - 1) / ((end - first) / 1000)).toFixed(1);
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

async function poll() {
  try {
    const s = await (await fetch("/engine/stats")).json();
    $("engine-name").textContent = s.engine;
    if (s.features) { $("features").hidden = false; $("features").textContent = describeFeatures(s.features); }
    for (const k of ["waiting", "running", "served"]) $(k).textContent = s[k];
    $("tokens-per-s").textContent = s.tokens_per_s; $("window").textContent = s.window_s;
    if (s.kv_blocks_used !== undefined) { $("kv").hidden = false; $("kv-blocks").textContent = s.kv_blocks_used; }
    // An engine that batches reports its recent steps; the queue-based server's batch is who runs now.
    const recent = Array.isArray(s.batch_sizes) ? s.batch_sizes : [s.running];
    batches.push(...recent); batches.splice(0, Math.max(0, batches.length - HISTORY));
    const top = Math.max(1, ...batches);
    $("batches").replaceChildren(...batches.map((b) => {
      const bar = document.createElement("div"); bar.style.height = (100 * b / top) + "%"; bar.title = b; return bar;
    }));
  } catch (e) { /* the server restarting: try again on the next tick */ }
}

$("ask").addEventListener("submit", (e) => { e.preventDefault(); ask($("prompt").value); });
poll(); setInterval(poll, 500);
