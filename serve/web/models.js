// The Models tab: what is loaded (with Unload), getting a model (the zoo's, or hf:owner/repo:QUANT:
// its plan first, then Pull + Build with live progress, then Load), and what is on disk.

import { ApiError, events, getJSON, postJSON, request } from "./api.js";

const $ = (id) => document.getElementById(id);
const REFRESH_MS = 4000; // the Loaded card's KV use while the tab is open

function el(tag, cls, text) {
  const node = document.createElement(tag);
  if (cls) node.className = cls;
  if (text !== undefined) node.textContent = text;
  return node;
}

function cell(row, content, cls) {
  const td = el("td", cls);
  if (content instanceof Node) td.append(content);
  else td.textContent = content ?? "";
  row.append(td);
  return td;
}

export function bytes(n) {
  if (n === null || n === undefined) return "";
  if (n >= 1e9) return `${(n / 1e9).toFixed(2)} GB`;
  if (n >= 1e6) return `${(n / 1e6).toFixed(1)} MB`;
  if (n >= 1e3) return `${(n / 1e3).toFixed(1)} kB`;
  return `${n} B`;
}

export class Models {
  constructor(toast, modelsChanged) {
    this.toast = toast;
    this.modelsChanged = modelsChanged;
    this.status = null; // GET /web/status: {admin, puller, loader, key}
    this.timer = null;
    this.following = false; // a pull's events are being shown
    this.built = null; // the last pull's result: {bundle, name, kind}
    $("refresh-loaded").addEventListener("click", () => this.loaded());
    $("refresh-disk").addEventListener("click", () => this.disk());
    $("plan-form").addEventListener("submit", (e) => {
      e.preventDefault();
      this.plan($("pull-ref").value.trim());
    });
    $("load-form").addEventListener("submit", (e) => {
      e.preventDefault();
      if (this.built) this.load(this.built.bundle, $("load-name").value.trim());
    });
  }

  setStatus(status) {
    this.status = status;
    const notice = $("admin-notice");
    const admin = Boolean(status && status.admin);
    notice.hidden = admin;
    notice.textContent = admin
      ? ""
      : "Admin actions are off on this server: start it with goinfer serve --allow-admin to pull, build, " +
        "load and unload models from this page (with --api-key set, enter the key with the Key button).";
    for (const id of ["plan-button"]) $(id).disabled = !admin;
  }

  get admin() {
    return Boolean(this.status && this.status.admin);
  }

  open() {
    this.loaded();
    this.catalog();
    this.disk();
    if (this.admin && !this.following && this.status.pull) this.follow();
    clearInterval(this.timer);
    this.timer = setInterval(() => this.loaded(), REFRESH_MS);
  }

  close() {
    clearInterval(this.timer);
    this.timer = null;
  }

  fail(e) {
    this.toast(e instanceof ApiError ? e.describe() : String(e), true);
  }

  // -- Loaded --------------------------------------------------------------------------------------
  async loaded() {
    let models, health;
    try {
      [models, health] = await Promise.all([getJSON("/v1/models"), getJSON("/health")]);
    } catch (e) {
      const body = $("loaded-table").tBodies[0];
      body.replaceChildren();
      const row = el("tr");
      cell(row, e instanceof ApiError ? e.describe() : String(e), "muted").colSpan = 8;
      body.append(row);
      return;
    }
    const body = $("loaded-table").tBodies[0];
    body.replaceChildren();
    for (const m of models.data) {
      const h = health.models[m.id] || {};
      const row = el("tr");
      row.dataset.model = m.id;
      cell(row, m.id, "name");
      cell(row, h.target || m.target || "");
      cell(row, m.quant || "");
      cell(row, m.context_window ? `${m.context_window}` : m.kind === "embedding" ? `${m.max_tokens ?? ""}` : "");
      cell(row, kvUse(h));
      cell(row, h.running_or_queued !== undefined ? String(h.running_or_queued) : "");
      cell(row, selftest(h.selftest));
      const unload = el("button", "plain small", "Unload");
      unload.type = "button";
      unload.disabled = !this.admin || m.kind === "embedding";
      unload.title = this.admin ? `Unload ${m.id}` : "needs --allow-admin";
      unload.addEventListener("click", () => this.unload(m.id));
      cell(row, unload);
      body.append(row);
    }
    for (const name of health.loading || []) {
      const row = el("tr");
      cell(row, name, "name");
      cell(row, "loading…", "muted").colSpan = 7;
      body.append(row);
    }
    if (!body.childElementCount) {
      const row = el("tr");
      cell(row, "No model is loaded.", "muted").colSpan = 8;
      body.append(row);
    }
  }

  async unload(name) {
    if (!confirm(`Unload ${name}? Requests to it are refused from now on.`)) return;
    try {
      const r = await postJSON("/admin/models/unload", { name });
      this.toast(r.freed ? `Unloaded ${name}.` : `${name} is unloaded; it is freed when its last request ends.`);
    } catch (e) {
      this.fail(e);
    }
    this.loaded();
    this.modelsChanged();
  }

