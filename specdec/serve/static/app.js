// The page of `specdec serve`: a prompt streams its completion over the server's own OpenAI API
// (POST /v1/completions or /v1/chat/completions with stream: true), each piece of text coloured by
// the kind of token that produced it (the non-standard `specdec.pieces` field of every chunk), with
// live alpha, tau and tokens/s; and the server's load, polled from GET /stats every second.
// No libraries, no network but this server.
"use strict";

const $ = (id) => document.getElementById(id);
const POLL_MS = 1000;
let controller = null; // the AbortController of the generation in flight

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = $("api-key").value.trim();
  if (key) h["Authorization"] = "Bearer " + key;
  return h;
}

function setStatus(id, text, error = false) {
  const el = $(id);
  el.textContent = text;
  el.classList.toggle("error", error);
}

// what to show of a refused request: a 401 points to the page's own key box (the server's message speaks of headers)
function failure(res, body, what) {
  if (res.status === 401) {
    return $("api-key").value.trim()
      ? "the key in the API key box is not this server's: type the key it was started with (--api-key or $SPECDEC_API_KEY)"
      : "this server needs its API key: type it in the API key box above";
  }
  return (body.error && body.error.message) || `${what}: HTTP ${res.status}`;
}

function needKey(status) {
  $("key-label").classList.toggle("needed", status === 401);
}

function fixed(x, digits) {
  return Number.isFinite(x) ? x.toFixed(digits) : "–";
}

async function loadModels() {
  try {
    const res = await fetch("/v1/models", { headers: headers() });
    needKey(res.status);
    if (!res.ok) {
      const body = await res.json().catch(() => ({}));
      setStatus("status", failure(res, body, "/v1/models"), true);
      return;
    }
    const body = await res.json();
    const select = $("model");
    const chosen = select.value;
    select.replaceChildren(...body.data.map((m) => new Option(m.id, m.id)));
    if (chosen) select.value = chosen;
    setStatus("status", "");
  } catch (err) {
    setStatus("status", "cannot reach the server: " + err, true);
  }
}

// ------------------------------------------------------------------------------------ generate

function resetFigures() {
  for (const id of ["alpha", "tau", "tps"]) $(id).textContent = "–";
  $("ntokens").textContent = "0";
  $("rounds").textContent = "0";
}

function showFigures(s, seconds) {
  $("alpha").textContent = s.drafted ? fixed(s.acceptance_rate, 2) : "–";
  $("tau").textContent = fixed(s.mean_accepted_length, 2);
  $("ntokens").textContent = String(s.completion_tokens);
  $("rounds").textContent = String(s.rounds);
  if (seconds > 0) $("tps").textContent = fixed(s.completion_tokens / seconds, 1);
}

function appendPieces(pieces) {
  const out = $("output");
  for (const p of pieces) {
    if (!p.text) continue;
    const span = document.createElement("span");
    span.className = "tok " + p.kind;
    span.title = p.kind;
    span.textContent = p.text;
    out.appendChild(span);
  }
  out.scrollTop = out.scrollHeight;
}

function handleEvent(data, started) {
  if (data === "[DONE]") return true;
  const chunk = JSON.parse(data);
  if (chunk.error) {
    setStatus("status", chunk.error.message, true);
    return true;
  }
  const seconds = (performance.now() - started) / 1000;
  if (chunk.specdec) {
    appendPieces(chunk.specdec.pieces || []);
    showFigures(chunk.specdec, seconds);
    if (chunk.specdec.stop_reason) setStatus("status", `done: ${chunk.specdec.stop_reason}`);
  }
  if (chunk.usage && chunk.usage.speculation) {
    const sp = chunk.usage.speculation;
    setStatus("status", `done: ${chunk.usage.completion_tokens} tokens in ${fixed(seconds, 2)} s, ` +
      `${sp.rounds} rounds, ${sp.drafted} drafted, ${sp.accepted} accepted` + (sp.lossless ? ", lossless" : ""));
  }
  return false;
}

