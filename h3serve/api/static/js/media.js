// Probing a chosen file in the browser: its kind from the bytes (as the server sniffs it), its size,
// edges and duration, and a preview (an image thumbnail, a video's first frame, an audio clip's length).

function ascii(bytes, start, end) {
  return String.fromCharCode(...bytes.slice(start, end));
}

// "image" | "video" | "audio" | null, from the first bytes (the file name is not trusted, as on the server).
export function sniffKind(bytes) {
  if (bytes[0] === 0x89 && ascii(bytes, 1, 4) === "PNG") return "image";
  if (bytes[0] === 0xff && bytes[1] === 0xd8 && bytes[2] === 0xff) return "image";
  if (ascii(bytes, 0, 4) === "RIFF" && ascii(bytes, 8, 12) === "WEBP") return "image";
  if (ascii(bytes, 0, 4) === "RIFF" && ascii(bytes, 8, 12) === "WAVE") return "audio";
  if (ascii(bytes, 4, 8) === "ftyp") {
    const brand = ascii(bytes, 8, 12);
    return ["heic", "heix", "heim", "heis", "mif1", "msf1", "hevc", "avif"].includes(brand) ? "image" : "video";
  }
  if (ascii(bytes, 0, 3) === "ID3" || (bytes[0] === 0xff && (bytes[1] & 0xe0) === 0xe0)) return "audio";
  return null;
}

function mediaElement(tag, url) {
  return new Promise((resolve, reject) => {
    const el = document.createElement(tag);
    el.preload = "auto";
    el.muted = true;
    el.onloadeddata = () => resolve(el);
    el.onerror = () => reject(new Error("cannot be decoded here"));
    el.src = url;
  });
}

function firstFrame(video) {
  const canvas = document.createElement("canvas");
  const scale = Math.min(1, 240 / video.videoWidth);
  canvas.width = Math.round(video.videoWidth * scale);
  canvas.height = Math.round(video.videoHeight * scale);
  canvas.getContext("2d").drawImage(video, 0, 0, canvas.width, canvas.height);
  return canvas.toDataURL("image/jpeg", 0.8);
}

// { file, kind, bytes, width, height, duration, preview, error }: what the checks in rules.js read.
export async function probeFile(file) {
  const head = new Uint8Array(await file.slice(0, 16).arrayBuffer());
  const info = { file, kind: sniffKind(head), bytes: file.size, url: URL.createObjectURL(file) };
  try {
    if (info.kind === "image") {
      const bitmap = await createImageBitmap(file);
      [info.width, info.height] = [bitmap.width, bitmap.height];
      bitmap.close();
      info.preview = info.url;
    } else if (info.kind === "video") {
      const video = await mediaElement("video", info.url);
      [info.width, info.height, info.duration] = [video.videoWidth, video.videoHeight, video.duration];
      info.preview = firstFrame(video);
    } else if (info.kind === "audio") {
      info.duration = (await mediaElement("audio", info.url)).duration;
    }
  } catch {
    // The browser cannot decode it (e.g. HEIC in Chromium); the server may still: it decides.
    info.note = "no preview in this browser";
  }
  return info;
}

export function describe(info) {
  const parts = [info.kind || "unknown", `${(info.bytes / 1024).toFixed(0)} KiB`];
  if (info.width) parts.push(`${info.width}×${info.height}`);
  if (Number.isFinite(info.duration)) parts.push(`${info.duration.toFixed(2)} s`);
  if (info.note) parts.push(info.note);
  return parts.join(" · ");
}
