// Live progress of one job: stage, denoise step, elapsed time and an estimate of the time left; cancel.
import { api, apiJson } from "./api.js";

const $ = id => document.getElementById(id);
const POLL_MS = 250;

function seconds(s) {
  return s < 60 ? `${s.toFixed(0)} s` : `${Math.floor(s / 60)} min ${(s % 60).toFixed(0)} s`;
}

// The stage a job is in, from its status and progress. Progress is done * 100 // total over the job's
// progress_steps denoiser forwards (num_inference_steps per generated window of a long video: one bar for the
// whole run), capped at 99 until the MP4 is written. `steps` (the form's count) stands in for a job whose
// record predates progress_steps.
export function stageOf(job, steps) {
  if (job.status === "queued") return { name: "Queued", step: null };
  if (job.status === "completed") return { name: "Done", step: null };
  if (job.status === "failed") return { name: "Failed", step: null };
  const forwards = job.progress_steps || steps;
  const total = forwards ? Math.max(1, forwards) : null;
  const done = total ? Math.min(total, Math.ceil((job.progress * total) / 100)) : null;
  if (job.progress === 0) return { name: "Encoding the prompt and inputs", step: null };
  if (total && done >= total && job.progress >= 99) {
    return { name: "Decoding video and audio, muxing the MP4", step: null };
  }
  if (!total) return { name: `Denoising (${job.progress}%)`, step: null };
  return { name: `Denoising: step ${done} of ${total}`, step: done };
}

export class ProgressView {
  constructor(onFinished) {
    this.onFinished = onFinished;  // (job, request) when the job completes, fails or is cancelled
    this.timer = null;
    $("cancel").addEventListener("click", () => this.cancel());
  }

  track(job, request) {
    clearTimeout(this.timer);
    this.job = job;
    this.request = request;
    this.seenAt = Date.now() / 1000;
    this.runningSince = null;
    this.firstStep = null;
    $("job").hidden = false;
    $("cancel").disabled = false;
    this.render(job);
    this.poll();
  }

  async poll() {
    const id = this.job.id;
    let job;
    try {
      job = await apiJson(`/v1/videos/${id}`);
    } catch (e) {
      if (this.job?.id !== id) return;
      if (e.status === 404) return this.finish({ ...this.job, status: "cancelled" });
      $("job-times").textContent = e.message;
      this.timer = setTimeout(() => this.poll(), POLL_MS * 4);
      return;
    }
    if (this.job?.id !== id) return;  // another job was picked meanwhile
    this.job = job;
    this.render(job);
    if (job.status === "completed" || job.status === "failed") return this.finish(job);
    this.timer = setTimeout(() => this.poll(), POLL_MS);
  }

  render(job) {
    const steps = Number(this.request?.fields.num_inference_steps) || null;
    const stage = job.status === "cancelled" ? { name: "Cancelled" } : stageOf(job, steps);
    const now = Date.now() / 1000;
    if (job.status === "in_progress" && this.runningSince === null) this.runningSince = now;
    $("job-title").textContent = `Job ${job.id.slice(0, 16)}…`;
    $("job-stage").textContent = job.status === "failed" ? `Failed: ${job.error?.message}` : stage.name;
    $("job-progress").value = job.progress;
    $("job-progress").setAttribute("aria-valuetext", `${job.progress}%`);
    const elapsed = now - Math.min(this.seenAt, job.created_at || this.seenAt);
    let times = `${job.progress}% · elapsed ${seconds(Math.max(0, elapsed))}`;
    if (job.status === "in_progress" && job.progress > 0) {
      times += ` · about ${seconds(this.secondsLeft(job.progress, now))} left`;
    }
    if (job.status === "completed") times = `${job.progress}% · finished in ${seconds(job.inference_time_s || 0)}`;
    $("job-times").textContent = times;
  }

  // From the denoise rate once two steps were seen (the encoding before the first step is not a step),
  // else from the time since the job started running.
  secondsLeft(progress, now) {
    if (!this.firstStep) this.firstStep = { progress, at: now };
    const { progress: p0, at: t0 } = this.firstStep;
    if (progress > p0) return ((100 - progress) * (now - t0)) / (progress - p0);
    return ((now - this.runningSince) * (100 - progress)) / progress;
  }

  async cancel() {
    if (!this.job) return;
    $("cancel").disabled = true;
    try {
      await api(`/v1/videos/${this.job.id}`, { method: "DELETE" });
    } catch (e) {
      if (e.status !== 404) { $("job-times").textContent = e.message; $("cancel").disabled = false; return; }
    }
    clearTimeout(this.timer);
    this.finish({ ...this.job, status: "cancelled" });
  }

  finish(job) {
    clearTimeout(this.timer);
    this.job = null;
    $("cancel").disabled = true;
    if (job.status === "cancelled") {
      $("job-stage").textContent = "Cancelled";
      $("job-times").textContent = "The job was cancelled and deleted.";
    } else {
      this.render(job);
    }
    this.onFinished(job, this.request);
  }
}
