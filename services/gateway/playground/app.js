// The StageDiff playground: a page to try prompts on, calling the gateway's own HTTP API from the browser.
//
// Plain JavaScript, no build step, no library: the page's Content-Security-Policy lets it run only this file,
// reach only its own origin, and show media only from blob: and data: URLs it makes itself.
// - The API key the user types is kept in sessionStorage (this tab only) and sent as `Authorization: Bearer`.
// - The models and what each takes come from GET /v1/models: only the controls a model accepts are shown, with
//   its limits as the inputs' bounds and its defaults as their values.
// - A video is POST /v1/videos; its progress comes from GET /v1/videos/{id}/events (server-sent events, read
//   with fetch, since an EventSource cannot send the key); the video from its /content, fetched with the key
//   into a blob: URL, since a <video src> cannot send headers either.
// - An image is POST /v1/images/generations, or /v1/images/edits with the uploaded image; the answer holds it.
// - Earlier jobs are GET /v1/videos; each can be shown, downloaded or deleted.
// The API paths are relative ("../v1"), so that the page works behind a proxy that adds a path prefix.
"use strict";

const API = "../v1";
const KEY_STORAGE = "stagediff.playground.apiKey";
const MODEL_STORAGE = "stagediff.playground.model";
const JOBS_SHOWN = 20;
const MAX_SAFE_SEED = Number.MAX_SAFE_INTEGER;
const EXTENSIONS = { "video/mp4": ".mp4", "video/webm": ".webm", "image/gif": ".gif", "image/png": ".png",
  "image/jpeg": ".jpg", "image/webp": ".webp" };

const $ = (id) => document.getElementById(id);

const state = {
  models: [],
  model: null,
  job: null, // the id of the job the result panel follows
  watching: null, // the AbortController of the progress stream being read
  objectUrls: [], // blob: URLs of the result shown, revoked when it is replaced
};

// ---------------------------------------------------------------- the API --

class ApiError extends Error {
  constructor(status, message) {
    super(message);
    this.status = status;
  }
}

function apiKey() {
  return sessionStorage.getItem(KEY_STORAGE) || "";
}

function withKey(headers) {
  const all = new Headers(headers);
  if (apiKey()) all.set("Authorization", `Bearer ${apiKey()}`);
  return all;
}

// The response of one API call; an ApiError with the gateway's message for any status but 2xx.
async function api(path, options = {}) {
  const response = await fetch(`${API}${path}`, { ...options, headers: withKey(options.headers) });
  if (!response.ok) throw await errorOf(response);
  return response;
}

async function apiJson(path, options) {
  return (await api(path, options)).json();
}

function postJson(path, body) {
  return apiJson(path, { method: "POST", headers: { "Content-Type": "application/json" }, body: JSON.stringify(body) });
}

async function errorOf(response) {
  let message = `${response.status} ${response.statusText}`;
  try {
    const body = await response.json();
    if (body.error && body.error.message) message = body.error.message;
  } catch {
    // not JSON: the status line says it
  }
  if (response.status === 401) message = `the API key was refused: ${message}`;
  return new ApiError(response.status, message);
}

// --------------------------------------------------------------- messages --

function setStatus(text) {
  $("status").textContent = text;
}

function showError(error) {
  $("error").textContent = error ? `Error: ${error.message}` : "";
  if (error instanceof ApiError && error.status === 401) $("api-key").focus();
}

// ---------------------------------------------------------------- the key --

function useKey(event) {
  event.preventDefault();
  sessionStorage.setItem(KEY_STORAGE, $("api-key").value.trim());
  showError(null);
  loadModels();
  refreshJobs();
}

function forgetKey() {
  sessionStorage.removeItem(KEY_STORAGE);
  $("api-key").value = "";
  $("api-key").focus();
}

// ------------------------------------------------------------- the models --

async function loadModels() {
  try {
    state.models = (await apiJson("/models")).data;
  } catch (error) {
    state.models = [];
    showError(error);
  }
  const select = $("model");
  const wanted = select.value || sessionStorage.getItem(MODEL_STORAGE);
  select.replaceChildren(...state.models.map((model) => new Option(model.id, model.id)));
  if (state.models.some((model) => model.id === wanted)) select.value = wanted;
  chooseModel();
}

