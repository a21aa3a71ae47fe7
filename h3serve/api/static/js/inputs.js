// Media inputs: the two keyframe slots (FL2VA) and the ordered reference list (Ref2VA), by drag and drop or
// by file picker, each file probed and checked against the server's limits before anything is uploaded.
import { describe, probeFile } from "./media.js";
import { mediaProblems, referenceSetProblems } from "./rules.js";

const $ = id => document.getElementById(id);
const REORDER_TYPE = "application/x-h3serve-reference";

function acceptDrops(zone, onFiles) {
  zone.addEventListener("dragover", event => { event.preventDefault(); zone.classList.add("over"); });
  zone.addEventListener("dragleave", () => zone.classList.remove("over"));
  zone.addEventListener("drop", event => {
    event.preventDefault();
    zone.classList.remove("over");
    onFiles([...event.dataTransfer.files]);
  });
}

export class Inputs {
  constructor(config, onChange) {
    this.media = config.media;
    this.onChange = onChange;
    this.keyframes = { first: null, last: null };
    this.references = [];
    for (const slot of document.querySelectorAll("#keyframes .slot")) this.wireSlot(slot);
    acceptDrops($("ref-drop"), files => this.addReferences(files));
    $("ref-input").addEventListener("change", event => {
      this.addReferences([...event.target.files]);
      event.target.value = "";
    });
    const m = this.media;
    $("ref-rules").textContent = `Up to ${m.max_images} images, ${m.max_videos} videos and ${m.max_audios} audio ` +
      `clips (${m.clip_min_s}–${m.clip_max_s} s each, ${m.total_max_s} s together per kind); the order matters.`;
    this.renderReferences();
  }

  wireSlot(slot) {
    const name = slot.dataset.slot;
    const take = async files => { if (files.length) await this.setKeyframe(name, files[0]); };
    acceptDrops(slot.querySelector(".drop"), take);
    slot.querySelector("input[type=file]").addEventListener("change", event => {
      take([...event.target.files]);
      event.target.value = "";
    });
    slot.querySelector(".clear").addEventListener("click", () => this.setKeyframe(name, null));
  }

  async setKeyframe(name, file) {
    const info = file ? await probeFile(file) : null;
    if (this.keyframes[name]) URL.revokeObjectURL(this.keyframes[name].url);
    if (info && info.kind !== "image") info.problems = ["keyframes must be images"];
    else if (info) info.problems = mediaProblems(info, this.media);
    this.keyframes[name] = info;
    const slot = document.querySelector(`#keyframes .slot[data-slot=${name}]`);
    const drop = slot.querySelector(".drop");
    drop.replaceChildren();
    if (info?.preview) {
      const img = document.createElement("img");
      img.src = info.preview;
      img.alt = `${name} frame: ${file.name}`;
      drop.append(img);
    }
    if (info) drop.append(Object.assign(document.createElement("span"), { textContent: describe(info) }));
    slot.querySelector(".clear").hidden = !info;
    slot.querySelector(".field-error").textContent = info?.problems.join("; ") || "";
    this.onChange();
  }

  async addReferences(files) {
    for (const file of files) {
      const info = await probeFile(file);
      info.problems = mediaProblems(info, this.media);
      this.references.push(info);
    }
    this.renderReferences();
    this.onChange();
  }

  clearReferences() {
    for (const info of this.references) URL.revokeObjectURL(info.url);
    this.references = [];
    this.renderReferences();
    this.onChange();
  }

  move(index, delta) {
    const target = index + delta;
    if (target < 0 || target >= this.references.length) return;
    const [item] = this.references.splice(index, 1);
    this.references.splice(target, 0, item);
    this.renderReferences();
    const buttons = [...$("ref-list").children[target].querySelectorAll(delta < 0 ? ".up, .down" : ".down, .up")];
    buttons.find(b => !b.disabled)?.focus();  // keep the keyboard on the moved item
  }

  renderReferences() {
    const list = $("ref-list");
    list.replaceChildren(...this.references.map((info, i) => this.referenceItem(info, i)));
    const count = kind => this.references.filter(r => r.kind === kind).length;
    $("ref-counts").textContent = `(${count("image")}/${this.media.max_images} images, ` +
      `${count("video")}/${this.media.max_videos} videos, ${count("audio")}/${this.media.max_audios} audio)`;
    $("refs-error").textContent = referenceSetProblems(this.references, this.media).join("; ");
  }

