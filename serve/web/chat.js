// The chat tab: conversations (kept in localStorage), streaming replies from /v1/chat/completions
// rendered as Markdown, stop, regenerate, edit-and-resend, and the settings panel.

import { ApiError, events, getJSON, request } from "./api.js";
import { render } from "./markdown.js";

const $ = (id) => document.getElementById(id);
const STORE = "goinfer.conversations"; // [{id, title, model, updated, messages: [{role, content, meta}]}]
const CURRENT = "goinfer.current";
const SETTINGS = "goinfer.settings";
const MEASURABLE_MS = 50; // a reply's decode shorter than this is not timed by the page
const DEFAULTS = { system: "", temperature: null, top_p: null, max_tokens: null, schema: "", schemaOn: false };

function el(tag, cls, text) {
  const node = document.createElement(tag);
  if (cls) node.className = cls;
  if (text !== undefined) node.textContent = text;
  return node;
}

function load(key, fallback) {
  try {
    const value = JSON.parse(localStorage.getItem(key));
    return value ?? fallback;
  } catch {
    return fallback;
  }
}

async function copy(text, button) {
  try {
    await navigator.clipboard.writeText(text);
  } catch {
    // no clipboard API (an insecure origin): copy through a selection
    const area = el("textarea");
    area.value = text;
    document.body.append(area);
    area.select();
    document.execCommand("copy");
    area.remove();
  }
  button.textContent = "Copied";
  setTimeout(() => (button.textContent = "Copy"), 1500);
}

export class Chat {
  constructor(toast) {
    this.toast = toast;
    this.conversations = load(STORE, []);
    this.current = localStorage.getItem(CURRENT);
    this.settings = { ...DEFAULTS, ...load(SETTINGS, {}) };
    this.models = null; // /v1/models' chat models, once asked
    this.controller = null; // the running reply's AbortController
    this.pending = false; // a render is scheduled
  }