function chooseModel() {
  const model = state.models.find((candidate) => candidate.id === $("model").value) || null;
  state.model = model;
  $("submit").disabled = model === null;
  if (model === null) {
    $("model-info").textContent = state.models.length ? "" : "No model to choose: enter an API key and reload.";
    return;
  }
  sessionStorage.setItem(MODEL_STORAGE, model.id);
  const status = model.status === "serving" ? "" : ` (${model.status})`;
  $("model-info").textContent = `${model.family}: makes ${model.output === "video" ? "videos" : "images"}${status}.`;
  showControls(model);
}

// Shows the controls `model` takes, bounded by its limits and set to its defaults.
function showControls(model) {
  const limits = model.limits;
  const video = model.output === "video";
  for (const element of document.querySelectorAll("[data-only=video]")) {
    element.hidden = !video;
    // A disabled control is neither checked nor sent.
    for (const control of element.querySelectorAll("input, select")) control.disabled = !video;
  }
  const [width, height] = model.default_size.split("x").map(Number);
  bound($("width"), { min: limits.width_multiple, max: limits.max_width, step: limits.width_multiple, value: width });
  bound($("height"), { min: limits.min_height, max: limits.max_height, step: limits.height_multiple, value: height });
  // Frame counts the model makes are 1, 1 + factor, 1 + 2 * factor, ...: the input's steps from its min.
  bound($("num_frames"), { min: 1, max: limits.max_frames, step: limits.temporal_factor, value: model.default_num_frames });
  bound($("fps"), { value: model.default_fps });
  bound($("num_inference_steps"), { max: limits.max_inference_steps, value: limits.default_num_inference_steps });
  bound($("guidance_scale"), { value: limits.default_guidance_scale });
  bound($("seed"), { max: MAX_SAFE_SEED });
  $("prompt").maxLength = limits.max_prompt_chars || 16384;
  $("negative_prompt").maxLength = $("prompt").maxLength;
  showLoras(model);
  showCache(limits);
  showImageInput(model);
}

// Sets an input's bounds and value; a bound of 0 (the model gives none) is left off.
function bound(input, { min, max, step, value }) {
  for (const [name, given] of [["min", min], ["max", max], ["step", step]]) {
    if (given) input.setAttribute(name, given);
    else if (given !== undefined) input.removeAttribute(name);
  }
  if (value !== undefined) input.value = value;
}

function showLoras(model) {
  const offered = model.limits.max_loras > 0 ? model.loras : [];
  $("lora-fields").hidden = offered.length === 0;
  $("lora-hint").textContent = `At most ${model.limits.max_loras} at once; the scale is how strongly each applies.`;
  $("loras").replaceChildren(...offered.map((name, index) => loraItem(name, index)));
}

function loraItem(name, index) {
  const item = document.createElement("li");
  item.className = "row";
  const use = Object.assign(document.createElement("input"), { type: "checkbox", id: `lora-${index}`, value: name });
  const scale = Object.assign(document.createElement("input"), {
    type: "number", id: `lora-${index}-scale`, min: -10, max: 10, step: "any", value: 1,
  });
  scale.dataset.lora = name;
  item.append(use, label(use.id, name), label(scale.id, "scale", ` of ${name}`), scale);
  return item;
}

// A <label> for `id`, with words only a screen reader says (`hidden`) after the visible ones.
function label(id, text, hidden = "") {
  const element = Object.assign(document.createElement("label"), { htmlFor: id, textContent: text });
  if (hidden) element.append(visuallyHidden(hidden));
  return element;
}

function visuallyHidden(text) {
  return Object.assign(document.createElement("span"), { className: "visually-hidden", textContent: text });
}

function showCache(limits) {
  const methods = limits.cache_methods;
  $("cache-fields").hidden = methods.length === 0;
  $("cache").replaceChildren(
    new Option(`model default (${limits.default_cache.method})`, ""),
    new Option("none: every step runs", "none"),
    ...methods.map((cache) => new Option(`${cache.method} (threshold ${cache.threshold})`, cache.method)),
  );
  chooseCache();
}

function chooseCache() {
  const chosen = state.model && state.model.limits.cache_methods.find((cache) => cache.method === $("cache").value);
  $("cache-threshold-field").hidden = !chosen;
  $("cache_threshold").value = "";
  $("cache_threshold").placeholder = chosen ? String(chosen.threshold) : "";
}

function showImageInput(model) {
  const roles = model.image_roles;
  const required = model.limits.required_image_roles.length > 0;
  $("image-field").hidden = roles.length === 0;
  $("image").required = required;
  const use = model.output === "video" ? "the first frame of the video" : "the image to edit";
  $("image-hint").textContent = `${required ? "Required" : "Optional"}: ${use} (PNG, JPEG or WebP).`;
}

