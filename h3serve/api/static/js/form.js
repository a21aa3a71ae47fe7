// The create form: task picker, prompt, duration, canvas, steps, seed, shifts and solver. It builds one request
// description that the submission, the history and the curl / Python snippets all share, so the snippets
// reproduce exactly what was sent.
import { apiJson } from "./api.js";
import { GuideTimeline } from "./guides.js";
import { Inputs } from "./inputs.js";
import { canvasForAspect, durationInfo, onGrid, parseAspect, ratioAllowed, sizeProblem } from "./rules.js";

const $ = id => document.getElementById(id);
const codePoints = text => [...text].length;  // as Python's len(): an emoji is one character, not two
// Browsers send every line break of a form field as CRLF: the prompt as the server will read (and count) it.
const promptAsSent = () => $("prompt").value.replace(/\r\n|\r|\n/g, "\r\n");

// The server's `param` -> the id of the error line next to that control (and the control to mark invalid).
const FIELD_OF_PARAM = {
  prompt: "prompt", seconds: "seconds", "extra_params.duration": "seconds", num_frames: "seconds",
  aspect_ratio: "aspect_ratio", "extra_params.aspect_ratio": "aspect_ratio", size: "size", width: "size",
  height: "size", num_inference_steps: "steps", seed: "seed", flow_shift: "flow_shift",
  "extra_params.flow_shift": "flow_shift", "extra_params.audio_flow_shift": "audio_flow_shift",
  "extra_params.sample_solver": "sample_solver", num_outputs_per_prompt: "num_outputs", n: "num_outputs",
  control_reference: "control", mask_reference: "control", source_reference: "control",
  "extra_params.task": "task", task: "task", "extra_params.frame_indices": "task", references: "refs",
  "extra_params.long_video": "long_video", "extra_params.long_video_mode": "long_video", long_video_mode: "long_video",
  "extra_params.continuation_prompts": "continuation_prompts", continuation_prompts: "continuation_prompts",
  source_video: "source_video", video_noise_mask: "video_noise_mask",
  lora: "lora", "lora.name": "lora", "lora.path": "lora", "lora.scale": "lora",
};
const CONTROL_OF_FIELD = {
  control: "control-type",
  size: "width", refs: "ref-input", task: null, long_video: "long-mode", continuation_prompts: "window-prompts",
  source_video: "source-video", video_noise_mask: "video-mask",
};
// The duration cap of each long video mode (h3serve/rules/long_video.py).
const maxSeconds = (mode, limits) => ({
  full: limits.max_full_duration_s, continuation: limits.max_continuation_duration_s,
})[mode] ?? limits.max_duration_s;
const windowPrompts = () => $("window-prompts").value.split(/\r\n|\r|\n/).map(line => line.trim()).filter(Boolean);

export class CreateForm {
  constructor(config, onSubmit) {
    this.config = config;
    this.inputs = new Inputs(config, () => this.update());
    this.guides = new GuideTimeline(config, () => this.update());
    const d = config.defaults;
    $("seconds").value = d.duration_s;
    $("steps").value = d.steps;
    $("seed").value = d.seed;
    $("flow_shift").value = d.flow_shift;
    $("audio_flow_shift").value = d.audio_flow_shift;
    for (const name of config.names.sample_solvers) {  // the server's solvers; the default first
      $("sample_solver").append(Object.assign(document.createElement("option"), { value: name, textContent: name }));
    }
    $("sample_solver").value = d.sample_solver;
    $("num_outputs").max = config.limits.max_outputs_per_prompt;
    for (const name of config.names.control_types) {  // the ControlNet's control types
      $("control-type").append(Object.assign(document.createElement("option"), { value: name, textContent: name }));
    }
    $("width").max = $("height").max = d.max_edge;
    const canvas = canvasForAspect(...parseAspect(d.aspect_ratio), d, config.limits);
    [$("width").value, $("height").value] = [canvas.width, canvas.height];  // "explicit size" starts there
    for (const radio of document.querySelectorAll("input[name=task]")) {
      radio.disabled = !config.tasks.includes(radio.value);  // a checkpoint may load one DiT only
    }
    for (const el of document.querySelectorAll("#create input, #create select, #create textarea")) {
      el.addEventListener("input", () => this.update());
    }
    $("dice").addEventListener("click", () => {
      $("seed").value = crypto.getRandomValues(new Uint32Array(1))[0];
      this.update();
    });
    $("create").addEventListener("submit", event => { event.preventDefault(); onSubmit(); });
    this.adapters = {};
    this.loadAdapters();
    this.update();
  }