  start() {
    $("composer").addEventListener("submit", (e) => {
      e.preventDefault();
      this.send();
    });
    $("prompt").addEventListener("keydown", (e) => {
      if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
        e.preventDefault();
        this.send();
      }
    });
    $("stop").addEventListener("click", () => this.stop());
    $("new-chat").addEventListener("click", () => this.newConversation());
    $("model-picker").addEventListener("change", () => {
      const conv = this.conversation();
      conv.model = $("model-picker").value;
      this.save();
      this.describeModel();
    });
    this.bindSettings();
    if (!this.conversation(false)) this.newConversation();
    this.renderList();
    this.renderMessages();
  }

  // -- conversations -------------------------------------------------------------------------------
  conversation(create = true) {
    let conv = this.conversations.find((c) => c.id === this.current);
    if (!conv && create) conv = this.newConversation();
    return conv;
  }

  newConversation() {
    const existing = this.conversations.find((c) => c.messages.length === 0);
    const conv = existing || {
      id: `c${Date.now().toString(36)}${Math.random().toString(36).slice(2, 6)}`,
      title: "New chat",
      model: $("model-picker").value || null,
      updated: Date.now(),
      messages: [],
    };
    if (!existing) this.conversations.unshift(conv);
    this.select(conv.id);
    return conv;
  }

  select(id) {
    if (this.controller) this.stop();
    this.current = id;
    localStorage.setItem(CURRENT, id);
    const conv = this.conversation(false);
    if (conv && conv.model && [...$("model-picker").options].some((o) => o.value === conv.model))
      $("model-picker").value = conv.model;
    this.describeModel();
    this.renderList();
    this.renderMessages();
  }

  remove(id) {
    this.conversations = this.conversations.filter((c) => c.id !== id);
    if (this.current === id) this.current = this.conversations[0]?.id ?? null;
    this.save();
    if (!this.conversation(false)) this.newConversation();
    else this.select(this.current);
  }

  save() {
    const conv = this.conversation(false);
    if (conv) conv.updated = Date.now();
    try {
      localStorage.setItem(STORE, JSON.stringify(this.conversations));
    } catch (e) {
      this.toast(`Could not keep the conversation in this browser: ${e.message}`, true);
    }
    this.renderList();
  }

  renderList() {
    const list = $("conversation-list");
    list.replaceChildren();
    for (const conv of this.conversations) {
      const li = el("li", conv.id === this.current ? "active" : "");
      const open = el("button", "title", conv.title);
      open.type = "button";
      open.title = conv.title;
      open.addEventListener("click", () => this.select(conv.id));
      const del = el("button", "delete", "×");
      del.type = "button";
      del.title = "Delete this conversation";
      del.setAttribute("aria-label", `Delete ${conv.title}`);
      del.addEventListener("click", () => this.remove(conv.id));
      li.append(open, del);
      list.append(li);
    }
  }

  // -- models --------------------------------------------------------------------------------------
  async loadModels() {
    const picker = $("model-picker");
    const wanted = this.conversation(false)?.model || picker.value;
    try {
      const body = await getJSON("/v1/models");
      this.models = body.data.filter((m) => m.kind !== "embedding");
    } catch (e) {
      this.models = [];
      this.notice(e instanceof ApiError ? e.describe() : String(e));
    }
    picker.replaceChildren(
      ...this.models.map((m) => {
        const option = el("option", "", m.id);
        option.value = m.id;
        return option;
      }),
    );
    if (this.models.some((m) => m.id === wanted)) picker.value = wanted;
    this.describeModel();
  }

  describeModel() {
    if (this.models === null) return; // not asked yet
    const model = this.models.find((m) => m.id === $("model-picker").value);
    $("chat-status").textContent = model
      ? `${model.quant}, context ${model.context_window} tokens`
      : "no chat model is served (load one in the Models tab)";
  }

  notice(text) {
    $("chat-status").textContent = text;
  }

  // -- settings ------------------------------------------------------------------------------------
  bindSettings() {
    const s = this.settings;
    const fields = [
      ["system", "system", (v) => v],
      ["temperature", "temperature", Number],
      ["top-p", "top_p", Number],
      ["max-tokens", "max_tokens", (v) => (v === "" ? null : Math.max(1, parseInt(v, 10)))],
      ["schema", "schema", (v) => v],
    ];
    const show = () => {
      $("system").value = s.system;
      $("temperature").value = s.temperature ?? 1;
      $("temperature-out").textContent = s.temperature === null ? "(server default)" : String(s.temperature);
      $("top-p").value = s.top_p ?? 1;
      $("top-p-out").textContent = s.top_p === null ? "(server default)" : String(s.top_p);
      $("max-tokens").value = s.max_tokens ?? "";
      $("schema").value = s.schema;
      $("schema-on").checked = s.schemaOn;
      $("schema").disabled = !s.schemaOn;
    };
    for (const [id, key, parse] of fields) {
      $(id).addEventListener("input", () => {
        s[key] = parse($(id).value);
        if (Number.isNaN(s[key])) s[key] = null;
        this.saveSettings();
        show();
      });
    }
    $("schema-on").addEventListener("change", () => {
      s.schemaOn = $("schema-on").checked;
      this.saveSettings();
      show();
    });
    $("reset-settings").addEventListener("click", () => {
      Object.assign(s, { temperature: null, top_p: null, max_tokens: null });
      this.saveSettings();
      show();
    });
    show();
  }

  saveSettings() {
    localStorage.setItem(SETTINGS, JSON.stringify(this.settings));
  }

  // -- a turn --------------------------------------------------------------------------------------
  send() {
    const text = $("prompt").value;
    if (!text.trim() || this.controller) return;
    const conv = this.conversation();
    conv.messages = conv.messages.filter((m) => m.role !== "error");
    conv.messages.push({ role: "user", content: text });
    if (conv.title === "New chat") conv.title = text.trim().split("\n")[0].slice(0, 48);
    $("prompt").value = "";
    this.complete(conv);
  }

  regenerate() {
    const conv = this.conversation();
    while (conv.messages.length && conv.messages.at(-1).role !== "user") conv.messages.pop();
    this.complete(conv);
  }

  resend(index, text) {
    const conv = this.conversation();
    conv.messages = conv.messages.slice(0, index);
    conv.messages.push({ role: "user", content: text });
    this.complete(conv);
  }

  stop() {
    if (this.controller) this.controller.abort();
  }

  body(conv) {
    const s = this.settings;
    const messages = conv.messages
      .filter((m) => m.role === "user" || m.role === "assistant")
      .map(({ role, content }) => ({ role, content }));
    if (s.system.trim()) messages.unshift({ role: "system", content: s.system });
    const body = { model: $("model-picker").value, messages, stream: true, stream_options: { include_usage: true } };
    if (s.temperature !== null) body.temperature = s.temperature;
    if (s.top_p !== null) body.top_p = s.top_p;
    if (s.max_tokens !== null) body.max_tokens = s.max_tokens;
    if (s.schemaOn) {
      let schema;
      try {
        schema = JSON.parse(s.schema);
      } catch (e) {
        throw new ApiError(400, `the JSON schema in the settings is not valid JSON: ${e.message}`);
      }
      body.response_format = { type: "json_schema", json_schema: { name: "reply", schema, strict: true } };
    }
    return body;
  }

  async complete(conv) {
    const reply = { role: "assistant", content: "", meta: { model: $("model-picker").value } };
    this.busy(true);
    let usage = null;
    let first = null;
    const start = performance.now();
    try {
      if (!$("model-picker").value) throw new ApiError(400, "no chat model is served: load one in the Models tab");
      const body = this.body(conv);
      conv.model = body.model;
      conv.messages.push(reply);
      this.save();
      this.renderMessages();
      this.controller = new AbortController();
      const resp = await request("POST", "/v1/chat/completions", body, this.controller.signal);
      for await (const event of events(resp)) {
        const choice = event.choices && event.choices[0];
        if (choice && choice.delta && choice.delta.content) {
          if (first === null) first = performance.now();
          reply.content += choice.delta.content;
          this.scheduleRender();
        }
        if (choice && choice.finish_reason) reply.meta.finish = choice.finish_reason;
        if (event.usage) usage = event.usage;
      }
    } catch (e) {
      if (e.name === "AbortError") {
        reply.meta.stopped = true;
      } else {
        if (!reply.content) conv.messages = conv.messages.filter((m) => m !== reply);
        conv.messages.push({ role: "error", content: e instanceof ApiError ? e.describe() : `The reply failed: ${e.message}` });
      }
    } finally {
      const end = performance.now();
      Object.assign(reply.meta, stats(usage, start, first, end));
      this.controller = null;
      this.busy(false);
      this.save();
      this.renderMessages();
    }
  }

  busy(on) {
    $("send").hidden = on;
    $("stop").hidden = !on;
    $("model-picker").disabled = on;
  }

  // -- rendering -----------------------------------------------------------------------------------
  scheduleRender() {
    if (this.pending) return;
    this.pending = true;
    requestAnimationFrame(() => {
      this.pending = false;
      this.renderMessages();
    });
  }

  renderMessages() {
    const box = $("messages");
    const atBottom = box.scrollHeight - box.scrollTop - box.clientHeight < 40;
    const conv = this.conversation(false);
    box.replaceChildren();
    if (!conv || !conv.messages.length) {
      box.append(el("p", "empty muted", "Ask something. Replies stream in as the model writes them."));
      return;
    }
    const lastUser = conv.messages.map((m) => m.role).lastIndexOf("user");
    conv.messages.forEach((m, i) => box.append(this.message(m, i, i === lastUser, i === conv.messages.length - 1)));
    if (atBottom || this.controller) box.scrollTop = box.scrollHeight;
  }

  message(m, index, lastUser, last) {
    const node = el("div", `message ${m.role}`);
    node.dataset.role = m.role;
    if (m.role === "error") {
      node.append(el("div", "body", m.content));
      node.setAttribute("role", "alert");
      return node;
    }
    const body = el("div", "body");
    if (m.role === "assistant") body.append(render(m.content, copy));
    else body.textContent = m.content;
    node.append(body);
    const actions = el("div", "actions");
    if (m.role === "assistant") {
      node.append(el("div", "meta", describe(m.meta || {}, this.controller !== null && last)));
      if (last && !this.controller) actions.append(button("Regenerate", () => this.regenerate()));
    }
    if (m.role === "user" && lastUser && !this.controller) actions.append(button("Edit", () => this.edit(node, index, m)));
    if (actions.childElementCount) node.append(actions);
    return node;
  }

  edit(node, index, m) {
    const area = el("textarea", "edit");
    area.value = m.content;
    area.rows = Math.min(12, m.content.split("\n").length + 1);
    const actions = el("div", "actions");
    actions.append(
      button("Send", () => area.value.trim() && this.resend(index, area.value)),
      button("Cancel", () => this.renderMessages()),
    );
    node.replaceChildren(area, actions);
    area.focus();
  }
}