  referenceItem(info, index) {
    const item = document.createElement("li");
    item.dataset.index = index;
    this.dragToReorder(item, index);
    if (info.preview) {
      const img = document.createElement("img");
      img.src = info.preview;
      img.alt = "";
      item.append(img);
    }
    const text = document.createElement("span");
    text.className = "ref-name";
    text.textContent = `${index + 1}. ${info.file.name} — ${describe(info)}`;
    item.append(text);
    const button = (label, cls, action, disabled) => {
      const b = Object.assign(document.createElement("button"), { type: "button", className: cls, disabled });
      b.textContent = label;
      b.setAttribute("aria-label", `${label}: ${info.file.name}`);
      b.addEventListener("click", action);
      item.append(b);
    };
    button("Up", "up", () => this.move(index, -1), index === 0);
    button("Down", "down", () => this.move(index, 1), index === this.references.length - 1);
    button("Remove", "remove", () => {
      URL.revokeObjectURL(info.url);
      this.references.splice(index, 1);
      this.renderReferences();
      this.onChange();
    }, false);
    const error = Object.assign(document.createElement("p"), { className: "field-error" });
    error.setAttribute("role", "alert");
    error.textContent = info.problems.join("; ");
    item.append(error);
    return item;
  }

  // Pointer users drag an item onto another to move it there (keyboard users have the Up / Down buttons).
  dragToReorder(item, index) {
    item.draggable = true;
    item.addEventListener("dragstart", event => event.dataTransfer.setData(REORDER_TYPE, String(index)));
    item.addEventListener("dragover", event => {
      if (event.dataTransfer.types.includes(REORDER_TYPE)) event.preventDefault();
    });
    item.addEventListener("drop", event => {
      const from = event.dataTransfer.getData(REORDER_TYPE);
      if (from === "") return;
      event.preventDefault();
      this.move(Number(from), index - Number(from));
    });
  }

  // Problems that would make the server refuse the request for `task`, checked before uploading.
  problems(task) {
    if (task === "fl2va") {
      const present = Object.values(this.keyframes).filter(Boolean);
      if (!present.length) return [["task", "first and last frame: add a first and/or a last frame image"]];
      return present.filter(k => k.problems.length).map(k => ["keyframes", k.problems.join("; ")]);
    }
    if (task === "ref2va") {
      if (!this.references.length) return [["references", "references: add at least one image, video or audio clip"]];
      const bad = this.references.filter(r => r.problems.length).map(r => ["references", r.problems.join("; ")]);
      return [...bad, ...referenceSetProblems(this.references, this.media).map(p => ["references", p])];
    }
    return [];
  }

  // The files to send for `task`, as [field, File] pairs in order, and the extra_params they need.
  files(task) {
    if (task === "fl2va") {
      const { first, last } = this.keyframes;
      if (first && !last) return { files: [["input_reference", first.file]], extra: {} };
      const present = [[first, 0], [last, -1]].filter(([k]) => k);
      return {
        files: present.map(([k]) => ["input_references", k.file]),
        extra: { task: "fl2va", frame_indices: present.map(([, index]) => index) },
      };
    }
    if (task === "ref2va") return { files: this.references.map(r => ["input_references", r.file]), extra: {} };
    return { files: [], extra: {} };
  }

  // Where the server's `param` points: "input_references[2]" -> that reference's (or keyframe's) error line.
  errorElementFor(task, param) {
    const match = /^input_references?(?:\[(\d+)\])?$/.exec(param || "");
    if (!match) return null;
    const index = Number(match[1] || 0);
    if (task === "fl2va") {
      const names = ["first", "last"].filter(n => this.keyframes[n]);
      const name = names[index] || names[0] || "first";
      return document.querySelector(`#keyframes .slot[data-slot=${name}] .field-error`);
    }
    return $("ref-list").children[index]?.querySelector(".field-error") || $("refs-error");
  }

  firstKeyframeSize() {
    const k = this.keyframes.first || this.keyframes.last;
    return k?.width ? [k.width, k.height] : null;
  }

  async useAsFirstFrame(file) {
    await this.setKeyframe("first", file);
  }
}
