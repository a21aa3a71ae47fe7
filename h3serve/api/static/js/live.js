// Live mode: a real-time session on WS /v1/realtime/video (vLLM-Omni's protocol), played with Media Source
// Extensions as its fragmented-MP4 segments arrive. Each chunk's latency is listed; a new prompt goes out as a
// session.interaction, which the server applies at the next chunk boundary (the chunk that starts its event).
import { apiKey } from "./api.js";

const $ = id => document.getElementById(id);
const KEY_PROTOCOL = "openai-insecure-api-key.";  // a browser's WebSocket cannot send an Authorization header
const KEEP_S = 30;  // seconds of played video kept in the buffer (a ten-minute session would outgrow its quota)

// The codecs of a session's stream, from the H.264 configuration (avcC box) in its first segment's init.
export function codecsOf(segment) {
  const bytes = new Uint8Array(segment);
  const hex = b => b.toString(16).padStart(2, "0").toUpperCase();
  for (let i = 4; i + 8 < bytes.length; i++) {
    if (bytes[i] === 0x61 && bytes[i + 1] === 0x76 && bytes[i + 2] === 0x63 && bytes[i + 3] === 0x43) {  // avcC
      return `avc1.${hex(bytes[i + 5])}${hex(bytes[i + 6])}${hex(bytes[i + 7])}, mp4a.40.2`;
    }
  }
  throw new Error("the stream's first segment holds no H.264 configuration");
}

// Segments appended to one SourceBuffer in order, one append at a time; played video past KEEP_S is dropped.
class SegmentPlayer {
  constructor(video) {
    this.video = video;
    this.queue = [];
    this.buffer = null;
    this.ended = false;
    this.source = new MediaSource();
    video.src = URL.createObjectURL(this.source);
    this.source.addEventListener("sourceopen", () => this.next(), { once: true });
  }

  push(segment) {
    this.queue.push(segment);
    this.next();
  }

  end() {
    this.ended = true;
    this.next();
  }

  next() {
    if (this.source.readyState !== "open") return;
    if (!this.buffer) {
      if (!this.queue.length) return;
      this.buffer = this.source.addSourceBuffer(`video/mp4; codecs="${codecsOf(this.queue[0])}"`);
      this.buffer.addEventListener("updateend", () => { this.next(); this.play(); });
    }
    if (this.buffer.updating) return;
    const played = this.video.currentTime - KEEP_S;
    if (this.buffer.buffered.length && played > this.buffer.buffered.start(0) + 1) {
      this.buffer.remove(0, played);
    } else if (this.queue.length) {
      this.buffer.appendBuffer(this.queue.shift());
    } else if (this.ended) {
      this.source.endOfStream();
    }
  }

  play() {
    if (this.video.paused && !this.video.ended && this.video.buffered.length) this.video.play().catch(() => {});
  }
}

export class LiveView {
  constructor(config) {
    this.config = config.realtime;
    this.ws = null;
    $("live").hidden = false;
    $("live-width").value = this.config.width;
    $("live-height").value = this.config.height;
    $("live-seed").value = config.defaults.seed;
    $("live-seconds").max = this.config.max_seconds;
    $("live-size-info").textContent = `short edge ${this.config.short_edges.join(", ")}`;
    $("live-form").addEventListener("submit", event => { event.preventDefault(); this.start(); });
    $("live-stop").addEventListener("click", () => this.send({ type: "session.stop" }));
    $("live-steer").addEventListener("submit", event => { event.preventDefault(); this.steer(); });
  }

