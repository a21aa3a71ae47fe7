// The server's request rules, mirrored for instant feedback (h3serve/rules/geometry.py and h3serve/rules/validate/).
// The numbers come from /web/config; the server stays the authority and its own messages are shown too.

// Python's round(): halves go to the even neighbour (geometry.resolve_canvas_size relies on it).
export function roundHalfEven(x) {
  const floor = Math.floor(x);
  const diff = x - floor;
  if (Math.abs(diff - 0.5) > 1e-9) return Math.round(x);
  return floor % 2 === 0 ? floor : floor + 1;
}

export function snapFramesUp(frames, limits) {
  const { frames_per_chunk: block, frames_rest: rest } = limits;
  return block * Math.max(1, Math.ceil((frames - rest) / block)) + rest;
}

// Frames covering `seconds` at 24 fps, snapped up to 17n + 5: 4 s -> 107, 5 s -> 124, 15 s -> 362.
export function framesForDuration(seconds, limits) {
  const exact = Math.round(seconds * limits.fps * 1e6) / 1e6;
  return snapFramesUp(Math.ceil(exact), limits);
}

export function durationInfo(seconds, limits) {
  if (!Number.isFinite(seconds)) return null;
  if (seconds < limits.min_duration_s || seconds > limits.max_duration_s) return null;
  const frames = framesForDuration(seconds, limits);
  return { frames, seconds: frames / limits.fps };
}

// "16:9", "16x9" or "16/9" -> [16, 9]; null when malformed.
export function parseAspect(text) {
  const match = /^\s*([\d.]+)\s*[:x/]\s*([\d.]+)\s*$/.exec(text || "");
  if (!match) return null;
  const [w, h] = [Number(match[1]), Number(match[2])];
  return w > 0 && h > 0 ? [w, h] : null;
}

export function ratioAllowed(w, h, limits) {
  const ratio = w / h;
  return ratio >= limits.min_aspect_ratio && ratio <= limits.max_aspect_ratio;
}

// The canvas for an aspect ratio: short edge first, area capped, both edges rounded to multiples of 32.
export function canvasForAspect(aw, ah, defaults, limits) {
  const ratio = aw / ah;
  let [width, height] = ratio >= 1
    ? [defaults.canvas_short_edge * ratio, defaults.canvas_short_edge]
    : [defaults.canvas_short_edge, defaults.canvas_short_edge / ratio];
  if (width * height > defaults.canvas_max_pixels) {
    const scale = Math.sqrt(defaults.canvas_max_pixels / (width * height));
    [width, height] = [width * scale, height * scale];
  }
  const m = limits.spatial_multiple;
  return { width: Math.max(m, roundHalfEven(width / m) * m), height: Math.max(m, roundHalfEven(height / m) * m) };
}

// An explicit edge floored to the model's grid, as the server does (1280x720 -> 1280x704); below one grid step
// it is left for the range check to refuse.
export function onGrid(v, limits) {
  const m = limits.spatial_multiple;
  return v >= m ? v - (v % m) : v;
}

// A problem with an explicit (already floored) size, or null. Names the field as the server would.
export function sizeProblem(width, height, defaults, limits) {
  const m = limits.spatial_multiple;
  for (const [name, v] of [["width", width], ["height", height]]) {
    if (!Number.isInteger(v)) return `${name}: must be an integer`;
    if (v < m || v > defaults.max_edge) return `${name}: must be between ${m} and ${defaults.max_edge} pixels`;
  }
  if (!ratioAllowed(width, height, limits)) return "width: aspect ratio is outside the supported range 1:4 to 4:1";
  return null;
}

const MiB = 2 ** 20;

// Problems with one media file (its probed `info`), as the server's intake would find them.
export function mediaProblems(info, media) {
  const problems = [];
  const maxBytes = { image: media.image_bytes, video: media.video_bytes, audio: media.audio_bytes }[info.kind];
  if (!info.kind) return ["not a supported file: images JPG/PNG/WEBP/HEIC, videos MP4/MOV, audio WAV/MP3"];
  if (info.bytes > maxBytes) {
    problems.push(`${info.kind} is ${(info.bytes / MiB).toFixed(1)} MiB; the limit is ${maxBytes / MiB} MiB`);
  }
  if (info.error) problems.push(info.error);
  if (info.width && info.height) {
    const [long, short] = [Math.max(info.width, info.height), Math.min(info.width, info.height)];
    const [a, b] = media.max_aspect;
    if (long * b > short * a) problems.push(`aspect ${info.width}x${info.height} is outside 5:2 to 2:5`);
    if (info.kind === "image" && (short < media.image_min_edge || long > media.image_max_edge)) {
      const edges = `${media.image_min_edge}-${media.image_max_edge} px`;
      problems.push(`image is ${info.width}x${info.height} px; both edges must be ${edges}`);
    }
  }
  if (info.kind !== "image" && Number.isFinite(info.duration)) {
    const slack = media.duration_slack_s;
    if (info.duration < media.clip_min_s - slack || info.duration > media.clip_max_s + slack) {
      const range = `${media.clip_min_s}-${media.clip_max_s} s`;
      problems.push(`${info.kind} is ${info.duration.toFixed(2)} s long; each clip must be ${range}`);
    }
  }
  return problems;
}

// Problems with the reference set as a whole: counts per kind, total duration per kind, audio alone.
export function referenceSetProblems(infos, media) {
  const count = kind => infos.filter(i => i.kind === kind).length;
  const total = kind => infos.filter(i => i.kind === kind).reduce((s, i) => s + (i.duration || 0), 0);
  const problems = [];
  for (const [kind, max, noun] of [["image", media.max_images, "images"], ["video", media.max_videos, "videos"],
    ["audio", media.max_audios, "audio clips"]]) {
    if (count(kind) > max) problems.push(`at most ${max} ${noun}, got ${count(kind)}`);
  }
  if (infos.length > media.max_files) problems.push(`at most ${media.max_files} files, got ${infos.length}`);
  for (const kind of ["video", "audio"]) {
    if (total(kind) > media.total_max_s + media.duration_slack_s) {
      problems.push(`${kind} clips last ${total(kind).toFixed(2)} s together; the limit is ${media.total_max_s} s`);
    }
  }
  if (count("audio") && !count("image") && !count("video")) {
    problems.push("audio needs at least one image or video beside it");
  }
  return problems;
}
