// Job history from GET /v1/videos: pages (newest first), a status filter over the page shown, open, delete.
import { api, apiJson, fileUrl, forgetFiles } from "./api.js";

const $ = id => document.getElementById(id);
const PAGE_SIZE = 10;
const REFRESH_MS = 3000;

// Make `parent`'s children exactly `nodes`, leaving in place those already there (a row keeps the keyboard
// focus across refreshes unless it changed).
function syncChildren(parent, nodes) {
  nodes.forEach((node, i) => {
    if (parent.children[i] !== node) parent.insertBefore(node, parent.children[i] || null);
  });
  while (parent.children.length > nodes.length) parent.lastElementChild.remove();
}

export class History {
  constructor({ onOpen, onError, ready }) {
    this.onOpen = onOpen;  // (job) -> show it (result or live progress)
    this.onError = onError;
    this.ready = ready;  // false while the server needs a key and none was typed
    this.cursors = [null];  // `after` of each page visited; the last one is shown
    this.rows = new Map();
    $("older").addEventListener("click", () => { this.cursors.push(this.lastId); this.refresh(); });
    $("newer").addEventListener("click", () => { this.cursors.pop(); this.refresh(); });
    $("refresh").addEventListener("click", () => this.refresh());
    $("status-filter").addEventListener("change", () => this.refresh());
    setInterval(() => { if (!document.hidden) this.refresh(); }, REFRESH_MS);
  }

  async refresh() {
    if (!this.ready()) {
      $("history-error").textContent = "Type the API key above to see the jobs.";
      return;
    }
    const after = this.cursors.at(-1);
    const query = new URLSearchParams({ limit: PAGE_SIZE, ...(after ? { after } : {}) });
    let page;
    try {
      page = await apiJson(`/v1/videos?${query}`);
    } catch (e) {
      this.onError(e);
      return;
    }
    $("history-error").textContent = "";
    this.lastId = page.last_id;
    $("older").disabled = !page.has_more;
    $("newer").disabled = this.cursors.length === 1;
    const status = $("status-filter").value;
    const jobs = page.data.filter(job => !status || job.status === status);
    const rows = jobs.map(job => this.row(job));
    for (const id of this.rows.keys()) if (!page.data.some(job => job.id === id)) this.rows.delete(id);
    if (!rows.length) rows.push(Object.assign(document.createElement("li"), { textContent: "No jobs here." }));
    syncChildren($("jobs"), rows);
  }

  row(job) {
    const key = `${job.id}:${job.status}:${job.progress}`;
    if (this.rows.has(job.id) && this.rows.get(job.id).dataset.key === key) return this.rows.get(job.id);
    const item = document.createElement("li");
    item.dataset.key = key;
    item.dataset.id = job.id;
    item.className = `job ${job.status}`;
    if (job.status === "completed") {
      const img = Object.assign(document.createElement("img"), { className: "thumb", alt: "" });
      fileUrl(job.id, "thumbnail").then(url => { img.src = url; }, () => img.remove());
      item.append(img);
    }
    const text = document.createElement("div");
    const title = Object.assign(document.createElement("span"), { className: "job-prompt", textContent: job.prompt });
    const detail = Object.assign(document.createElement("span"), {
      className: "hint",
      textContent: ` ${job.status.replace("_", " ")}${job.status === "in_progress" ? ` ${job.progress}%` : ""} · ` +
        `${job.size} · ${job.seconds} s · ${new Date(job.created_at * 1000).toLocaleTimeString()}` +
        (job.error ? ` · ${job.error.message}` : ""),
    });
    text.append(title, detail);
    item.append(text);
    const button = (label, action) => {
      const b = Object.assign(document.createElement("button"), { type: "button", textContent: label });
      b.setAttribute("aria-label", `${label} job ${job.id}`);
      b.addEventListener("click", action);
      item.append(b);
    };
    if (job.status !== "failed") button("Open", () => this.onOpen(job));
    const finished = job.status === "completed" || job.status === "failed";
    button(finished ? "Delete" : "Cancel", async () => {
      try {
        await api(`/v1/videos/${job.id}`, { method: "DELETE" });
      } catch (e) {
        this.onError(e);
      }
      forgetFiles(job.id);
      this.refresh();
    });
    this.rows.set(job.id, item);
    return item;
  }
}