// ------------------------------------------------------------ the request --

function numberOf(id) {
  const input = $(id);
  return input.value === "" ? undefined : Number(input.value);
}

function chosenLoras() {
  const checked = [...document.querySelectorAll("#loras input[type=checkbox]:checked")];
  return checked.map((box) => ({ name: box.value, scale: Number($(`${box.id}-scale`).value || 1) }));
}

// The body's fields every route shares (schemas.py `Diffusion`), as the form sets them.
function diffusionFields(model) {
  const fields = {
    model: model.id,
    prompt: $("prompt").value,
    negative_prompt: $("negative_prompt").value,
    width: numberOf("width"),
    height: numberOf("height"),
    num_inference_steps: numberOf("num_inference_steps"),
    guidance_scale: numberOf("guidance_scale"),
    seed: numberOf("seed"),
  };
  const loras = chosenLoras();
  if (loras.length > model.limits.max_loras) {
    throw new Error(`${loras.length} LoRA adapters chosen; this model takes at most ${model.limits.max_loras}`);
  }
  if (loras.length) fields.lora = loras;
  if ($("cache").value) fields.cache = $("cache").value;
  if (!$("cache-threshold-field").hidden) fields.cache_threshold = numberOf("cache_threshold");
  return withoutUnset(fields);
}

function withoutUnset(fields) {
  return Object.fromEntries(Object.entries(fields).filter(([, value]) => value !== undefined && value !== ""));
}

async function generate(event) {
  event.preventDefault();
  const model = state.model;
  if (model === null || !$("generate").reportValidity()) return;
  const image = $("image-field").hidden ? undefined : $("image").files[0];
  showError(null);
  clearResult();
  $("submit").disabled = true;
  try {
    const fields = diffusionFields(model);
    if (image && model.limits.max_image_bytes && image.size > model.limits.max_image_bytes) {
      throw new Error(`the image is ${image.size} bytes; this model takes at most ${model.limits.max_image_bytes}`);
    }
    if (model.output === "video") await makeVideo(fields, image);
    else await makeImage(fields, image);
  } catch (error) {
    if (error.name !== "AbortError") {
      showError(error);
      setStatus("The request did not complete.");
    }
  } finally {
    $("submit").disabled = false;
    refreshJobs();
  }
}

async function makeVideo(fields, image) {
  fields.num_frames = numberOf("num_frames");
  fields.fps = numberOf("fps");
  fields.output_format = $("output_format").value;
  if (image) fields.input_reference = await dataUrlOf(image);
  const video = await postJson("/videos", fields);
  refreshJobs();
  await follow(video.id);
}

function dataUrlOf(file) {
  return new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => resolve(reader.result);
    reader.onerror = () => reject(new Error(`${file.name} could not be read`));
    reader.readAsDataURL(file);
  });
}

// An image is answered whole once made: no progress to follow, the answer holds the file.
async function makeImage(fields, image) {
  Object.assign(fields, { n: 1, output_format: "png" });
  setStatus("Making the image; it comes when it is done.");
  showStage("image", null, null);
  let answer;
  if (image) {
    answer = await apiJson("/images/edits", { method: "POST", body: formOf(fields, image) });
  } else {
    answer = await postJson("/images/generations", fields);
  }
  const bytes = Uint8Array.from(atob(answer.data[0].b64_json), (char) => char.charCodeAt(0));
  const jobId = answer.job_ids[0];
  state.job = jobId;
  showStage("image", 1, 1);
  showMedia(new Blob([bytes], { type: "image/png" }), `${jobId}.png`, `seed ${answer.data[0].seed} · ${answer.size}`);
  setStatus(`Job ${jobId} completed.`);
}

// The fields as a multipart form (the edits route takes its image as a file): a form field holds one value.
function formOf(fields, image) {
  const form = new FormData();
  const { lora, ...rest } = fields;
  if (lora && lora.length > 1) throw new Error("an edit from this page takes one LoRA adapter");
  for (const [name, value] of Object.entries(rest)) form.append(name, String(value));
  if (lora) form.append("lora", `${lora[0].name}:${lora[0].scale}`);
  form.append("image", image);
  return form;
}

// ------------------------------------------------------- following a job --