  // The adapter menu: the LoRA cards GET /v1/models lists (hidden when the server preloads none).
  async loadAdapters() {
    let models = [];
    try { models = (await apiJson("/v1/models")).data; } catch { return; }  // e.g. no API key yet
    for (const card of models.filter(m => m.lora)) {
      this.adapters[card.id] = card;
      const option = document.createElement("option");
      option.value = option.textContent = card.id;
      $("lora").append(option);
    }
    $("lora-field").hidden = Object.keys(this.adapters).length === 0;
    this.update();
  }

  // The chosen adapter's card, or null.
  adapter() {
    return this.adapters[$("lora").value] ?? null;
  }

  get task() {
    return document.querySelector("input[name=task]:checked").value;
  }

  setTask(task) {
    document.querySelector(`input[name=task][value=${task}]`).checked = true;
    this.update();
  }

  update() {
    for (const section of document.querySelectorAll(".task-only")) section.hidden = section.dataset.task !== this.task;
    const max = this.config.limits.max_prompt_chars;
    const length = codePoints(promptAsSent());
    $("prompt-count").textContent = `${length.toLocaleString("en")} / ${max.toLocaleString("en")} characters`;
    $("prompt-count").classList.toggle("over", length > max);
    const seconds = Number($("seconds").value);
    const mode = $("long-mode").value;
    $("window-prompts-field").hidden = mode !== "continuation";
    const limits = { ...this.config.limits, max_duration_s: maxSeconds(mode, this.config.limits) };
    const info = durationInfo(seconds, limits);
    const { min_duration_s: lo, max_duration_s: hi } = limits;
    $("seconds-info").textContent = info
      ? `${seconds} s → ${info.frames} frames, ${info.seconds.toFixed(2)} s`
      : `between ${lo} and ${hi} s`;
    this.guides.setFrames(info ? info.frames : 0);
    const explicit = $("size-mode").value === "size";
    $("size-field").hidden = !explicit;
    $("aspect-field").hidden = explicit;
    const canvas = this.canvas();
    $("canvas-info").textContent = canvas.problem || `${canvas.width}×${canvas.height} px (${canvas.source})`;
    const adapter = this.adapter();
    const turbo = adapter && (adapter.turbo || adapter.pdd);  // a few-step adapter pins its steps and shifts
    $("lora-info").textContent = turbo ? `${turbo.forwards} forwards, its own shifts (${turbo.tasks.join(", ")})` : "";
    // A Turbo adapter pins its steps and shifts and runs Euler only: the request leaves them out.
    for (const id of ["steps", "flow_shift", "audio_flow_shift", "sample_solver"]) $(id).disabled = Boolean(turbo);
  }

  // The canvas the server will use, by the same rules: explicit size, else the aspect ratio's canvas (the
  // request's, else the first keyframe's for FL2VA, else the model default).
  canvas() {
    const { defaults, limits } = this.config;
    if ($("size-mode").value === "size") {
      const [asked, askedHeight] = [Number($("width").value), Number($("height").value)];
      const [width, height] = [onGrid(asked, limits), onGrid(askedHeight, limits)];
      const floored = width !== asked || height !== askedHeight;
      const source = floored ? `explicit size, floored to multiples of ${limits.spatial_multiple}` : "explicit size";
      return { width, height, problem: sizeProblem(width, height, defaults, limits), source };
    }
    let aspect = parseAspect($("aspect_ratio").value);
    let source = `aspect ${$("aspect_ratio").value}`;
    const keyframe = this.task === "fl2va" ? this.inputs.firstKeyframeSize() : null;
    if (!aspect && keyframe) [aspect, source] = [keyframe, "first keyframe's aspect"];
    if (!aspect) [aspect, source] = [parseAspect(defaults.aspect_ratio), `default ${defaults.aspect_ratio}`];
    if (!ratioAllowed(...aspect, limits)) return { problem: "aspect ratio outside 1:4 to 4:1" };
    return { ...canvasForAspect(...aspect, defaults, limits), source };
  }

