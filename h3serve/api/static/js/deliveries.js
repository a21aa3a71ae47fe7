// A job's webhook deliveries (GET /v1/videos/{id}/webhook_deliveries, docs/webhooks.md): per endpoint, the event,
// its state, the attempts made and the receiver's last answer. Refreshed while one is pending.
import { apiJson } from "./api.js";

const $ = id => document.getElementById(id);
const REFRESH_MS = 2000;
const MAX_REFRESHES = 150;  // five minutes of a pending delivery; the Refresh button goes on from there

function when(seconds) {
  return seconds ? new Date(seconds * 1000).toLocaleTimeString() : "";
}

function describe(delivery) {
  if (delivery.state === "delivered") return `HTTP ${delivery.last_status_code} at ${when(delivery.delivered_at)}`;
  const last = delivery.last_error || (delivery.attempts ? "" : "not tried yet");
  if (delivery.state === "failed") return `given up: ${last}`;
  return [last, delivery.next_attempt_at ? `next try at ${when(delivery.next_attempt_at)}` : ""]
    .filter(Boolean).join("; ");
}

export class DeliveriesView {
  constructor() {
    this.jobId = null;
    this.timer = null;
    $("deliveries-refresh").addEventListener("click", () => this.load(this.jobId, 0));
  }

  // Show `jobId`'s deliveries (a finished job: its event is in the outbox).
  show(jobId) {
    clearTimeout(this.timer);
    this.jobId = jobId;
    $("deliveries").hidden = false;
    this.load(jobId, 0);
  }

  hide() {
    clearTimeout(this.timer);
    this.jobId = null;
    $("deliveries").hidden = true;
  }

  async load(jobId, refreshes) {
    clearTimeout(this.timer);
    if (!jobId || jobId !== this.jobId) return;
    let deliveries;
    try {
      deliveries = (await apiJson(`/v1/videos/${jobId}/webhook_deliveries`)).data;
    } catch (e) {
      $("deliveries-status").textContent = e.message;
      return;
    }
    if (jobId !== this.jobId) return;
    const rows = deliveries.map(d => {
      const row = document.createElement("tr");
      for (const text of [d.webhook_endpoint_id, d.event_type, d.state, String(d.attempts), describe(d)]) {
        row.append(Object.assign(document.createElement("td"), { textContent: text }));
      }
      row.dataset.state = d.state;
      return row;
    });
    $("deliveries-rows").replaceChildren(...rows);
    $("deliveries-table").hidden = !rows.length;
    $("deliveries-status").textContent = rows.length ? ""
      : "No webhook endpoint of this API key takes this job's event (client.webhooks.create).";
    if (deliveries.some(d => d.state === "pending") && refreshes < MAX_REFRESHES) {
      this.timer = setTimeout(() => this.load(jobId, refreshes + 1), REFRESH_MS);
    }
  }
}
