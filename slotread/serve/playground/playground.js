// The slotread playground: builds a System One body from the page, posts it to /v1/systemone with the
// key typed in the page (kept in this page only), and draws the answers as probability bars.
"use strict";

const $ = (selector, root = document) => root.querySelector(selector);
const $$ = (selector, root = document) => Array.from(root.querySelectorAll(selector));

const EXAMPLE = {
  urgent: { type: "noul", instructions: "Is the customer in a hurry?" },
  intent: {
    type: "choice",
    instructions: "What does the customer want?",
    criteria: { refund: "money back", replacement: "a new card", other: null },
  },
};
// the question fields the form can show; anything else is edited as JSON
const FORM_FIELDS = new Set(["type", "instructions", "criteria", "depends_on", "alone"]);
let editingJson = false;

function element(tag, attributes = {}, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attributes)) {
    if (name === "class") node.className = value;
    // through the CSSOM: the page's content security policy refuses inline style attributes
    else if (name === "style") Object.assign(node.style, value);
    else node.setAttribute(name, value);
  }
  for (const child of children) node.append(child);
  return node;
}

// ---- questions: form <-> JSON ----

function criteriaText(question) {
  const criteria = question.criteria;
  if (criteria == null) return "";
  if (question.type === "score") return criteria.join("\n");
  return Object.entries(criteria)
    .map(([name, text]) => (text == null ? name : `${name}: ${text}`))
    .join("\n");
}

function parseCriteria(type, text) {
  const lines = text.split("\n").map((line) => line.trim()).filter(Boolean);
  if (type === "score") return lines;
  const criteria = {};
  for (const line of lines) {
    const cut = line.indexOf(": ");
    const [name, description] = cut < 0 ? [line, null] : [line.slice(0, cut), line.slice(cut + 2)];
    criteria[type === "noul" ? name.toLowerCase() : name] = description;
  }
  return criteria;
}

function criteriaHint(type) {
  if (type === "noul") return "optional: what yes and no mean (true: ..., false: ...)";
  if (type === "score") return "levels, low to high, one per line";
  return "options, one per line (name: description)";
}

function addQuestion(id = "", question = { type: "noul" }) {
  const card = $("#question-template").content.firstElementChild.cloneNode(true);
  $(".q-id", card).value = id;
  $(".q-type", card).value = question.type;
  $(".q-instructions", card).value = typeof question.instructions === "string" ? question.instructions : "";
  $(".q-criteria", card).value = criteriaText(question);
  const depends = question.depends_on == null ? [] : [].concat(question.depends_on);
  $(".q-depends", card).value = depends.join(", ");
  $(".q-alone", card).checked = Boolean(question.alone);
  const hint = () => ($(".q-criteria-hint", card).textContent = criteriaHint($(".q-type", card).value));
  $(".q-type", card).addEventListener("change", hint);
  $(".q-remove", card).addEventListener("click", () => {
    card.remove();
    refreshSnippets();
  });
  hint();
  $("#questions-form").append(card);
  return card;
}

function questionsFromForm() {
  const questions = {};
  for (const card of $$("#questions-form .question")) {
    const id = $(".q-id", card).value.trim();
    if (!id) throw new Error("every question needs an id");
    if (id in questions) throw new Error(`question id ${JSON.stringify(id)} is used twice`);
    const type = $(".q-type", card).value;
    const question = { type };
    const instructions = $(".q-instructions", card).value.trim();
    if (instructions) question.instructions = instructions;
    const criteria = parseCriteria(type, $(".q-criteria", card).value);
    if (type !== "noul" || Object.keys(criteria).length) question.criteria = criteria;
    const depends = $(".q-depends", card).value.split(",").map((s) => s.trim()).filter(Boolean);
    if (depends.length) question.depends_on = depends;
    if ($(".q-alone", card).checked) question.alone = true;
    questions[id] = question;
  }
  return questions;
}

function questionsToForm(questions) {
  for (const [id, question] of Object.entries(questions)) {
    const extra = Object.keys(question).filter((field) => !FORM_FIELDS.has(field));
    const plain = (value) => value == null || typeof value === "string";
    const criteria = question.criteria;
    const shown =
      criteria == null ||
      (Array.isArray(criteria) ? criteria.every((level) => typeof level === "string") : Object.values(criteria).every(plain));
    if (extra.length || !shown || !plain(question.instructions)) {
      throw new Error(`question ${JSON.stringify(id)} has fields the form cannot show (${extra.join(", ") || "non-text descriptions"}): keep editing it as JSON`);
    }
  }
  $("#questions-form").replaceChildren();
  for (const [id, question] of Object.entries(questions)) addQuestion(id, question);
}

