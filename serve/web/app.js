// The page's entry: tabs, theme, the API key dialog, and the two tabs (chat.js, models.js).

import { apiKey, getJSON, onUnauthorized, setApiKey } from "./api.js";
import { Chat } from "./chat.js";
import { Models } from "./models.js";

const $ = (id) => document.getElementById(id);

// -- theme: the system's until chosen, then remembered --------------------------------------------
const THEME = "goinfer.theme";
function applyTheme(theme) {
  document.documentElement.dataset.theme = theme;
  $("theme-button").textContent = theme === "dark" ? "Light" : "Dark";
}
applyTheme(localStorage.getItem(THEME) || (matchMedia("(prefers-color-scheme: dark)").matches ? "dark" : "light"));
$("theme-button").addEventListener("click", () => {
  const next = document.documentElement.dataset.theme === "dark" ? "light" : "dark";
  localStorage.setItem(THEME, next);
  applyTheme(next);
});

// -- toast: one short line for what finished or failed away from where the user looks ------------
let toastTimer = null;
export function toast(text, error = false) {
  const t = $("toast");
  t.textContent = text;
  t.classList.toggle("error", error);
  t.hidden = false;
  clearTimeout(toastTimer);
  toastTimer = setTimeout(() => (t.hidden = true), error ? 8000 : 3500);
}

// -- the API key ----------------------------------------------------------------------------------
const dialog = $("key-dialog");
function askKey(why) {
  $("key-why").textContent =
    (why ? `${why} ` : "") +
    "The key is sent as Authorization: Bearer with every request and kept in this tab's session storage only, never in a URL.";
  $("key-input").value = apiKey();
  if (!dialog.open) dialog.showModal();
  $("key-input").focus();
}
function showKeyState() {
  $("key-button").textContent = apiKey() ? "Key ✓" : "Key";
}
$("key-button").addEventListener("click", () => askKey(""));
$("key-form").addEventListener("submit", (e) => {
  e.preventDefault();
  const action = e.submitter ? e.submitter.value : "save";
  if (action === "save") setApiKey($("key-input").value.trim());
  if (action === "clear") setApiKey("");
  dialog.close();
  showKeyState();
  if (action !== "cancel") refresh();
});
let asked = false;
onUnauthorized(() => {
  if (asked || dialog.open) return;
  asked = true; // once per page load: a wrong key then shows as an error where it was used
  askKey("This server needs an API key, or the one given is wrong.");
});
showKeyState();

// -- tabs -----------------------------------------------------------------------------------------
const chat = new Chat(toast);
const models = new Models(toast, () => chat.loadModels());
const TABS = { chat: $("tab-chat"), models: $("tab-models") };
function show(name) {
  for (const [tab, button] of Object.entries(TABS)) {
    button.setAttribute("aria-selected", String(tab === name));
    $(tab).hidden = tab !== name;
  }
  if (name === "models") models.open();
  else models.close();
  history.replaceState(null, "", name === "chat" ? "/" : `/#${name}`);
}
TABS.chat.addEventListener("click", () => show("chat"));
TABS.models.addEventListener("click", () => show("models"));

async function refresh() {
  let status = null;
  try {
    status = await getJSON("/web/status");
  } catch (e) {
    chat.notice(e.describe ? e.describe() : String(e));
  }
  models.setStatus(status);
  await chat.loadModels();
  if (!$("models").hidden) models.open();
}

chat.start();
show(location.hash === "#models" ? "models" : "chat");
refresh();
