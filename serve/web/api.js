// The page's calls to its server: same origin, the API key (when one is set) in the Authorization
// header and nowhere else (never a URL), errors in the API's envelope turned into ApiError.

const KEY = "goinfer.apiKey"; // sessionStorage: gone with the tab, never written to disk

export function apiKey() {
  return sessionStorage.getItem(KEY) || "";
}

export function setApiKey(key) {
  if (key) sessionStorage.setItem(KEY, key);
  else sessionStorage.removeItem(KEY);
}

export class ApiError extends Error {
  constructor(status, message, code = null, retryAfter = null) {
    super(message);
    this.status = status; // 0: the server could not be reached
    this.code = code;
    this.retryAfter = retryAfter;
  }

  // One line for the page: what happened and what to do about it.
  describe() {
    if (this.status === 0) return `Cannot reach the server: ${this.message}`;
    if (this.status === 401) return `The server wants an API key (or the key is wrong): set it with the Key button. (${this.message})`;
    if (this.code === "halted")
      return `The server is halted, and takes no new work until it resumes: ${this.message.replace(/^halted: /, "")}`;
    const retry = this.retryAfter ? ` Retry after ${this.retryAfter} s.` : "";
    return `${this.status ? `${this.status}: ` : ""}${this.message}${retry}`;
  }
}

const listeners = new Set();
// `fn(error)` is called on every 401: the page asks for the key.
export function onUnauthorized(fn) {
  listeners.add(fn);
}

function headers(json) {
  const h = {};
  if (json) h["Content-Type"] = "application/json";
  const key = apiKey();
  if (key) h.Authorization = `Bearer ${key}`;
  return h;
}

export async function request(method, path, body, signal) {
  let resp;
  try {
    resp = await fetch(path, {
      method,
      headers: headers(body !== undefined),
      body: body !== undefined ? JSON.stringify(body) : undefined,
      signal,
      cache: "no-store",
    });
  } catch (e) {
    if (e.name === "AbortError") throw e;
    throw new ApiError(0, e.message || String(e), "network");
  }
  if (!resp.ok) {
    const err = await errorOf(resp);
    if (err.status === 401) listeners.forEach((fn) => fn(err));
    throw err;
  }
  return resp;
}

export async function getJSON(path) {
  return (await request("GET", path)).json();
}

export async function postJSON(path, body) {
  return (await request("POST", path, body)).json();
}

export async function errorOf(resp) {
  let message = resp.statusText || "error";
  let code = null;
  try {
    const body = await resp.json();
    const err = typeof body.error === "object" && body.error ? body.error : body;
    if (typeof err.message === "string") message = err.message;
    code = err.code || err.type || null;
  } catch {
    // not JSON: the status line says what there is to say
  }
  return new ApiError(resp.status, message, code, resp.headers.get("Retry-After"));
}

const STATUS_OF_TYPE = { invalid_request_error: 400, rate_limit_error: 429, service_unavailable: 503 };

// The JSON of each server-sent event's data, in order, until the stream ends or sends [DONE].
// An event carrying an error envelope (a failure after the stream began) is thrown as ApiError.
// Leaving the loop early cancels the body: the server sees the client go.
export async function* events(resp) {
  const reader = resp.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  let finished = false;
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) {
        finished = true;
        return;
      }
      buffer += decoder.decode(value, { stream: true }).replace(/\r\n?/g, "\n");
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const block = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        const data = block
          .split("\n")
          .filter((line) => line.startsWith("data:"))
          .map((line) => line.slice(5).replace(/^ /, ""))
          .join("\n");
        if (!data) continue; // a keep-alive comment
        if (data === "[DONE]") return;
        const event = JSON.parse(data);
        if (event && event.error && !event.type) {
          const e = event.error;
          throw new ApiError(STATUS_OF_TYPE[e.type] || 500, e.message || "the stream failed", e.code || e.type || null);
        }
        yield event;
      }
    }
  } finally {
    if (!finished) reader.cancel().catch(() => {});
  }
}