function currentQuestions() {
  if (!editingJson) return questionsFromForm();
  try {
    return JSON.parse($("#questions-json").value);
  } catch (error) {
    throw new Error(`the questions JSON does not parse: ${error.message}`);
  }
}

function showTab(json) {
  try {
    if (json && !editingJson) $("#questions-json").value = JSON.stringify(questionsFromForm(), null, 2);
    if (!json && editingJson) questionsToForm(currentQuestions());
  } catch (error) {
    showError(error.message);
    return;
  }
  editingJson = json;
  showError("");
  $("#questions-json").hidden = !json;
  $("#questions-form").hidden = json;
  $("#add-question").hidden = json;
  $("#tab-json").classList.toggle("active", json);
  $("#tab-form").classList.toggle("active", !json);
}

// ---- the request ----

function requestBody() {
  const stateText = $("#state").value;
  let state = stateText;
  if ($("#state-json").checked) {
    try {
      state = JSON.parse(stateText);
    } catch (error) {
      throw new Error(`the state is not JSON: ${error.message}`);
    }
  }
  const body = { state, questions: currentQuestions() };
  const samples = $("#opt-samples").value.trim();
  if (samples === "auto") body.samples = "auto";
  else if (samples && samples !== "1") body.samples = Number(samples);
  const seed = Number($("#opt-seed").value || 0);
  if (seed) body.seed = seed;
  const permutations = Number($("#opt-permutations").value || 1);
  if (permutations !== 1) body.x_permutations = permutations;
  if ($("#opt-joint").checked) body.joint = true;
  const instructions = $("#opt-instructions").value.trim();
  if (instructions) body.instructions = instructions;
  return body;
}

function headers() {
  const result = { "content-type": "application/json" };
  const key = $("#api-key").value.trim();
  if (key) result.authorization = `Bearer ${key}`;
  return result;
}

// A JSON value as a Python literal (JSON string literals are valid Python string literals).
function python(value, indent = "") {
  if (value === null) return "None";
  if (value === true) return "True";
  if (value === false) return "False";
  if (typeof value !== "object") return JSON.stringify(value);
  const inner = indent + "    ";
  const items = Array.isArray(value)
    ? value.map((item) => inner + python(item, inner))
    : Object.entries(value).map(([k, v]) => `${inner}${JSON.stringify(k)}: ${python(v, inner)}`);
  const [open, close] = Array.isArray(value) ? ["[", "]"] : ["{", "}"];
  return items.length ? `${open}\n${items.join(",\n")},\n${indent}${close}` : open + close;
}

function refreshSnippets() {
  let body;
  try {
    body = requestBody();
  } catch (error) {
    $("#curl").textContent = $("#python").textContent = `(${error.message})`;
    return;
  }
  const url = `${location.origin}/v1/systemone`;
  const keyed = Boolean($("#api-key").value.trim());
  $("#curl").textContent = [
    `curl -sS ${url} \\`,
    "  -H 'content-type: application/json' \\",
    ...(keyed ? ['  -H "authorization: Bearer $SLOTREAD_API_KEY" \\'] : []),
    "  -d @- <<'JSON'",
    JSON.stringify(body, null, 2),
    "JSON",
  ].join("\n");
  $("#python").textContent = [
    ...(keyed ? ["import os", ""] : []),
    "import httpx",
    "",
    `body = ${python(body)}`,
    keyed
      ? `response = httpx.post(\n    ${JSON.stringify(url)},\n    json=body,\n    headers={"authorization": f"Bearer {os.environ['SLOTREAD_API_KEY']}"},\n    timeout=60,\n)`
      : `response = httpx.post(${JSON.stringify(url)}, json=body, timeout=60)`,
    "response.raise_for_status()",
    'print(response.json()["answers"])',
  ].join("\n");
}

// ---- the answers ----

function showError(message) {
  $("#error").textContent = message;
}

function errorMessage(status, payload) {
  const detail = payload && payload.detail;
  if (Array.isArray(detail)) return detail.map((d) => `${d.loc.join(".")}: ${d.msg}`).join("\n");
  if (status === 401) return "the server wants an API key: type it at the top of the page";
  if (detail && detail.message) return `${status}: ${detail.message}`;
  return `the server answered ${status}`;
}

