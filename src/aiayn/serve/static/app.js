// The page of `aiayn serve`: translate, list the n-best, draw the cross-attention on a canvas.
// Plain JavaScript, no libraries: it reads /v1/info and /frontend/settings and posts to /v1/translate.
// Several served pairs: a selector; a server that asks for keys: a key field (kept in localStorage).
"use strict";

const $ = (id) => document.getElementById(id);
const HOT = "214, 56, 36";  // the heatmap's colour (rgb), its alpha is the attention weight
const KEY_STORE = "aiayn.apiKey";
const state = { result: null, units: [], matrix: [], focus: -1, models: [], keyRequired: false, beam: 4, maxNbest: 4,
                pending: null };  // pending: the AbortController of the request in flight

// The server's answer: its JSON, or {error: its text} when it is not JSON (uvicorn's own 503 is plain text).
async function readBody(r) {
  const text = await r.text();
  try {
    return JSON.parse(text);
  } catch {
    return { error: text.trim() || r.statusText };
  }
}

async function getJSON(url) {
  const r = await fetch(url);
  const data = await readBody(r);
  if (!r.ok) throw new Error(`${r.status}: ${data.error || r.statusText}`);
  return data;
}

async function loadInfo() {
  const [info, settings] = await Promise.all([getJSON("/v1/info"), getJSON("/frontend/settings")]);
  state.models = info.models;
  const pairs = $("pairs");
  info.models.forEach((m, i) => pairs.add(new Option(`${m.languages.source} → ${m.languages.target}`, String(i))));
  $("pair-choice").hidden = info.models.length < 2;
  $("pair").hidden = info.models.length > 1;
  $("beam").value = state.beam = info.limits.beam;
  $("beam").max = info.limits.max_beam;
  state.maxNbest = info.limits.max_nbest;  // more n-best than --max-nbest: a 422 for every request
  state.keyRequired = Boolean(settings.keyRequired);
  $("key-choice").hidden = !state.keyRequired;
  $("api-key").value = localStorage.getItem(KEY_STORE) || "";
  choosePair();
}

function model() {
  return state.models[Number($("pairs").value) || 0];
}

function choosePair() {
  const m = model();
  $("pair").textContent = `${m.languages.source} → ${m.languages.target}`;
  const layers = $("layer"), keep = layers.value;
  layers.replaceChildren(new Option("mean of layers", "mean"));
  for (let l = 0; l < m.model.decoder_layers; l++) layers.add(new Option(`layer ${l + 1}`, String(l)));
  layers.value = keep && keep < m.model.decoder_layers ? keep : "mean";
}

function showError(message) {
  $("error").textContent = message;
  $("error").hidden = !message;
}

async function translate() {
  const lines = $("source").value.split("\n");
  if (!lines.some((l) => l.trim())) return;
  const beam = Number($("beam").value) || state.beam;  // a cleared field: the server's defaults, not 0
  const alpha = $("alpha").value === "" ? undefined : Number($("alpha").value);  // (undefined: not sent)
  const { source, target } = model().languages;
  const body = { text: lines, beam, alpha, nbest: Math.min(4, beam, state.maxNbest), attention: true, source, target };
  const headers = { "Content-Type": "application/json" };
  const key = $("api-key").value.trim();
  // in the head, never in a URL: a large body is then held as a known client's (aiayn.serve.clients);
  // a header carries one byte a character, so a key that is not ASCII goes in the body (LibreTranslate's field)
  if (state.keyRequired && key) {
    if (/^[\x20-\x7e]+$/.test(key)) headers["X-API-Key"] = key;
    else body.api_key = key;
  }
  drop();
  const asked = state.pending = new AbortController();
  $("go").disabled = true;
  $("status").textContent = "translating…";
  showError("");
  try {
    const r = await fetch("/v1/translate", { method: "POST", headers, body: JSON.stringify(body),
                                            signal: asked.signal });
    const data = await readBody(r);
    if (asked !== state.pending) return;  // a newer request (or pair) replaced this one: its answer is stale
    if (!r.ok) throw new Error(`${r.status}: ${data.error || r.statusText}`);
    state.result = data;
    $("translation").textContent = data.translations.map((t) => t.hypotheses[0].text).join("\n");
    fillUnits(lines);
    $("inside").hidden = false;
    show();
  } catch (e) {
    if (asked !== state.pending) return;
    clearResult();  // the last translation answered another text: never left beside this error
    showError(String(e.message || e));
  } finally {
    if (asked === state.pending) drop();
  }
}

