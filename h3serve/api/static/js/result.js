// A finished job: the player (with sound), download, the spritesheet as a hover scrub, its parameters,
// "copy as curl" / "copy as Python" and "use this frame as first frame"; a job of several outputs shows a
// gallery of their thumbnails that picks the one the player, download and scrub show.
import { fileUrl } from "./api.js";
import { curlCommand, pythonSnippet } from "./snippets.js";

const $ = id => document.getElementById(id);

async function copy(text, what) {
  try {
    await navigator.clipboard.writeText(text);
    $("copy-status").textContent = `${what} copied`;
  } catch {
    $("copy-status").textContent = `Could not copy; select the ${what} text below`;
  }
}

function setParams(job, request) {
  const rows = [
    ["Job", job.id], ["Prompt", job.prompt], ["Canvas", job.size],
    ["Duration", `${job.seconds} s requested → ${job.num_frames} frames, ` +
      `${job.duration_s.toFixed(2)} s at ${job.fps} fps`],
  ];
  if (request) {
    rows.push(["Task", request.task]);
    for (const [name, value] of Object.entries(request.fields)) if (name !== "prompt") rows.push([name, value]);
    for (const [name, value] of Object.entries(request.extra)) {
      rows.push([`extra_params.${name}`, JSON.stringify(value)]);
    }
    for (const [field, file] of request.files) rows.push([field, file.name]);
  }
  rows.push(["Inference time", `${(job.inference_time_s || 0).toFixed(2)} s`]);
  for (const [stage, s] of Object.entries(job.stage_durations || {})) rows.push([`  ${stage}`, `${s.toFixed(3)} s`]);
  $("params").replaceChildren(...rows.flatMap(([name, value]) => [
    Object.assign(document.createElement("dt"), { textContent: name }),
    Object.assign(document.createElement("dd"), { textContent: value }),
  ]));
}

export class ResultView {
  constructor(config, onUseFrame) {
    this.config = config;
    this.onUseFrame = onUseFrame;  // (File) -> a new FL2VA request with it as the first frame
    this.current = null;
    $("copy-curl").addEventListener("click", () => copy($("curl-text").textContent, "curl command"));
    $("copy-python").addEventListener("click", () => copy($("python-text").textContent, "Python snippet"));
    $("use-frame").addEventListener("click", () => this.useFrame());
    const view = $("scrub-view");
    view.addEventListener("pointermove", event => {
      const box = view.getBoundingClientRect();
      this.showTile(Math.floor(((event.clientX - box.left) / box.width) * this.tiles));
    });
    view.addEventListener("keydown", event => {
      const delta = { ArrowRight: 1, ArrowLeft: -1 }[event.key];
      if (delta) { event.preventDefault(); this.showTile(this.tile + delta); }
    });
  }

  async show(job, request) {
    this.current = job;
    $("result").hidden = false;
    await this.showGallery(job);
    await this.showOutput(job, 0);
    setParams(job, request);
    const known = Boolean(request);
    for (const id of ["copy-curl", "copy-python"]) $(id).disabled = !known;
    $("curl-text").textContent = known
      ? curlCommand(location.origin, request)
      : "Made outside this browser: its parameters are unknown here.";
    $("python-text").textContent = known ? pythonSnippet(location.origin, request) : "";
    $("copy-status").textContent = "";
  }

  // One output in the player, the download link and the scrub; its gallery button pressed.
  async showOutput(job, index) {
    const url = await fileUrl(job.id, "video", index);
    $("player").src = url;
    $("download").href = url;
    $("download").download = job.num_outputs > 1 ? `${job.id}-${index}.mp4` : `${job.id}.mp4`;
    for (const button of $("gallery").children) button.setAttribute("aria-pressed", button.dataset.index == index);
    await this.showSpritesheet(job, index);
  }

  async showGallery(job) {
    const count = job.num_outputs || 1;
    $("gallery").hidden = count < 2;
    const buttons = [];
    for (let index = 0; index < (count > 1 ? count : 0); index++) {
      const button = Object.assign(document.createElement("button"), { type: "button", className: "thumb" });
      button.dataset.index = index;
      button.setAttribute("aria-label", `Output ${index} (seed + ${index})`);
      button.append(Object.assign(document.createElement("img"), {
        src: await fileUrl(job.id, "thumbnail", index), alt: "",
      }), Object.assign(document.createElement("span"), { textContent: `#${index}` }));
      button.addEventListener("click", () => this.showOutput(job, index));
      buttons.push(button);
    }
    $("gallery").replaceChildren(...buttons);
  }

  async showSpritesheet(job, index = 0) {
    const { columns, rows } = this.config.spritesheet;
    const [width, height] = job.size.split("x").map(Number);
    const view = $("scrub-view");
    this.tiles = columns * rows;
    view.style.aspectRatio = `${width} / ${height}`;
    view.style.backgroundImage = `url("${await fileUrl(job.id, "spritesheet", index)}")`;
    view.style.backgroundSize = `${columns * 100}% ${rows * 100}%`;
    view.tabIndex = 0;
    $("scrub").hidden = false;
    this.showTile(0);
  }

  showTile(index) {
    const { columns, rows } = this.config.spritesheet;
    this.tile = Math.max(0, Math.min(this.tiles - 1, index));
    const [x, y] = [this.tile % columns, Math.floor(this.tile / columns)];
    $("scrub-view").style.backgroundPosition = `${(x * 100) / (columns - 1)}% ${(y * 100) / (rows - 1)}%`;
    const label = `Spritesheet frame ${this.tile + 1} of ${this.tiles}; arrow keys or pointer to scrub`;
    $("scrub-view").setAttribute("aria-label", label);
  }

  // The player's current frame as a PNG, scaled up if needed so both edges meet the keyframe minimum.
  async useFrame() {
    const player = $("player");
    if (player.readyState < 2) return;  // no frame decoded yet
    const scale = Math.max(1, this.config.media.image_min_edge / Math.min(player.videoWidth, player.videoHeight));
    const canvas = document.createElement("canvas");
    canvas.width = Math.round(player.videoWidth * scale);
    canvas.height = Math.round(player.videoHeight * scale);
    canvas.getContext("2d").drawImage(player, 0, 0, canvas.width, canvas.height);
    const blob = await new Promise(resolve => canvas.toBlob(resolve, "image/png"));
    const time = player.currentTime.toFixed(2);
    this.onUseFrame(new File([blob], `frame-${this.current.id.slice(6, 14)}-${time}s.png`, { type: "image/png" }));
  }
}