  start() {
    this.close();
    const prompt = $("live-prompt").value.trim();
    if (!prompt) {
      $("live-error").textContent = "Write a prompt first.";
      return;
    }
    const url = `${location.protocol === "https:" ? "wss" : "ws"}://${location.host}/v1/realtime/video`;
    const protocols = apiKey() ? ["realtime", KEY_PROTOCOL + apiKey()] : ["realtime"];
    this.session = {
      start: {
        type: "session.start", format: "m4s", prompt, seed: Number($("live-seed").value),
        width: Number($("live-width").value), height: Number($("live-height").value),
        num_frames: Math.round(Number($("live-seconds").value) * 24),
      },
      prompts: {}, events: 0, metadata: null, done: false, error: false,
      startedAt: performance.now(), previous: performance.now(), first: null, intervals: 0, media: 0,
    };
    this.player = new SegmentPlayer($("live-player"));
    $("live-chunks").replaceChildren();
    $("live-error").textContent = "";
    $("live-stats").textContent = "";
    this.status("Connecting…");
    this.running(true);
    const ws = this.ws = new WebSocket(url, protocols);
    ws.binaryType = "arraybuffer";
    ws.onopen = () => ws.send(JSON.stringify(this.session.start));
    ws.onmessage = event => {
      if (ws !== this.ws) return;
      if (typeof event.data === "string") this.message(JSON.parse(event.data));
      else this.segment(event.data);
    };
    ws.onclose = event => { if (ws === this.ws) this.closed(event); };
  }

  send(message) {
    if (this.ws && this.ws.readyState === WebSocket.OPEN) this.ws.send(JSON.stringify(message));
  }

  steer() {
    const prompt = $("live-next").value.trim();
    if (!prompt || !this.ws) return;
    const id = `live-${++this.session.events}`;
    this.session.prompts[id] = prompt;
    this.send({ type: "session.interaction", interaction: { event_id: id, event: { prompt } } });
    $("live-next").value = "";
    this.status(`New prompt sent: it takes effect at the next chunk boundary.`);
  }

  message(message) {
    const session = this.session;
    if (message.type === "video.start") {
      this.status(`Live: ${message.config.width}×${message.config.height}, seed ${message.config.seed}`);
    } else if (message.type === "video.chunk_metadata") {
      session.metadata = message;
    } else if (message.type === "session.interaction.queued") {
      this.status(`Prompt queued (${message.event_id}): it takes effect at the next chunk boundary.`);
    } else if (message.type === "session.done") {
      session.done = true;
      this.player.end();
      this.status(message.stopped ? `Stopped after ${message.chunks} segments.` : `Done: ${message.chunks} segments.`);
    } else if (message.type === "error") {
      session.error = true;
      $("live-error").textContent = `${message.message} (${message.code})`;
    }
  }

  segment(bytes) {
    const session = this.session;
    const meta = session.metadata;
    if (!meta) return;
    session.metadata = null;
    this.player.push(bytes);
    const now = performance.now();
    const interval = (now - session.previous) / 1000;
    session.previous = now;
    const media = meta.num_frames / 24;
    const row = document.createElement("li");
    if (meta.kind === "trailer") {
      row.textContent = `trailer: ${meta.byte_length} bytes`;
    } else {
      row.textContent = `chunk ${meta.generation_chunk_index}: ${meta.num_frames} frames (${media.toFixed(2)} s), ` +
        `after ${interval.toFixed(2)} s`;
      if (session.first === null) session.first = interval;
      else { session.intervals += interval; session.media += media; }
      for (const id of meta.started_event_ids) {
        row.classList.add("switch");
        row.append(` · “${session.prompts[id] ?? id}” from here`);
      }
    }
    $("live-chunks").append(row);
    row.scrollIntoView({ block: "nearest" });
    this.stats();
  }

  stats() {
    const s = this.session;
    if (s.first === null) return;
    const parts = [`time to first chunk ${s.first.toFixed(2)} s`];
    if (s.media > 0) parts.push(`real-time factor ${(s.intervals / s.media).toFixed(2)} (below 1 keeps ahead)`);
    $("live-stats").textContent = parts.join(" · ");
  }

  closed(event) {
    this.running(false);
    this.ws = null;
    if (!this.session.done && !this.session.error) {
      $("live-error").textContent = event.code === 1006
        ? "The server refused the session: busy with another job or session, or a wrong API key. Try again shortly."
        : `The session closed (code ${event.code}).`;
    }
    if (!this.session.done) this.player.end();
  }

  close() {
    if (this.ws) {
      const ws = this.ws;
      this.ws = null;
      ws.close();
    }
  }

  running(on) {
    $("live-start").disabled = on;
    $("live-stop").disabled = !on;
    $("live-next").disabled = !on;
    $("live-send").disabled = !on;
  }

  status(text) {
    $("live-status").textContent = text;
  }
}