function clearResult() {
  state.result = null;
  $("inside").hidden = true;
  $("translation").textContent = "";
}

// Forgets the request in flight (the server drops its lines once the connection closes): Ctrl+Enter
// or a pair chosen while one is in flight must not see the older answer, if late, overwrite the newer.
function drop() {
  if (state.pending) state.pending.abort();
  state.pending = null;
  $("go").disabled = false;
  $("status").textContent = "";
}

// What the line selector offers: each line, or each sentence of a line the server cut into several.
function fillUnits(lines) {
  state.units = [];
  state.result.translations.forEach((t, i) => {
    if (!lines[i].trim()) return;
    if (!t.sentences) state.units.push({ label: `${i + 1}: ${clip(lines[i])}`, result: t });
    else t.sentences.forEach((s, j) => state.units.push({ label: `${i + 1}.${j + 1}: ${clip(s.source)}`, result: s }));
  });
  $("line").replaceChildren(...state.units.map((u, k) => new Option(u.label, String(k))));
}

// The first 40 characters of a text: code points, not UTF-16 units (never half of an emoji).
function clip(text) {
  return Array.from(text).slice(0, 40).join("");
}

function fillHyps(hyps) {
  const sel = $("hyp");
  const keep = Math.min(Number(sel.value) || 0, hyps.length - 1);
  sel.replaceChildren(...hyps.map((_, i) => new Option(String(i + 1), String(i))));
  sel.value = String(keep);
}

function current() {
  const line = state.units[Number($("line").value)].result;
  return { line, hyp: line.hypotheses[Number($("hyp").value) || 0] };
}

// (T, S) weights of one decoder layer, or their mean over layers
function layerMatrix(attention, choice) {
  if (!attention || !attention.length) return [];
  if (choice !== "mean") return attention[Number(choice)];
  return attention[0].map((row, t) => row.map((_, s) =>
    attention.reduce((sum, layer) => sum + layer[t][s], 0) / attention.length));
}

function show() {
  const line = state.units[Number($("line").value)].result;
  fillHyps(line.hypotheses);
  const { hyp } = current();
  $("nbest").replaceChildren(...line.hypotheses.map((h) => {
    const li = document.createElement("li");
    li.textContent = h.text;
    li.dir = "auto";  // a right-to-left target (Arabic, Hebrew) laid out as such, as the translation is
    const score = document.createElement("span");
    score.className = "score";
    score.textContent = h.score === null ? "greedy" : h.score.toFixed(4);
    li.append(score);
    return li;
  }));
  state.matrix = layerMatrix(hyp.attention, $("layer").value);
  $("src-tokens").replaceChildren(...line.source_tokens.map((p, i) => chip(p, i, "src-token")));
  $("tgt-tokens").replaceChildren(...hyp.tokens.map((p, i) => {
    const c = chip(p, i, "tgt-token");
    c.tabIndex = 0;  // Tab reaches each target token: focused, it shows its attention as hovered
    for (const [on, off] of [["mouseenter", "mouseleave"], ["focus", "blur"]]) {
      c.addEventListener(on, () => focus(i));
      c.addEventListener(off, () => focus(-1));
    }
    return c;
  }));
  focus(-1);
}

function chip(text, i, kind) {
  const span = document.createElement("span");
  span.className = `tok ${kind}`;
  span.dataset.index = String(i);
  span.textContent = text;
  return span;
}