async function generate(event) {
  event.preventDefault();
  if (controller) return;
  const chat = $("endpoint").value === "chat";
  const body = {
    model: $("model").value || undefined,
    max_tokens: Number($("max-tokens").value),
    temperature: Number($("temperature").value),
    stream: true,
    stream_options: { include_usage: true },
  };
  if (chat) body.messages = [{ role: "user", content: $("prompt").value }];
  else body.prompt = $("prompt").value;
  $("output").replaceChildren();
  resetFigures();
  setStatus("status", "waiting for the first round…");
  document.body.dataset.state = "running";
  controller = new AbortController();
  $("generate").disabled = true;
  $("stop").disabled = false;
  const started = performance.now();
  try {
    const res = await fetch(chat ? "/v1/chat/completions" : "/v1/completions", {
      method: "POST", headers: headers(), body: JSON.stringify(body), signal: controller.signal,
    });
    needKey(res.status);
    if (!res.ok) {
      const err = await res.json().catch(() => ({}));
      setStatus("status", failure(res, err, "generation"), true);
      return;
    }
    if (!$("model").value) loadModels();
    const reader = res.body.getReader();
    const decoder = new TextDecoder();
    let buffer = "";
    let finished = false;
    while (!finished) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      let end;
      while (!finished && (end = buffer.indexOf("\n\n")) >= 0) {
        const lines = buffer.slice(0, end).split("\n");
        buffer = buffer.slice(end + 2);
        for (const line of lines) {
          if (line.startsWith("data: ") && handleEvent(line.slice(6), started)) finished = true;
        }
      }
    }
  } catch (err) {
    if (err.name === "AbortError") setStatus("status", "stopped");
    else setStatus("status", String(err), true);
  } finally {
    controller = null;
    $("generate").disabled = false;
    $("stop").disabled = true;
    document.body.dataset.state = "done";
  }
}

// ---------------------------------------------------------------------------------------- load

function drawChart(history) {
  const canvas = $("chart");
  const ctx = canvas.getContext("2d");
  const w = canvas.width, h = canvas.height, pad = 34;
  ctx.clearRect(0, 0, w, h);
  ctx.strokeStyle = "#d8dde2";
  ctx.strokeRect(pad, 8, w - 2 * pad, h - pad - 8);
  if (history.length < 2) return;
  const t0 = history[history.length - 1].time - 120;
  const x = (t) => pad + ((t - t0) / 120) * (w - 2 * pad);
  const maxTps = Math.max(1, ...history.map((s) => s.tokens_per_s));
  const maxRows = Math.max(1, ...history.map((s) => s.running + s.waiting));
  const y = (v, max) => h - pad - (v / max) * (h - pad - 16);
  ctx.fillStyle = "#66707a";
  ctx.font = "11px system-ui, sans-serif";
  ctx.fillText(maxTps.toFixed(0), 2, 18);
  ctx.fillText("0", 2, h - pad);
  ctx.fillText(String(maxRows), w - pad + 4, 18);
  ctx.fillText("-2 min", pad, h - pad + 14);
  ctx.fillText("now", w - pad - 18, h - pad + 14);
  const line = (value, max, colour) => {
    ctx.strokeStyle = colour;
    ctx.lineWidth = 2;
    ctx.beginPath();
    history.filter((s) => s.time >= t0).forEach((s, i) => {
      const px = x(s.time), py = y(value(s), max);
      if (i === 0) ctx.moveTo(px, py); else ctx.lineTo(px, py);
    });
    ctx.stroke();
  };
  line((s) => s.running, maxRows, "#d4a72c");
  line((s) => s.tokens_per_s, maxTps, "#1f6feb");
}

async function pollLoad() {
  try {
    const res = await fetch("/stats", { headers: headers() });
    needKey(res.status);
    if (!res.ok) {
      const body = await res.json().catch(() => ({}));
      setStatus("load-status", failure(res, body, "/stats"), true);
      return;
    }
    const m = (await res.json()).models[0];
    const last = m.history.length ? m.history[m.history.length - 1] : null;
    $("server").textContent = `${m.id}: drafter ${m.drafter}, gamma ${m.gamma}, schedule ${m.schedule}, speculate ${m.speculate}, ` +
      `batch size ${m.batch_size}, ${m.device}`;
    $("running").textContent = String(m.running);
    $("waiting").textContent = String(m.waiting);
    $("batch").textContent = last ? fixed(last.batch, 1) : "–";
    $("load-tps").textContent = last ? fixed(last.tokens_per_s, 1) : "–";
    $("load-alpha").textContent = m.totals.drafted ? fixed(m.acceptance_rate, 2) : "–";
    $("load-tau").textContent = m.totals.rounds ? fixed(m.mean_accepted_length, 2) : "–";
    $("requests").textContent = String(m.totals.requests);
    setStatus("load-status", "");
    drawChart(m.history);
  } catch (err) {
    setStatus("load-status", "cannot reach the server: " + err, true);
  }
}

$("form").addEventListener("submit", generate);
$("stop").addEventListener("click", () => controller && controller.abort());
$("api-key").addEventListener("change", () => { loadModels(); pollLoad(); });
loadModels();
pollLoad();
setInterval(pollLoad, POLL_MS);