function button(label, onClick) {
  const b = el("button", "plain small", label);
  b.type = "button";
  b.addEventListener("click", onClick);
  return b;
}

// The line under a reply, from the usage the stream ends with and the times the page saw.
function stats(usage, start, first, end) {
  const out = { seconds: (end - start) / 1000 };
  if (first !== null) out.first_token_s = (first - start) / 1000;
  if (usage) {
    out.prompt_tokens = usage.prompt_tokens;
    out.completion_tokens = usage.completion_tokens;
    out.cached_tokens = usage.prompt_tokens_details ? usage.prompt_tokens_details.cached_tokens : 0;
    // decode rate: tokens after the first over the time after it (the first waited for the prefill).
    // Under MEASURABLE_MS the stream came in one read or two (a tiny model, far faster than the
    // network): only a lower bound can be said.
    if (first !== null && usage.completion_tokens > 1) {
      const ms = Math.max(end - first, MEASURABLE_MS);
      out.tokens_per_s = (usage.completion_tokens - 1) / (ms / 1000);
      out.rate_bound = end - first < MEASURABLE_MS;
    }
  }
  return out;
}

function describe(meta, running) {
  if (running) return "…";
  const parts = [];
  if (meta.model) parts.push(meta.model);
  if (meta.completion_tokens !== undefined) parts.push(`${meta.completion_tokens} tokens`);
  if (meta.tokens_per_s !== undefined)
    parts.push(`${meta.rate_bound ? "over " : ""}${meta.tokens_per_s.toFixed(1)} tok/s`);
  if (meta.cached_tokens !== undefined)
    parts.push(`${meta.cached_tokens} of ${meta.prompt_tokens} prompt tokens cached`);
  if (meta.first_token_s !== undefined) parts.push(`first token ${meta.first_token_s.toFixed(2)} s`);
  if (meta.stopped) parts.push(`stopped after ${meta.seconds.toFixed(1)} s`);
  else if (meta.finish) parts.push(meta.finish === "length" ? "cut at max tokens" : meta.finish);
  return parts.join(" · ");
}