  async load(path, name) {
    $("load-button").disabled = true;
    try {
      const r = await postJSON("/admin/models/load", name ? { path, name } : { path });
      this.toast(`Loaded ${r.loaded.id}: pick it in the Chat tab.`);
      this.log(`loaded as ${r.loaded.id}`);
    } catch (e) {
      this.fail(e);
    } finally {
      $("load-button").disabled = false;
    }
    this.loaded();
    this.modelsChanged();
  }

  // -- Get a model ---------------------------------------------------------------------------------
  async catalog() {
    let body;
    try {
      body = await getJSON("/web/models/catalog");
    } catch (e) {
      $("zoo-table").tBodies[0].replaceChildren();
      if (!(e instanceof ApiError && e.code === "no_puller")) this.fail(e);
      return;
    }
    const quant = $("pull-quant");
    const chosen = quant.value;
    quant.replaceChildren(
      ...body.quants.map((q) => {
        const o = el("option", "", q);
        o.value = q;
        return o;
      }),
    );
    quant.value = chosen || body.default_quant;
    const rows = $("zoo-table").tBodies[0];
    rows.replaceChildren();
    for (const m of body.zoo) {
      const row = el("tr");
      row.dataset.ref = m.name;
      const name = el("span");
      name.append(el("strong", "", m.name), el("br"), el("span", "muted small", m.description));
      cell(row, name);
      cell(row, bytes(m.size));
      cell(row, m.kind);
      cell(row, m.pulled ? "pulled" : "");
      const plan = el("button", "plain small", "Plan");
      plan.type = "button";
      plan.disabled = !this.admin;
      plan.addEventListener("click", () => {
        $("pull-ref").value = m.name;
        this.plan(m.name);
      });
      cell(row, plan);
      rows.append(row);
    }
  }

  async plan(ref) {
    if (!ref) return;
    const box = $("plan");
    box.hidden = false;
    box.replaceChildren(el("p", "muted", `Planning ${ref}…`));
    const quant = $("pull-quant").value || null;
    let p;
    try {
      p = await postJSON("/admin/models/plan", { ref, quant });
    } catch (e) {
      box.replaceChildren(el("p", "error", e instanceof ApiError ? e.describe() : String(e)));
      return;
    }
    const head = el("p");
    head.append(el("strong", "", p.ref), ` from ${p.source === "hub" ? "the Hugging Face Hub" : "the zoo"}: `);
    head.append(`${p.files.length} file${p.files.length === 1 ? "" : "s"}, ${bytes(p.total_bytes)}`);
    const table = el("table", "grid");
    table.id = "plan-files";
    const tbody = el("tbody");
    for (const f of p.files) {
      const row = el("tr");
      cell(row, f.name);
      cell(row, bytes(f.size), "num");
      tbody.append(row);
    }
    table.append(tbody);
    const notes = el("ul", "notes");
    for (const n of p.notes) notes.append(el("li", "", n));
    if (p.pulled) notes.append(el("li", "", "Already pulled: nothing will be downloaded."));
    if (p.bundle) notes.append(el("li", "", `Already built as ${p.quant}: ${p.bundle}`));
    const go = el("button", "", p.bundle ? "Use the built bundle" : p.pulled ? "Build" : "Pull + Build");
    go.type = "button";
    go.id = "pull-button";
    go.addEventListener("click", () => {
      go.disabled = true;
      if (p.bundle) this.show({ type: "built", bundle: p.bundle, name: null, kind: p.kind }, p.ref);
      else this.pull(p.ref, quant);
    });
    box.replaceChildren(head, table, notes, go);
  }

  async pull(ref, quant) {
    this.reset(ref);
    try {
      const resp = await request("POST", "/admin/models/pull", { ref, quant });
      await this.stream(resp, ref);
    } catch (e) {
      this.show({ type: "error", error: { message: e instanceof ApiError ? e.describe() : String(e) } }, ref);
    }
  }

  // A pull running (or the last one) when the tab opens: its events from the start.
  async follow() {
    let resp;
    try {
      resp = await request("GET", "/admin/models/pull");
    } catch {
      return; // none has run
    }
    this.reset(null);
    await this.stream(resp, null);
  }

  async stream(resp, ref) {
    this.following = true;
    try {
      for await (const event of events(resp)) this.show(event, ref);
    } catch (e) {
      this.show({ type: "error", error: { message: `lost the pull's progress: ${e.message}` } }, ref);
    } finally {
      this.following = false;
      this.disk();
      this.catalog();
    }
  }

  reset(ref) {
    $("pull-progress").hidden = false;
    $("pull-log").textContent = ref ? `${ref}\n` : "";
    $("pull-bar").value = 0;
    $("load-form").hidden = true;
    this.built = null;
    for (const li of $("pull-stages").children) li.className = "";
    $("pull-progress").scrollIntoView({ block: "nearest" });
  }

