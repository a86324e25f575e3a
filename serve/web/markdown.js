// A small Markdown renderer for model replies: text in, DOM nodes out.
//
// Nothing is ever parsed as HTML. Every piece of a reply becomes a text node inside one of a fixed
// set of elements (p, h1-h6, ul/ol/li, blockquote, pre/code, table, strong, em, del, code, a), so a
// reply cannot inject markup or script, whatever it holds. Links keep only http(s) and mailto URLs.
//
// What it reads (the CommonMark/GFM subset models write): fenced code blocks (``` or ~~~, a
// language after the fence; an unclosed fence runs to the end, as a reply streams in), ATX
// headings, thematic breaks, block quotes, bullet and numbered lists (nested by indentation),
// pipe tables, paragraphs (a single newline is a line break, as chat UIs show it), and inline
// code spans, **strong**, *emphasis*, ~~strikethrough~~ and [links](https://...).

const FENCE = /^ {0,3}(`{3,}|~{3,})\s*([^`\s]*)[^`]*$/;
const HEADING = /^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$/;
const RULE = /^ {0,3}([-*_])(\s*\1){2,}\s*$/;
const QUOTE = /^ {0,3}> ?(.*)$/;
const ITEM = /^(\s*)([-*+]|\d{1,9}[.)])\s+(.*)$/;
const TABLE_RULE = /^\s*\|?\s*:?-{2,}:?\s*(\|\s*:?-{2,}:?\s*)*\|?\s*$/;

function el(tag, cls, text) {
  const node = document.createElement(tag);
  if (cls) node.className = cls;
  if (text !== undefined) node.textContent = text;
  return node;
}

// `copy(text, button)`: the code blocks' copy button calls it.
export function render(src, copy) {
  const root = document.createDocumentFragment();
  blocks(src.replace(/\r\n?/g, "\n").split("\n"), root, copy);
  return root;
}

function blocks(lines, parent, copy) {
  let i = 0;
  while (i < lines.length) {
    const line = lines[i];
    if (!line.trim()) {
      i++;
      continue;
    }
    let m;
    if ((m = FENCE.exec(line))) {
      const close = new RegExp(`^ {0,3}${m[1][0]}{${m[1].length},}\\s*$`);
      const body = [];
      i++;
      while (i < lines.length && !close.test(lines[i])) body.push(lines[i++]);
      i++; // the closing fence (or past the end)
      parent.append(codeBlock(body.join("\n"), m[2], copy));
    } else if ((m = HEADING.exec(line))) {
      const h = el(`h${m[1].length}`);
      inline(m[2], h);
      parent.append(h);
      i++;
    } else if (RULE.test(line)) {
      parent.append(el("hr"));
      i++;
    } else if (QUOTE.test(line)) {
      const body = [];
      while (i < lines.length && lines[i].trim() && (m = QUOTE.exec(lines[i]))) {
        body.push(m[1]);
        i++;
      }
      const q = el("blockquote");
      blocks(body, q, copy);
      parent.append(q);
    } else if (ITEM.test(line)) {
      i = list(lines, i, parent, copy);
    } else if (line.includes("|") && i + 1 < lines.length && TABLE_RULE.test(lines[i + 1])) {
      i = table(lines, i, parent);
    } else {
      const para = [];
      while (i < lines.length && lines[i].trim() && !startsBlock(lines, i)) para.push(lines[i++].trim());
      const p = el("p");
      para.forEach((text, k) => {
        if (k) p.append(el("br"));
        inline(text, p);
      });
      parent.append(p);
    }
  }
}

function startsBlock(lines, i) {
  const line = lines[i];
  return (
    FENCE.test(line) ||
    HEADING.test(line) ||
    RULE.test(line) ||
    QUOTE.test(line) ||
    ITEM.test(line) ||
    (line.includes("|") && i + 1 < lines.length && TABLE_RULE.test(lines[i + 1]))
  );
}

// A list from line i: items at its indentation, each with the lines indented under it (its
// continuation and nested lists, rendered as blocks). Returns the index after the list.
function list(lines, i, parent, copy) {
  const first = ITEM.exec(lines[i]);
  const indent = first[1].length;
  const ordered = /\d/.test(first[2]);
  const node = el(ordered ? "ol" : "ul");
  if (ordered && parseInt(first[2], 10) !== 1) node.start = parseInt(first[2], 10);
  while (i < lines.length) {
    const m = ITEM.exec(lines[i]);
    if (!m || m[1].length !== indent || /\d/.test(m[2]) !== ordered) break;
    const body = [m[3]];
    i++;
    while (i < lines.length) {
      const line = lines[i];
      const deeper = line.length - line.trimStart().length > indent;
      if (line.trim() && !deeper) break;
      if (!line.trim() && !(i + 1 < lines.length && lines[i + 1].length - lines[i + 1].trimStart().length > indent))
        break;
      body.push(line.slice(Math.min(indent + 2, line.length - line.trimStart().length)));
      i++;
    }
    const li = el("li");
    if (body.length === 1) inline(body[0], li);
    else blocks(body, li, copy);
    node.append(li);
    while (i < lines.length && !lines[i].trim() && i + 1 < lines.length && ITEM.test(lines[i + 1])) i++;
  }
  parent.append(node);
  return i;
}

function cells(line) {
  let s = line.trim();
  if (s.startsWith("|")) s = s.slice(1);
  if (s.endsWith("|") && !s.endsWith("\\|")) s = s.slice(0, -1);
  return s.split(/(?<!\\)\|/).map((c) => c.trim().replace(/\\\|/g, "|"));
}

function table(lines, i, parent) {
  const wrap = el("div", "table");
  const t = el("table");
  const head = el("tr");
  for (const c of cells(lines[i])) {
    const th = el("th");
    inline(c, th);
    head.append(th);
  }
  const thead = el("thead");
  thead.append(head);
  t.append(thead);
  const tbody = el("tbody");
  i += 2;
  while (i < lines.length && lines[i].includes("|") && lines[i].trim()) {
    const tr = el("tr");
    for (const c of cells(lines[i])) {
      const td = el("td");
      inline(c, td);
      tr.append(td);
    }
    tbody.append(tr);
    i++;
  }
  t.append(tbody);
  wrap.append(t);
  parent.append(wrap);
  return i;
}

function codeBlock(text, lang, copy) {
  const box = el("div", "code");
  const head = el("div", "code-head");
  head.append(el("span", "lang", lang || "text"));
  const button = el("button", "copy", "Copy");
  button.type = "button";
  button.addEventListener("click", () => copy(text, button));
  head.append(button);
  const pre = el("pre");
  pre.append(el("code", lang ? `language-${lang.replace(/[^\w-]/g, "")}` : "", text));
  box.append(head, pre);
  return box;
}

// Inline spans, earliest first; text between them stays text.
const SPANS = [
  [/(`+)([\s\S]*?[^`])\1(?!`)/, (m, parent) => parent.append(el("code", "", m[2].replace(/^ (.*) $/, "$1")))],
  [/\[([^\]]+)\]\(\s*<?([^()\s<>]+)>?(?:\s+"[^"]*")?\s*\)/, link],
  [/\*\*(?=\S)([\s\S]*?\S)\*\*/, (m, parent) => wrap("strong", m[1], parent)],
  [/__(?=\S)([\s\S]*?\S)__(?!\w)/, (m, parent) => wrap("strong", m[1], parent)],
  [/~~(?=\S)([\s\S]*?\S)~~/, (m, parent) => wrap("del", m[1], parent)],
  [/\*(?=[^\s*])([\s\S]*?[^\s*])\*/, (m, parent) => wrap("em", m[1], parent)],
  [/(?<!\w)_(?=[^\s_])([\s\S]*?[^\s_])_(?!\w)/, (m, parent) => wrap("em", m[1], parent)],
  [/https?:\/\/[^\s<>()]+[^\s<>().,;:!?'"]/, (m, parent) => link([m[0], m[0], m[0]], parent)],
];

function wrap(tag, text, parent) {
  const node = el(tag);
  inline(text, node);
  parent.append(node);
}

function link(m, parent) {
  const url = m[2];
  if (!/^(https?:|mailto:)/i.test(url)) {
    parent.append(document.createTextNode(m[1]));
    return;
  }
  const a = el("a");
  a.href = url;
  a.target = "_blank";
  a.rel = "noopener noreferrer";
  inline(m[1], a);
  parent.append(a);
}

export function inline(text, parent) {
  while (text) {
    let best = null;
    for (const [re, make] of SPANS) {
      const m = re.exec(text);
      if (m && (best === null || m.index < best[0].index)) best = [m, make];
    }
    if (best === null) {
      parent.append(document.createTextNode(unescape(text)));
      return;
    }
    const [m, make] = best;
    if (m.index) parent.append(document.createTextNode(unescape(text.slice(0, m.index))));
    make(m, parent);
    text = text.slice(m.index + m[0].length);
  }
}

function unescape(text) {
  return text.replace(/\\([\\`*_{}\[\]()#+\-.!|~>])/g, "$1");
}