  // { task, fields: {name: text}, extra: {...}, files: [[field, File]] }: exactly what is sent.
  request() {
    const task = this.task;
    const fields = { prompt: promptAsSent(), seconds: $("seconds").value.trim() };
    if ($("size-mode").value === "size") fields.size = `${$("width").value.trim()}x${$("height").value.trim()}`;
    else if ($("aspect_ratio").value) fields.aspect_ratio = $("aspect_ratio").value;
    const optional = { num_inference_steps: "steps", seed: "seed", flow_shift: "flow_shift" };
    if ($("num_outputs").value.trim() && $("num_outputs").value.trim() !== "1") {
      fields.num_outputs_per_prompt = $("num_outputs").value.trim();
    }
    for (const [name, id] of Object.entries(optional)) if ($(id).value.trim()) fields[name] = $(id).value.trim();
    if (!fields.seconds) delete fields.seconds;
    const { files, extra } = this.inputs.files(task);
    const guides = this.guides.request();  // the manifest as JSON text, one guide_files upload per guide
    if (guides.manifest) fields.timeline_guides = guides.manifest;
    files.push(...guides.files);
    const audioShift = $("audio_flow_shift").value.trim();
    if (audioShift) extra.audio_flow_shift = Number(audioShift);
    const solver = $("sample_solver").value;
    if (solver && solver !== this.config.defaults.sample_solver) extra.sample_solver = solver;
    const mode = $("long-mode").value;
    if (mode) Object.assign(extra, { long_video: true, long_video_mode: mode });
    if (mode === "continuation" && windowPrompts().length) extra.continuation_prompts = windowPrompts();
    const control = $("control-type").value;  // a ControlNet control: its settings, its media as uploads
    if (control) {
      const scale = $("control-scale").value.trim();
      extra[control] = scale && scale !== "1" ? { control_context_scale: Number(scale) } : {};
      for (const [field, id] of [["control_reference", "control-video"], ["mask_reference", "control-mask"],
                                 ["source_reference", "control-source"]]) {
        if ($(id).files[0]) files.push([field, $(id).files[0]]);
      }
    }
    const source = $("source-video").files[0];  // latent-mask editing: the source and its mask (JSON text)
    if (source) files.push(["source_video", source]);
    if ($("video-mask").value.trim()) fields.video_noise_mask = $("video-mask").value.trim();
    const adapter = this.adapter();
    if (adapter) {
      fields.lora = JSON.stringify({ name: adapter.id });
      if (adapter.turbo || adapter.pdd) {  // it pins the steps and shifts: the request leaves them out
        delete fields.num_inference_steps;
        delete fields.flow_shift;
        delete extra.audio_flow_shift;
        delete extra.sample_solver;
      }
    }
    return { task, fields, extra, files };
  }

  // Problems found before sending: [[field, message]]; the server checks everything again.
  problems() {
    const problems = [];
    const prompt = promptAsSent();
    if (!prompt.trim()) problems.push(["prompt", "prompt: must not be empty"]);
    if (codePoints(prompt) > this.config.limits.max_prompt_chars) {
      const max = this.config.limits.max_prompt_chars;
      problems.push(["prompt", `prompt: is ${codePoints(prompt)} characters long; the limit is ${max}`]);
    }
    const sent = [...this.inputs.files(this.task).files, ...this.guides.request().files];
    const bytes = sent.reduce((sum, [, file]) => sum + file.size, 0);
    const cap = this.config.max_body_bytes;
    if (bytes > cap) {
      const message = `the files add up to ${(bytes / 2 ** 20).toFixed(1)} MiB; ` +
        `a request is at most ${cap / 2 ** 20} MiB`;
      problems.push([this.task === "ref2va" ? "references" : "keyframes", message]);
    }
    return [...problems, ...this.inputs.problems(this.task), ...this.guides.problems()];
  }

  clearErrors() {
    for (const el of document.querySelectorAll("#create .field-error:not(#refs-error)")) {
      if (!el.closest(".slot, #ref-list")) el.textContent = "";
    }
    for (const el of document.querySelectorAll("#create [aria-invalid]")) el.removeAttribute("aria-invalid");
  }

  // Show `message` next to the control the server's `param` names (else under the Generate button).
  showError(param, message) {
    const mediaLine = this.inputs.errorElementFor(this.task, param) || this.guides.errorElementFor(param);
    const controlParam = /^extra_params\.(canny|depth|hed|mlsd|pose|inpaint)\b/.test(param || "");
    const field = FIELD_OF_PARAM[param] || (controlParam ? "control" : undefined);
    const line = mediaLine || (field && $(`${field}-error`)) || $("form-error");
    line.textContent = message;
    const controlId = field && (field in CONTROL_OF_FIELD ? CONTROL_OF_FIELD[field] : field);
    const control = controlId && $(controlId);
    if (control) {
      control.setAttribute("aria-invalid", "true");
      control.focus();
    }
    line.scrollIntoView({ block: "nearest" });
  }
}