// Highlights the source tokens that target token t attends to (t = -1: none).
function focus(t) {
  state.focus = t;
  const row = t >= 0 ? state.matrix[t] : null;
  const top = row ? row.indexOf(Math.max(...row)) : -1;
  document.querySelectorAll(".src-token").forEach((el, s) => {
    el.style.backgroundColor = row ? `rgba(${HOT}, ${row[s].toFixed(3)})` : "";
    el.classList.toggle("focus", s === top);
    el.title = row ? `attention ${row[s].toFixed(3)}` : "";
  });
  document.querySelectorAll(".tgt-token").forEach((el, i) => el.classList.toggle("active", i === t));
  $("src-tokens").dataset.focus = String(top);
  draw();
}

function draw() {
  const { line, hyp } = current();
  const m = state.matrix, src = line.source_tokens, tgt = hyp.tokens;
  const canvas = $("heatmap"), ctx = canvas.getContext("2d");
  const font = "12px ui-monospace, Menlo, Consolas, monospace";
  ctx.font = font;
  const cell = 24;
  const left = Math.max(40, ...tgt.map((p) => ctx.measureText(p).width)) + 12;
  const top = Math.max(40, ...src.map((p) => ctx.measureText(p).width)) * 0.75 + 16;
  const width = left + cell * src.length + 10, height = top + cell * tgt.length + 10;
  const ratio = window.devicePixelRatio || 1;
  canvas.width = width * ratio;
  canvas.height = height * ratio;
  canvas.style.width = `${width}px`;
  canvas.style.height = `${height}px`;
  ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
  ctx.clearRect(0, 0, width, height);
  ctx.font = font;
  m.forEach((row, t) => row.forEach((w, s) => {
    ctx.fillStyle = `rgba(${HOT}, ${w})`;
    ctx.fillRect(left + s * cell, top + t * cell, cell - 1, cell - 1);
  }));
  ctx.strokeStyle = "#d8dce3";
  ctx.strokeRect(left - 0.5, top - 0.5, cell * src.length, cell * tgt.length);
  ctx.fillStyle = "#1d2330";
  ctx.textAlign = "right";
  ctx.textBaseline = "middle";
  tgt.forEach((p, t) => ctx.fillText(p, left - 6, top + t * cell + cell / 2));
  src.forEach((p, s) => {  // column labels, slanted
    ctx.save();
    ctx.translate(left + s * cell + cell / 2, top - 6);
    ctx.rotate(-Math.PI / 4);
    ctx.textAlign = "left";
    ctx.fillText(p, 0, 0);
    ctx.restore();
  });
  if (state.focus >= 0) {
    ctx.strokeStyle = "#2456c8";
    ctx.lineWidth = 2;
    ctx.strokeRect(left - 1, top + state.focus * cell - 1, cell * src.length + 1, cell + 1);
    ctx.lineWidth = 1;
  }
  canvas.dataset.rows = String(tgt.length);
  canvas.dataset.cols = String(src.length);
  canvas.onmousemove = (e) => {
    const t = Math.floor((e.offsetY - top) / cell);
    if (t !== state.focus) focus(t >= 0 && t < tgt.length ? t : -1);
  };
  canvas.onmouseleave = () => focus(-1);
}

$("source").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && (e.ctrlKey || e.metaKey)) {
    e.preventDefault();
    translate();
  }
});
$("go").addEventListener("click", translate);
$("line").addEventListener("change", () => { $("hyp").value = "0"; show(); });
$("hyp").addEventListener("change", show);
$("layer").addEventListener("change", show);
$("pairs").addEventListener("change", () => {
  drop();
  choosePair();
  clearResult();
});
$("api-key").addEventListener("input", () => localStorage.setItem(KEY_STORE, $("api-key").value.trim()));
loadInfo().catch((e) => showError(`cannot reach the server: ${e.message || e}`));
