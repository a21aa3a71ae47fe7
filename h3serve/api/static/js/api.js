// HTTP calls to the server. The API key lives in sessionStorage (this tab only) and travels only in the
// Authorization header (a WebSocket's in its subprotocol header, live.js), never in a URL.
const KEY_STORAGE = "h3serve-api-key";

export class ApiError extends Error {
  constructor(status, message, param, code) {
    super(message);
    this.status = status;
    this.param = param;  // the request field the server names, e.g. "num_inference_steps"
    this.code = code;
  }
}

export function apiKey() {
  return sessionStorage.getItem(KEY_STORAGE) || "";
}

export function setApiKey(key) {
  if (key) sessionStorage.setItem(KEY_STORAGE, key);
  else sessionStorage.removeItem(KEY_STORAGE);
}

export async function api(path, options = {}) {
  const headers = { ...(options.headers || {}) };
  if (apiKey()) headers.Authorization = `Bearer ${apiKey()}`;
  const response = await fetch(path, { ...options, headers });
  if (!response.ok) {
    let error = { message: `${response.status} ${response.statusText}`, param: null, code: "http_error" };
    try { error = { ...error, ...(await response.json()).error }; } catch { /* not the JSON envelope */ }
    throw new ApiError(response.status, error.message, error.param, error.code);
  }
  return response;
}

export async function apiJson(path, options) {
  return (await api(path, options)).json();
}

// Downloaded files by "id/variant/index", as object URLs (the API key rules out plain <img src> links).
const blobUrls = new Map();

export async function fileUrl(id, variant, index = 0) {
  const key = `${id}/${variant}/${index}`;
  if (!blobUrls.has(key)) {
    const blob = await (await api(`/v1/videos/${id}/content?variant=${variant}&index=${index}`)).blob();
    blobUrls.set(key, URL.createObjectURL(blob));
  }
  return blobUrls.get(key);
}

export function forgetFiles(id) {
  for (const [key, url] of blobUrls) {
    if (key.startsWith(`${id}/`)) { URL.revokeObjectURL(url); blobUrls.delete(key); }
  }
}