  log(line) {
    const log = $("pull-log");
    const near = log.scrollHeight - log.scrollTop - log.clientHeight < 30;
    log.textContent += `${line}\n`;
    if (near) log.scrollTop = log.scrollHeight;
  }

  show(event, ref) {
    $("pull-progress").hidden = false;
    if (event.type === "stage") {
      let seen = false;
      for (const li of [...$("pull-stages").children].reverse()) {
        if (li.dataset.stage === event.stage) {
          li.className = event.stage === "built" ? "done" : "active";
          seen = true;
        } else if (seen) li.className = "done";
      }
      $("pull-bar").value = event.stage === "built" ? 1 : 0;
    } else if (event.type === "line") {
      this.log(event.line);
      const fraction = progressOf(event.stage, event.line);
      if (fraction !== null) $("pull-bar").value = fraction;
    } else if (event.type === "built") {
      this.built = event;
      for (const li of $("pull-stages").children) li.className = "done";
      $("pull-bar").value = 1;
      this.log(`built: ${event.bundle}`);
      if (event.kind === "embedding") {
        this.log("an embedding model: serve it with goinfer serve --embed-model");
      } else {
        $("load-form").hidden = false;
        $("load-name").value = event.name || (ref || "").replace(/^hf:/, "").split(/[/:]/).pop() || "model";
        $("load-button").disabled = !this.admin;
        $("load-form").scrollIntoView({ block: "nearest" });
      }
    } else if (event.type === "error") {
      const failed = [...$("pull-stages").children].find((li) => li.className === "active");
      if (failed) failed.className = "failed";
      this.log(`error: ${event.error.message}`);
      this.toast(event.error.message, true);
    }
  }

  // -- On disk -------------------------------------------------------------------------------------
  async disk() {
    let body;
    try {
      body = await getJSON("/web/models/cache");
    } catch (e) {
      $("disk-table").tBodies[0].replaceChildren();
      $("disk-summary").textContent = e instanceof ApiError ? e.describe() : String(e);
      return;
    }
    const rows = $("disk-table").tBodies[0];
    rows.replaceChildren();
    let total = 0;
    let stale = 0;
    for (const entry of body.data) {
      total += entry.size;
      if (entry.stale) stale += entry.size;
      const row = el("tr", entry.stale ? "stale" : "");
      row.dataset.kind = entry.kind;
      row.dataset.name = entry.name;
      cell(row, entry.kind);
      const name = el("span", "path", entry.name);
      name.title = entry.path;
      cell(row, name);
      cell(row, bytes(entry.size), "num");
      cell(row, entry.stale ? "stale" : entry.complete ? "complete" : "incomplete");
      cell(row, entry.detail, "small");
      const actions = el("span");
      if (entry.ref && entry.kind === "bundle") {
        const load = el("button", "plain small", "Load");
        load.type = "button";
        load.disabled = !this.admin;
        load.addEventListener("click", () => {
          const name = prompt("Load as (the name requests use):", entry.name.split(".")[0]);
          if (name) this.load(entry.ref, name.trim());
        });
        actions.append(load);
      } else if (entry.ref) {
        const plan = el("button", "plain small", entry.complete ? "Build…" : "Resume…");
        plan.type = "button";
        plan.disabled = !this.admin;
        plan.addEventListener("click", () => {
          $("pull-ref").value = entry.ref;
          this.plan(entry.ref);
          $("pull-card").scrollIntoView({ behavior: "smooth" });
        });
        actions.append(plan);
      }
      cell(row, actions);
      rows.append(row);
    }
    $("disk-summary").textContent =
      `${body.data.length} entries, ${bytes(total)}` + (stale ? ` (${bytes(stale)} in stale bundles, safe to delete)` : "");
  }
}

function kvUse(h) {
  if (h.pages_used === undefined) return "";
  const total = h.pages_used + h.pages_free;
  const pct = total ? Math.round((100 * h.pages_used) / total) : 0;
  const tokens = (n) => (h.page_size ? `${n * h.page_size}` : `${n} pages`);
  return `${tokens(h.pages_used)} of ${tokens(total)} tokens (${pct}%), ${h.sessions_warm ?? 0} warm`;
}

function selftest(results) {
  if (!results || !results.length) return "";
  return results.map((r) => `${r.backend || r.tier || ""} ${r.status || ""}`.trim()).join(", ");
}

// How far a stage has got, from its lines: "x / y MB" while a file downloads, "[k/6]" in a build.
function progressOf(stage, line) {
  let m = /([\d.]+) \/ ([\d.]+) MB/.exec(line);
  if (stage === "pull" && m && Number(m[2]) > 0) return Math.min(1, Number(m[1]) / Number(m[2]));
  m = /^\[(\d)\/(\d)\]/.exec(line);
  if (stage === "build" && m) return Number(m[1]) / Number(m[2]);
  return null;
}
