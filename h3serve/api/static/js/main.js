// Wires the page together: configuration, API key, the create form, live progress, result, a job's webhook
// deliveries, history and the Live mode (a real-time session, on a server started with --realtime-lora).
import { ApiError, apiJson, apiKey, setApiKey } from "./api.js";
import { DeliveriesView } from "./deliveries.js";
import { Examples } from "./examples.js";
import { CreateForm } from "./form.js";
import { History } from "./history.js";
import { LiveView } from "./live.js";
import { ProgressView } from "./progress.js";
import { ResultView } from "./result.js";

const $ = id => document.getElementById(id);
const REQUESTS = "h3serve-requests";  // job id -> the request this browser sent (for the snippets)
const MAX_REMEMBERED = 200;

function remembered() {
  try { return JSON.parse(localStorage.getItem(REQUESTS)) || {}; } catch { return {}; }
}

function remember(id, request) {
  const all = remembered();
  all[id] = { ...request, files: request.files.map(([field, file]) => [field, { name: file.name }]) };
  const ids = Object.keys(all);
  for (const old of ids.slice(0, Math.max(0, ids.length - MAX_REMEMBERED))) delete all[old];
  localStorage.setItem(REQUESTS, JSON.stringify(all));
}

function showAuthError(error, focus) {
  $("key-box").open = true;
  $("api-key-error").textContent = error.message;
  $("api-key").setAttribute("aria-invalid", "true");
  if (focus) $("api-key").focus();
}

function setUpKey(config) {
  const input = $("api-key");
  input.value = apiKey();
  if (config.api_key_required && !apiKey()) $("key-box").open = true;
  const save = () => {
    setApiKey(input.value.trim());
    input.removeAttribute("aria-invalid");
    $("api-key-error").textContent = "";
    history.refresh();
  };
  input.addEventListener("change", save);
  $("key-form").addEventListener("submit", event => { event.preventDefault(); save(); });
}

function formData(request) {
  const data = new FormData();
  for (const [name, value] of Object.entries(request.fields)) data.append(name, value);
  if (Object.keys(request.extra).length) data.append("extra_params", JSON.stringify(request.extra));
  for (const [field, file] of request.files) data.append(field, file, file.name);
  return data;
}

async function submit() {
  form.clearErrors();
  const problems = form.problems();
  if (problems.length) {
    for (const [param, message] of problems.reverse()) form.showError(param, message);
    return;
  }
  const request = form.request();
  $("generate").disabled = true;
  try {
    const job = await apiJson("/v1/videos", { method: "POST", body: formData(request) });
    remember(job.id, request);
    deliveries.hide();
    progress.track(job, request);
    history.refresh();
  } catch (e) {
    if (e instanceof ApiError && e.status === 401) showAuthError(e, true);
    else form.showError(e.param, e.message);
  } finally {
    $("generate").disabled = false;
  }
}

// POST /v1/videos/extensions: the shown video followed by the form's duration more, described by its prompt.
async function extend() {
  if (!result.current) return;
  form.clearErrors();
  const { fields } = form.request();
  const data = new FormData();
  for (const name of ["prompt", "seconds", "num_inference_steps", "seed", "size"]) {
    if (fields[name]) data.append(name, fields[name]);
  }
  data.append("video[id]", result.current.id);
  $("extend").disabled = true;
  try {
    const job = await apiJson("/v1/videos/extensions", { method: "POST", body: data });
    deliveries.hide();
    progress.track(job, null);
    history.refresh();
  } catch (e) {
    if (e instanceof ApiError && e.status === 401) showAuthError(e, true);
    else form.showError(e.param, e.message);
  } finally {
    $("extend").disabled = false;
  }
}

function onError(e) {
  if (e instanceof ApiError && e.status === 401) showAuthError(e, false);
  else $("history-error").textContent = e.message;
}

function open(job) {
  const request = remembered()[job.id] || null;
  if (job.status === "completed") result.show(job, request).catch(onError);
  else progress.track(job, request);
  if (job.status === "completed" || job.status === "failed") deliveries.show(job.id);
  else deliveries.hide();
}

const config = await (await fetch("/web/config")).json();
$("model").textContent = `model ${config.model} · ${config.tasks.join(", ")}`;
const form = new CreateForm(config, submit);
new Examples(config, form).load();
const result = new ResultView(config, async file => {
  form.setTask("fl2va");
  await form.inputs.useAsFirstFrame(file);
  form.update();
  $("prompt").focus();
});
const deliveries = new DeliveriesView();
const progress = new ProgressView(job => {
  history.refresh();
  if (job.status === "completed") open(job);
  else deliveries.show(job.id);  // failed, or cancelled (deleted unfinished: it sends video.failed)
});
const history = new History({ onOpen: open, onError, ready: () => !config.api_key_required || apiKey() });
$("extend").addEventListener("click", extend);
setUpKey(config);
if (config.realtime.enabled) new LiveView(config);
history.refresh();
document.body.dataset.ready = "true";
