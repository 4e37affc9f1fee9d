// metatp's chat page: a streaming chat with the served model through /v1/chat/completions.
// Every text from the model, the user or the server goes into the page as text (textContent),
// never as HTML. The settings (the API key too) are kept in this browser's localStorage.
"use strict";

const $ = (id) => document.getElementById(id);
const STORE = "metatp.chat.";
const turns = [];       // the conversation so far: {role, content}, what the next request sends
let running = null;       // the AbortController of the request in flight

// ------------------------------------------------------------------ settings
function keepSettings() {
  for (const field of document.querySelectorAll("[data-keep]")) {
    const saved = localStorage.getItem(STORE + field.id);
    if (saved !== null) field.value = saved;
    field.addEventListener("input", () => localStorage.setItem(STORE + field.id, field.value));
  }
  $("api-key").addEventListener("change", showModel);
}

function authHeaders() {
  const key = $("api-key").value.trim();
  return key ? { Authorization: "Bearer " + key } : {};
}

function numberField(id) {
  const value = $(id).value.trim();
  return value === "" ? undefined : Number(value);
}

function requestBody() {
  const system = $("system-prompt").value.trim();
  const messages = system ? [{ role: "system", content: system }, ...turns] : [...turns];
  const body = { messages, stream: true, stream_options: { include_usage: true } };
  for (const [field, id] of [["temperature", "temperature"], ["top_p", "top-p"], ["max_tokens", "max-tokens"],
                             ["seed", "seed"]]) {
    const value = numberField(id);
    if (value !== undefined) body[field] = value;
  }
  const stop = $("stop-strings").value.split("\n").filter((s) => s !== "");
  if (stop.length) body.stop = stop;
  return body;
}

// ------------------------------------------------------------------ the server's answers
async function errorText(response) {
  let message = response.statusText;
  try {
    const body = await response.json();
    message = (body.error && body.error.message) || body.detail || message;
  } catch (e) { /* not JSON: the status line says it */ }
  const hint = response.status === 401 ? " (enter the server's API key in Settings)" : "";
  return `${response.status}: ${message}${hint}`;
}

// The server-sent events of a streamed response, each `data:` payload parsed, until [DONE].
async function* serverEvents(body) {
  const reader = body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    // the whole buffer: a CRLF may be split between two reads
    buffer = (buffer + decoder.decode(value, { stream: true })).replace(/\r\n/g, "\n");
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const data = event.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trim()).join("\n");
      if (data === "[DONE]") return;
      if (data) yield JSON.parse(data);
    }
  }
}

// fetch, a network failure said as such (an abort stays an abort)
async function reach(url, options) {
  try {
    return await fetch(url, options);
  } catch (e) {
    if (e.name === "AbortError") throw e;
    throw new Error(`cannot reach the server: ${e.message}`);
  }
}

async function showModel() {
  try {
    const response = await fetch("/v1/models", { headers: authHeaders() });
    $("model").textContent = response.ok ? (await response.json()).data[0].id
      : response.status === 401 ? "API key needed" : "";
  } catch (e) {
    $("model").textContent = "server unreachable";
  }
}

// ------------------------------------------------------------------ the conversation
function addMessage(role, text) {
  const item = document.createElement("article");
  item.className = "message " + role;
  const who = document.createElement("h3");
  who.textContent = role;
  const content = document.createElement("div");
  content.className = "content";
  content.textContent = text;
  item.append(who, content);
  $("conversation").append(item);
  item.scrollIntoView({ block: "end" });
  return item;
}

function showError(text) {
  $("error").textContent = text;
  $("error").hidden = !text;
}

function setRunning(controller) {
  running = controller;
  $("send").disabled = controller !== null;
  $("stop").disabled = controller === null;
  $("conversation").setAttribute("aria-busy", String(controller !== null));
}

function describeFinish(finish, usage, seconds) {
  const parts = [];
  if (finish) parts.push("finished: " + finish);
  if (usage) {
    parts.push(`${usage.completion_tokens} tokens`);
    if (seconds > 0) parts.push(`${(usage.completion_tokens / seconds).toFixed(1)} tokens/s`);
  }
  return parts.join(" · ");
}

async function send(text) {
  showError("");
  $("status").textContent = "";
  turns.push({ role: "user", content: text });
  const asked = addMessage("user", text);
  const reply = addMessage("assistant", "");
  const content = reply.querySelector(".content");
  reply.dataset.chunks = "0";
  const controller = new AbortController();
  setRunning(controller);
  let answer = "", finish = null, usage = null, failed = false;
  const started = performance.now();
  try {
    const response = await reach("/v1/chat/completions", {
      method: "POST", signal: controller.signal,
      headers: { "Content-Type": "application/json", ...authHeaders() },
      body: JSON.stringify(requestBody()),
    });
    if (!response.ok) throw new Error(await errorText(response));
    for await (const event of serverEvents(response.body)) {
      controller.signal.throwIfAborted();     // Stop: the events already read are not shown either
      if (event.error) throw new Error(event.error.message || "the server failed the request");
      const choice = event.choices && event.choices[0];
      if (choice && choice.delta && choice.delta.content) {
        answer += choice.delta.content;
        content.textContent = answer;
        reply.dataset.chunks = String(Number(reply.dataset.chunks) + 1);
        reply.scrollIntoView({ block: "end" });
      }
      if (choice && choice.finish_reason) finish = choice.finish_reason;
      if (event.usage) usage = event.usage;
    }
    $("status").textContent = describeFinish(finish, usage, (performance.now() - started) / 1000);
  } catch (e) {
    if (e.name === "AbortError") {
      $("status").textContent = "stopped";
    } else {
      failed = true;
      showError(e.message);
    }
  } finally {
    reply.dataset.finish = finish || (failed ? "error" : "stopped");
    if (answer) {
      turns.push({ role: "assistant", content: answer });
    } else if (failed) {
      // nothing came back: the message goes back to the box, to send again (after a key, say)
      turns.pop();
      asked.remove();
      reply.remove();
      if (!$("message").value) $("message").value = text;
    }
    setRunning(null);
  }
}

function clearConversation() {
  if (running) running.abort();
  turns.length = 0;
  $("conversation").replaceChildren();
  showError("");
  $("status").textContent = "";
}

// ------------------------------------------------------------------ wiring
function start() {
  keepSettings();
  $("composer").addEventListener("submit", (e) => {
    e.preventDefault();
    const text = $("message").value;
    if (running || !text.trim()) return;
    $("message").value = "";
    send(text);
  });
  $("message").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
      e.preventDefault();
      $("composer").requestSubmit();
    }
  });
  $("stop").addEventListener("click", () => running && running.abort());
  $("clear").addEventListener("click", clearConversation);
  $("settings").addEventListener("submit", (e) => e.preventDefault());
  setRunning(null);
  showModel();
}

start();
