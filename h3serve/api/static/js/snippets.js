// "Copy as curl" and "Copy as Python (openai SDK)": the same request the page sent, field for field.
// The API key is read from $H3SERVE_API_KEY rather than pasted into the text.

// Single quotes, or $'...' when the text holds line breaks (a prompt's CRLF must survive a copy and paste).
function shellQuote(text) {
  if (!/[\r\n]/.test(text)) return `'${text.replaceAll("'", `'\\''`)}'`;
  const escaped = text.replaceAll("\\", "\\\\").replaceAll("'", "\\'").replaceAll("\r", "\\r").replaceAll("\n", "\\n");
  return `$'${escaped}'`;
}

// curl reads `@file;type=...` and splits on commas: such names go in double quotes.
const curlFile = name => (/[;,"\\]/.test(name) ? `"${name.replace(/["\\]/g, c => `\\${c}`)}"` : name);
const py = value => JSON.stringify(value);  // JSON strings, numbers and lists are Python literals too
const fileName = file => file.name || "input.bin";

// A number exactly as typed (a 19-digit seed would lose digits as a JavaScript number).
class Literal {
  constructor(text) { this.text = text; }
}

function pyValue(value) {
  if (value instanceof Literal) return value.text;
  if (Array.isArray(value)) return `[${value.map(pyValue).join(", ")}]`;
  if (value && typeof value === "object" && !Array.isArray(value)) {
    return `{${Object.entries(value).map(([k, v]) => `${py(k)}: ${pyValue(v)}`).join(", ")}}`;
  }
  return py(value);
}

// Numbers stay numbers in Python (the multipart body carries text either way).
function typed(text) {
  return /^-?\d+(\.\d+)?$/.test(text) ? new Literal(text) : text;
}

// One curl command for POST /v1/videos/sync: the MP4 comes back in the body and is written to `output`.
export function curlCommand(origin, request, output = "h3serve.mp4") {
  const parts = [`curl -sS --fail-with-body ${shellQuote(`${origin}/v1/videos/sync`)}`];
  parts.push(`-H "Authorization: Bearer $H3SERVE_API_KEY"`);
  for (const [name, value] of Object.entries(request.fields)) {
    parts.push(`--form-string ${shellQuote(`${name}=${value}`)}`);
  }
  if (Object.keys(request.extra).length) {
    parts.push(`--form-string ${shellQuote(`extra_params=${JSON.stringify(request.extra)}`)}`);
  }
  for (const [field, file] of request.files) parts.push(`-F ${shellQuote(`${field}=@${curlFile(fileName(file))}`)}`);
  parts.push(`-o ${shellQuote(output)}`);
  return parts.join(" ");
}

export function pythonSnippet(origin, request, output = "h3serve.mp4") {
  const { prompt, seconds, size, ...rest } = request.fields;
  const extraBody = Object.fromEntries(Object.entries(rest).map(([k, v]) => [k, typed(v)]));
  if (Object.keys(request.extra).length) extraBody.extra_params = request.extra;
  const lines = [
    "import os",
    "",
    "from openai import OpenAI",
    "from openai.types import Video",
    "",
    `client = OpenAI(base_url=${py(`${origin}/v1`)}, api_key=os.environ.get("H3SERVE_API_KEY", "none"))`,
  ];
  const single = request.files.length === 1 && request.files[0][0] === "input_reference";
  if (request.files.length && !single) {
    // Several files in one list field: the SDK's generic multipart POST keeps their order.
    const body = { prompt, ...(seconds ? { seconds } : {}), ...(size ? { size } : {}), ...extraBody };
    const files = request.files.map(([field, file]) => `(${py(field)}, open(${py(fileName(file))}, "rb"))`);
    lines.push(
      `video = client.post("/videos", cast_to=Video, body=${pyValue(body)},`,
      `                    files=[${files.join(", ")}],`,
      `                    options={"headers": {"Content-Type": "multipart/form-data"}})`,
      "video = client.videos.poll(video.id)",
    );
  } else {
    const args = [`prompt=${py(prompt)}`];
    if (seconds) args.push(`seconds=${py(seconds)}`);
    if (size) args.push(`size=${py(size)}`);
    if (single) args.push(`input_reference=open(${py(fileName(request.files[0][1]))}, "rb")`);
    if (Object.keys(extraBody).length) args.push(`extra_body=${pyValue(extraBody)}`);
    lines.push(`video = client.videos.create_and_poll(${args.join(", ")})`);
  }
  lines.push(
    'assert video.status == "completed", video.error',
    `client.videos.download_content(video.id).write_to_file(${py(output)})`,
  );
  return lines.join("\n");
}
