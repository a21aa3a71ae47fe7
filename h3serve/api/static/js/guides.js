// Timeline guides: images, clips and sounds placed on the output's frames (docs/guides.md). A track spans the
// output's frames with a marker per guide; a click on it (or the frame field) picks the next guide's frame, and
// each guide's frame stays editable in its list row. Sent as vLLM-Omni does: the `timeline_guides` manifest (JSON
// text) and one `guide_files` upload per guide, in list order.
import { describe, probeFile } from "./media.js";

const $ = id => document.getElementById(id);

// The frames a guide covers (the server's rule, h3serve/rules/guides.py): an image or a sound 1, a clip of M
// frames at 24 fps 1 for M < 5, else 5 + 17·floor((M - 5) / 17).
export function guideFrames(info, limits) {
  if (info.kind !== "video") return 1;
  const frames = Math.round((info.duration || 0) * limits.fps);
  const [block, rest] = [limits.frames_per_chunk, limits.frames_rest];
  return frames < rest ? 1 : rest + block * Math.floor((frames - rest) / block);
}

export const guideStart = (index, frames) => (index >= 0 ? index : frames + index);

export class GuideTimeline {
  constructor(config, onChange) {
    this.limits = config.limits;
    this.guideLimits = config.guides;
    this.onChange = onChange;
    this.guides = [];  // { info, frameIndex }
    this.frames = 0;  // the output's frame count, from the duration
    $("guide-input").addEventListener("change", async event => {
      const file = event.target.files[0];
      event.target.value = "";
      if (file) await this.add(file, Number($("guide-frame").value) || 0);
    });
    $("guide-track").addEventListener("click", event => {
      if (event.target !== $("guide-track") || !this.frames) return;
      const box = $("guide-track").getBoundingClientRect();
      const frame = Math.round(((event.clientX - box.left) / box.width) * (this.frames - 1));
      $("guide-frame").value = Math.max(0, Math.min(this.frames - 1, frame));
    });
    this.render();
  }

  async add(file, frameIndex) {
    const info = await probeFile(file);
    this.guides.push({ info, frameIndex });
    this.render();
    this.onChange();
  }

  setFrames(frames) {
    if (frames === this.frames) return;
    this.frames = frames;
    this.render();
  }

  // Problems with guide `i` the server would refuse, or [].
  problemsOf(i) {
    const { info, frameIndex } = this.guides[i];
    if (!info.kind) return ["not a recognised image, video or audio file"];
    const problems = [];
    if (!Number.isInteger(frameIndex)) problems.push("the frame must be a whole number");
    else if (this.frames) {
      const start = guideStart(frameIndex, this.frames);
      const span = guideFrames(info, this.limits);
      if (start < 0 || start + span > this.frames) {
        problems.push(`frame ${frameIndex} places ${span} frame${span > 1 ? "s" : ""} at ${start}..${start + span - 1}, ` +
          `outside the output's frames 0..${this.frames - 1}`);
      }
    }
    return problems;
  }

  render() {
    const n = this.guides.length;
    $("guide-count").textContent = n ? `(${n} of at most ${this.guideLimits.max_entries})` : "";
    $("guide-frame").min = this.frames ? -this.frames : "";
    $("guide-frame").max = this.frames ? this.frames - 1 : "";
    const track = $("guide-track");
    track.replaceChildren(...this.guides.map((guide, i) => this.marker(guide, i)));
    $("guide-list").replaceChildren(...this.guides.map((guide, i) => this.item(guide, i)));
    $("guides-error").textContent = n > this.guideLimits.max_entries
      ? `at most ${this.guideLimits.max_entries} guides per request` : "";
  }

  marker({ info, frameIndex }, i) {
    const start = this.frames ? guideStart(frameIndex, this.frames) : 0;
    const span = guideFrames(info, this.limits);
    const marker = Object.assign(document.createElement("button"), { type: "button", className: "guide-marker" });
    marker.dataset.kind = info.kind || "unknown";
    marker.textContent = String(i + 1);
    marker.setAttribute("aria-label", `Guide ${i + 1}: ${info.kind || "file"} at frame ${start}`);
    const frames = Math.max(1, this.frames);
    const left = (100 * Math.max(0, Math.min(start, frames - 1))) / frames;
    const width = (100 * (info.kind === "audio" ? Math.max(1, frames - start) : span)) / frames;
    marker.style.left = `min(${left}%, calc(100% - 1.2rem))`;  // a marker at the last frame stays on the track
    marker.style.width = `max(1.2rem, ${width}%)`;
    marker.addEventListener("click", () => $("guide-list").children[i]?.querySelector("input")?.focus());
    return marker;
  }

  item({ info }, i) {
    const item = document.createElement("li");
    const text = Object.assign(document.createElement("span"), { className: "ref-name" });
    text.textContent = `${i + 1}. ${info.file.name} — ${describe(info)}`;
    const label = Object.assign(document.createElement("label"), { textContent: "frame" });
    const frame = Object.assign(document.createElement("input"), { type: "number", step: "1" });
    frame.value = this.guides[i].frameIndex;
    frame.setAttribute("aria-label", `Guide ${i + 1} frame (negative: from the end)`);
    frame.addEventListener("change", () => {
      this.guides[i].frameIndex = frame.value.trim() === "" ? NaN : Number(frame.value);
      this.render();
      this.onChange();
    });
    label.append(frame);
    const remove = Object.assign(document.createElement("button"), { type: "button", className: "remove" });
    remove.textContent = "Remove";
    remove.setAttribute("aria-label", `Remove guide ${i + 1}: ${info.file.name}`);
    remove.addEventListener("click", () => {
      URL.revokeObjectURL(info.url);
      this.guides.splice(i, 1);
      this.render();
      this.onChange();
    });
    const error = Object.assign(document.createElement("p"), { className: "field-error" });
    error.setAttribute("role", "alert");
    error.textContent = this.problemsOf(i).join("; ");
    item.append(text, label, remove, error);
    return item;
  }

  problems() {
    const found = this.guides.flatMap((_, i) => this.problemsOf(i).map(p => [`timeline_guides[${i}]`,
      `guide ${i + 1}: ${p}`]));
    if (this.guides.length > this.guideLimits.max_entries) {
      found.push(["timeline_guides", `at most ${this.guideLimits.max_entries} guides per request`]);
    }
    return found;
  }

  // { manifest (JSON text, or null without guides), files: [["guide_files", File]] }
  request() {
    if (!this.guides.length) return { manifest: null, files: [] };
    const manifest = this.guides.map(({ info, frameIndex }, i) => ({
      frame_index: frameIndex, [info.kind || "image"]: { upload_index: i },
    }));
    return { manifest: JSON.stringify(manifest), files: this.guides.map(({ info }) => ["guide_files", info.file]) };
  }

  // Where the server's `param` points: timeline_guides[i](.…) or guide_files[i] -> that guide's error line.
  errorElementFor(param) {
    const match = /^(?:timeline_guides|guide_files)(?:\[(\d+)\])?/.exec(param || "");
    if (!match) return null;
    $("guide-box").open = true;
    if (match[1] === undefined) return $("guides-error");
    return $("guide-list").children[Number(match[1])]?.querySelector(".field-error") || $("guides-error");
  }
}