// Shows a job's progress, stage by stage, from its events until it ends, then its video (or image).
async function follow(id) {
  stopWatching();
  clearResult();
  state.job = id;
  $("cancel").hidden = false;
  setStatus(`Job ${id}: following its progress.`);
  const watching = new AbortController();
  state.watching = watching;
  try {
    const completed = await watch(id, watching.signal);
    setStatus(`Job ${id}: completed; loading the result.`);
    await showContent(completed);
    setStatus(`Job ${id} completed.`);
  } finally {
    if (state.watching === watching) {
      state.watching = null;
      $("cancel").hidden = true;
    }
  }
}

function stopWatching() {
  if (state.watching) state.watching.abort();
  state.watching = null;
}

// Reads the job's server-sent events until `completed` (its Video object, returned) or `error` (thrown).
async function watch(id, signal) {
  const response = await api(`/videos/${encodeURIComponent(id)}/events`, { signal });
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) throw new Error(`the progress of job ${id} ended before the job did`);
      buffer += value.replaceAll("\r\n", "\n");
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const event = parseEvent(buffer.slice(0, end));
        buffer = buffer.slice(end + 2);
        if (event === null) continue; // a keepalive comment
        if (event.type === "completed") return event.data;
        if (event.type === "error") throw new Error(`job ${id} failed: ${event.data.error}`);
        showEvent(id, event);
      }
    }
  } finally {
    reader.cancel().catch(() => {});
  }
}

// One event of a text/event-stream: {type, data} with its data parsed as JSON; null for a comment.
function parseEvent(block) {
  let type = "message";
  const data = [];
  for (const line of block.split("\n")) {
    if (line === "" || line.startsWith(":")) continue;
    const colon = line.indexOf(":");
    const field = colon < 0 ? line : line.slice(0, colon);
    const value = colon < 0 ? "" : line.slice(colon + 1).replace(/^ /, "");
    if (field === "event") type = value;
    else if (field === "data") data.push(value);
  }
  return data.length ? { type, data: JSON.parse(data.join("\n")) } : null;
}

function showEvent(id, event) {
  if (event.type === "queued") {
    setStatus(`Job ${id}: queued, ${event.data.queue_position} ahead of it.`);
  } else if (event.type === "progress") {
    const { stage, step, total } = event.data;
    showStage(stage, step, total);
    setStatus(`Job ${id}: ${stage}, step ${step} of ${total}.`);
  }
}

// The progress bar of one stage, made on its first event; `step` null: under way, its steps unknown.
function showStage(stage, step, total) {
  const id = `stage-${stage}`;
  let bar = $(id);
  if (bar === null) {
    const item = document.createElement("li");
    bar = Object.assign(document.createElement("progress"), { id });
    const count = Object.assign(document.createElement("span"), { id: `${id}-count`, className: "count" });
    item.append(label(id, stage, " progress"), bar, count);
    $("stages").append(item);
  }
  if (step === null) {
    bar.removeAttribute("value");
    return;
  }
  bar.max = total;
  bar.value = step;
  $(`${id}-count`).textContent = `${step}/${total}`;
}

// Every stage's bar full: the last events before the result may not have reached the end of each.
function finishStages() {
  for (const bar of $("stages").querySelectorAll("progress")) {
    if (!bar.hasAttribute("max")) continue;
    bar.value = bar.max;
    $(`${bar.id}-count`).textContent = `${bar.max}/${bar.max}`;
  }
}

async function cancelJob() {
  const id = state.job;
  if (!id) return;
  try {
    await api(`/videos/${encodeURIComponent(id)}`, { method: "DELETE" });
    stopWatching();
    setStatus(`Job ${id} cancelled and deleted.`);
    $("cancel").hidden = true;
  } catch (error) {
    showError(error);
  }
  refreshJobs();
}

// --------------------------------------------------------------- results --

async function contentOf(id) {
  const response = await api(`/videos/${encodeURIComponent(id)}/content`);
  const blob = await response.blob();
  const named = /filename="([^"]+)"/.exec(response.headers.get("Content-Disposition") || "");
  return { blob, filename: named ? named[1] : `${id}${EXTENSIONS[blob.type] || ""}` };
}

async function showContent(job) {
  const { blob, filename } = await contentOf(job.id);
  finishStages();
  const length = job.num_frames > 1 ? ` · ${job.num_frames} frames at ${job.fps} fps` : "";
  showMedia(blob, filename, `seed ${job.seed} · ${job.size}${length} · ${job.num_inference_steps} steps`);
}

