// Chat page: keeps the conversation, streams replies from /v1/chat/completions (SSE),
// and shows under each reply its time to first token and the prompt tokens from the cache.
// With adapters served, a picker chooses the request's model; a vision model takes an image
// attached to a message (sent as an image_url content part with a data: URL). A reasoning
// model's reasoning_content shows in a folded block above the reply, and tool calls (from
// requests with tools) as name(arguments) lines under it.
"use strict";
const $ = (id) => document.getElementById(id);
const history = [];
let busy = false;

function addMessage(role, text, image) {
  const el = document.createElement("div");
  el.className = "msg " + role;
  if (image) {
    const img = document.createElement("img");
    img.className = "thumb";
    img.src = image;
    el.appendChild(img);
  }
  const body = document.createElement("div");
  body.className = "text";
  body.textContent = text;
  el.appendChild(body);
  $("log").appendChild(el);
  el.scrollIntoView({ block: "end" });
  return el;
}

// The element of a reply part (reasoning or tool calls), made on first use above/below the text.
function partEl(el, kind) {
  let part = el.querySelector("." + kind);
  if (part) return part;
  if (kind === "reasoning") {
    const box = document.createElement("details");
    box.open = true;
    box.innerHTML = "<summary>reasoning</summary>";
    part = document.createElement("div");
    part.className = "reasoning";
    box.appendChild(part);
    el.insertBefore(box, el.querySelector(".text"));
  } else {
    part = document.createElement("div");
    part.className = "tool-calls";
    el.insertBefore(part, el.querySelector(".text").nextSibling);
  }
  return part;
}

// Yields the JSON payload of each `data:` event until `data: [DONE]`.
async function* sseEvents(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { done, value } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data: ")) continue;
        if (line === "data: [DONE]") return;
        yield JSON.parse(line.slice(6));
      }
    }
  }
}

function showStats(el, ttftMs, totalMs, usage) {
  const stats = document.createElement("div");
  stats.className = "stats";
  const cached = usage ? usage.prompt_tokens_details.cached_tokens : 0;
  stats.innerHTML = usage
    ? `time to first token <b>${ttftMs.toFixed(0)} ms</b> · <b>${cached}</b> of ${usage.prompt_tokens} ` +
      `prompt tokens from the cache · ${usage.completion_tokens} tokens in ${(totalMs / 1000).toFixed(2)} s`
    : `time to first token ${ttftMs.toFixed(0)} ms`;
  el.appendChild(stats);
  el.dataset.cachedTokens = String(cached);
  el.dataset.ttftMs = ttftMs.toFixed(1);
}

// The attached image as a data: URL (null when none), and the file input cleared.
function takeImage() {
  const input = $("image"), file = input && input.files[0];
  if (!file) return Promise.resolve(null);
  input.value = "";
  return new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => resolve(reader.result);
    reader.onerror = () => reject(reader.error);
    reader.readAsDataURL(file);
  });
}

async function send(text) {
  busy = true;
  $("send").disabled = true;
  const image = await takeImage().catch(() => null); // unreadable file: the text alone
  const content = image ? [{ type: "image_url", image_url: { url: image } }, { type: "text", text }] : text;
  history.push({ role: "user", content });
  addMessage("user", text, image);
  const el = addMessage("assistant", "");
  const body = el.querySelector(".text");
  const headers = { "Content-Type": "application/json" };
  const key = $("api-key") && $("api-key").value.trim();
  if (key) headers.Authorization = "Bearer " + key;
  const temperature = parseFloat($("temperature").value);
  const request = {
    model: $("model-select") ? $("model-select").value : $("model").textContent, messages: history, stream: true,
    stream_options: { include_usage: true },
    max_tokens: parseInt($("max-tokens").value, 10) || 64,
    temperature: Number.isFinite(temperature) ? temperature : 1,
  };
  const t0 = performance.now();
  let ttft = null, usage = null, reply = "", reasoning = "";
  const calls = []; // OpenAI streamed tool calls, by index: {id, type, function: {name, arguments}}
  try {
    const response = await fetch("/v1/chat/completions", { method: "POST", headers, body: JSON.stringify(request) });
    if (!response.ok) throw new Error((await response.json()).error.message);
    for await (const chunk of sseEvents(response)) {
      if (chunk.error) throw new Error(chunk.error.message);
      if (chunk.usage) usage = chunk.usage;
      const d = (chunk.choices && chunk.choices[0] && chunk.choices[0].delta) || {};
      if ((d.content || d.reasoning_content || d.tool_calls) && ttft === null) ttft = performance.now() - t0;
      if (d.reasoning_content) {
        reasoning += d.reasoning_content;
        partEl(el, "reasoning").textContent = reasoning;
      }
      for (const c of d.tool_calls || []) {
        const call = calls[c.index] || (calls[c.index] = { id: c.id, type: "function", function: { name: "", arguments: "" } });
        if (c.function && c.function.name) call.function.name += c.function.name;
        if (c.function && c.function.arguments) call.function.arguments += c.function.arguments;
        partEl(el, "tool-calls").textContent = calls.map((x) => `${x.function.name}(${x.function.arguments})`).join("\n");
      }
      if (d.content) {
        reply += d.content;
        body.textContent = reply;
      }
    }
    const turn = { role: "assistant", content: calls.length && !reply ? null : reply };
    if (calls.length) turn.tool_calls = calls;
    if (reasoning) turn.reasoning_content = reasoning;
    history.push(turn);
    const total = performance.now() - t0;
    showStats(el, ttft === null ? total : ttft, total, usage);
  } catch (err) {
    history.pop(); // the user turn that failed is not part of the conversation
    body.textContent = "error: " + err.message;
    el.classList.add("error");
  }
  el.dataset.done = "1";
  busy = false;
  $("send").disabled = false;
}

// A long deterministic document: ask several questions about it to see the prefix reused.
function sampleTable() {
  const names = ["Alice", "Bruno", "Chen", "Dara", "Elif", "Farid", "Greta", "Hugo", "Ines", "Jonas"];
  const cities = ["Berlin", "Lagos", "Lima", "Osaka", "Paris", "Porto", "Quito", "Rome", "Seoul"];
  const jobs = ["baker", "doctor", "engineer", "farmer", "lawyer", "nurse", "pilot", "teacher"];
  const rows = ["| name | age | city | job |", "|---|---|---|---|"];
  for (let i = 0; i < 80; i++) {
    rows.push(`| ${names[i % 10]} ${names[(i * 7 + 3) % 10]} | ${20 + (i * 13) % 50} | ${cities[i % 9]} | ${jobs[(i * 5) % 8]} |`);
  }
  return "Here is a table of people:\n\n" + rows.join("\n") + "\n\nQuestion: who is the oldest?";
}

$("form").addEventListener("submit", (e) => {
  e.preventDefault();
  const text = $("input").value.trim();
  if ((!text && !($("image") && $("image").files.length)) || busy) return;
  $("input").value = "";
  send(text);
});
$("input").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); $("form").requestSubmit(); }
});
$("sample").addEventListener("click", () => { $("input").value = sampleTable(); $("input").focus(); });
$("reset").addEventListener("click", () => { if (!busy) { history.length = 0; $("log").innerHTML = ""; } });