function bar(questionId, option, p, stderr) {
  const row = element("div", { class: "bar", "data-question": questionId, "data-option": option, "data-p": String(p) });
  const track = element("div", { class: "track" });
  track.append(element("div", { class: "fill", style: { width: `${(100 * p).toFixed(2)}%` } }));
  let value = p.toFixed(3);
  if (stderr != null) {
    const low = Math.max(0, p - stderr);
    const high = Math.min(1, p + stderr);
    const span = { left: `${(100 * low).toFixed(2)}%`, width: `${(100 * (high - low)).toFixed(2)}%` };
    track.append(element("div", { class: "whisker", style: span }));
    value += ` ± ${stderr.toFixed(3)}`;
  }
  row.append(element("span", { class: "name" }, option), track, element("span", { class: "value" }, value));
  return row;
}

function levelText(level) {
  return typeof level === "string" ? level : JSON.stringify(level);
}

function answerCard(id, answer) {
  const card = element("div", { class: "answer", "data-question": id });
  const title = element("h3", {}, id, " ");
  card.append(title);
  if (answer === null) {
    title.append(element("span", { class: "muted" }, "not asked"));
    return card;
  }
  let rows;
  let headline;
  let confidence = answer.confidence;
  if (answer.type === "noul") {
    const stderr = answer.x_stderr;
    rows = [["yes", answer.noul, stderr], ["no", 1 - answer.noul, stderr]];
    headline = answer.noul >= 0.5 ? "yes" : "no";
    confidence = Math.abs(2 * answer.noul - 1);
  } else {
    const stderr = answer.x_stderr || {};
    rows = Object.entries(answer.probabilities).map(([name, p]) => [
      answer.type === "score" ? `${name} · ${levelText(answer.legend[name])}` : name,
      p,
      stderr[name],
    ]);
    headline = answer.type === "choice" ? answer.choice : `score ${answer.score.toFixed(2)}`;
  }
  title.append(element("span", { class: "headline" }, headline));
  const facts = [`confidence ${confidence.toFixed(3)}`, `entropy ${answer.x_entropy.toFixed(3)}`, `${answer.x_reads} read${answer.x_reads === 1 ? "" : "s"}`];
  if (answer.x_agreement != null) facts.push(`agreement ${answer.x_agreement.toFixed(2)}`);
  card.append(element("p", { class: "facts muted" }, facts.join(" · ")));
  for (const [name, p, stderr] of rows) card.append(bar(id, name, p, stderr));
  return card;
}

async function decide() {
  showError("");
  let body;
  try {
    body = requestBody();
  } catch (error) {
    showError(error.message);
    return;
  }
  const button = $("#decide");
  button.disabled = true;
  document.body.classList.add("busy");
  const started = performance.now();
  try {
    const response = await fetch("/v1/systemone", { method: "POST", headers: headers(), body: JSON.stringify(body) });
    const payload = await response.json().catch(() => null);
    $("#response").textContent = JSON.stringify(payload, null, 2);
    if (!response.ok) {
      showError(errorMessage(response.status, payload));
      return;
    }
    $("#timing").textContent = `${payload.model} · ${Math.round(performance.now() - started)} ms`;
    $("#answers").replaceChildren(...Object.entries(payload.answers).map(([id, answer]) => answerCard(id, answer)));
  } catch (error) {
    showError(`the request failed: ${error.message}`);
  } finally {
    button.disabled = false;
    document.body.classList.remove("busy");
  }
}

async function copy(name) {
  const text = $(`#${name}`).textContent;
  try {
    await navigator.clipboard.writeText(text);
  } catch {
    // no clipboard API (a plain-http origin other than localhost): select the text instead
    getSelection().selectAllChildren($(`#${name}`));
  }
}

async function showModel() {
  const response = await fetch("/v1/models", { headers: headers() }).catch(() => null);
  if (response && response.ok) {
    const models = (await response.json()).models;
    if (models.length) $("#model").textContent = models[0].name;
  }
}

for (const [id, question] of Object.entries(EXAMPLE)) addQuestion(id, question);
$("#add-question").addEventListener("click", () => {
  addQuestion();
  refreshSnippets();
});
$("#tab-form").addEventListener("click", () => showTab(false));
$("#tab-json").addEventListener("click", () => showTab(true));
$("#decide").addEventListener("click", decide);
$("#api-key").addEventListener("change", showModel);
for (const button of $$("[data-copy]")) button.addEventListener("click", () => copy(`${button.dataset.copy}`));
$("#request").addEventListener("input", refreshSnippets);
$("#request").addEventListener("change", refreshSnippets);
refreshSnippets();
showModel();