function showMedia(blob, filename, details) {
  revokeUrls();
  const url = URL.createObjectURL(blob);
  state.objectUrls.push(url);
  let media;
  if (blob.type.startsWith("video/")) {
    media = Object.assign(document.createElement("video"), {
      id: "player", src: url, controls: true, muted: true, autoplay: true, loop: true, playsInline: true,
    });
    media.setAttribute("aria-label", `the video of ${filename}`);
  } else {
    media = Object.assign(document.createElement("img"), { id: "player", src: url, alt: `the image of ${filename}` });
  }
  $("media").replaceChildren(media);
  $("output-details").textContent = details;
  Object.assign($("output-download"), { href: url, download: filename });
  $("output").hidden = false;
}

function clearResult() {
  revokeUrls();
  $("stages").replaceChildren();
  $("media").replaceChildren();
  $("output").hidden = true;
}

function revokeUrls() {
  for (const url of state.objectUrls) URL.revokeObjectURL(url);
  state.objectUrls = [];
}

// ------------------------------------------------------------------ jobs --

async function refreshJobs() {
  let page;
  try {
    page = await apiJson(`/videos?limit=${JOBS_SHOWN}`);
  } catch (error) {
    $("jobs-message").textContent = `The jobs could not be listed: ${error.message}`;
    return;
  }
  $("jobs-message").textContent = page.data.length ? "" : "No jobs yet.";
  $("jobs").replaceChildren(...page.data.map(jobItem));
}

function jobItem(job) {
  const item = document.createElement("li");
  item.className = "job";
  item.dataset.job = job.id;
  const prompt = Object.assign(document.createElement("p"), { className: "job-prompt", textContent: job.prompt });
  const created = new Date(job.created_at * 1000).toLocaleString();
  const progress = job.error ? `${job.status}: ${job.error.message}` : job.status === "completed" ? job.status
    : `${job.status} ${job.progress}%`;
  const frames = job.num_frames > 1 ? ` · ${job.num_frames} frames` : "";
  const meta = Object.assign(document.createElement("p"), {
    className: "hint", textContent: `${progress} · ${job.size}${frames} · ${job.model} · ${created}`,
  });
  const actions = document.createElement("div");
  actions.className = "row";
  if (!job.error) actions.append(jobButton("Show", job, () => showJob(job.id)));
  if (job.status === "completed") actions.append(jobButton("Download", job, () => download(job.id)));
  actions.append(jobButton("Delete", job, () => deleteJob(job.id)));
  item.append(prompt, meta, actions);
  return item;
}

// A button of a job's, named for screen readers with the job it acts on.
function jobButton(text, job, action) {
  const button = Object.assign(document.createElement("button"), {
    type: "button", textContent: text, className: text.toLowerCase(),
  });
  button.append(visuallyHidden(` job ${job.id}`));
  button.addEventListener("click", action);
  return button;
}

async function showJob(id) {
  showError(null);
  try {
    await follow(id);
  } catch (error) {
    if (error.name !== "AbortError") showError(error);
  }
}

async function download(id) {
  try {
    const { blob, filename } = await contentOf(id);
    const url = URL.createObjectURL(blob);
    const link = Object.assign(document.createElement("a"), { href: url, download: filename });
    document.body.append(link);
    link.click();
    link.remove();
    setTimeout(() => URL.revokeObjectURL(url), 60_000);
  } catch (error) {
    showError(error);
  }
}

async function deleteJob(id) {
  if (!window.confirm(`Delete job ${id} and its result?`)) return;
  try {
    await api(`/videos/${encodeURIComponent(id)}`, { method: "DELETE" });
    if (state.job === id) {
      stopWatching();
      clearResult();
      setStatus(`Job ${id} deleted.`);
    }
  } catch (error) {
    showError(error);
  }
  refreshJobs();
}

// ----------------------------------------------------------------- start --

function preferredVideoFormat() {
  const probe = document.createElement("video");
  return probe.canPlayType('video/mp4; codecs="avc1.42E01E"') ? "mp4" : "webm";
}

function start() {
  $("api-key").value = apiKey();
  $("output_format").value = preferredVideoFormat();
  $("key-form").addEventListener("submit", useKey);
  $("forget-key").addEventListener("click", forgetKey);
  $("model").addEventListener("change", chooseModel);
  $("reload-models").addEventListener("click", loadModels);
  $("cache").addEventListener("change", chooseCache);
  $("generate").addEventListener("submit", generate);
  $("cancel").addEventListener("click", cancelJob);
  $("refresh-jobs").addEventListener("click", refreshJobs);
  loadModels();
  refreshJobs();
}

start();
