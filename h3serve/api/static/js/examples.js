// Ready examples (static/examples/examples.json, made from the demo world by h3serve.demo.web_examples): one
// click sets the task, the prompt, the duration, steps and seed of the eval-demo case it is, and puts its keyframes
// or references in their slots as if the files had been chosen, so FL2VA and Ref2VA can be tried without making any.
const $ = id => document.getElementById(id);
const FOLDER = "/web/static/examples/";

async function exampleFile(name) {
  const response = await fetch(FOLDER + encodeURIComponent(name));
  if (!response.ok) throw new Error(`${name}: ${response.status}`);
  const blob = await response.blob();
  return new File([blob], name, { type: blob.type });
}

export class Examples {
  constructor(config, form) {
    this.form = form;
    this.tasks = config.tasks;
  }

  async load() {
    let manifest;
    try {
      const response = await fetch(FOLDER + "examples.json");
      if (!response.ok) return;  // a trimmed install: no examples, no section
      manifest = await response.json();
    } catch { return; }
    const list = $("example-list");
    for (const example of manifest.examples.filter(e => this.tasks.includes(e.task))) {
      const button = Object.assign(document.createElement("button"), { type: "button", textContent: example.title });
      button.title = `${example.prompt} (${example.case})`;
      button.setAttribute("aria-pressed", "false");
      button.addEventListener("click", () => this.use(example, button));
      list.append(button);
    }
    $("examples").hidden = !list.children.length;
  }

  async use(example, button) {
    $("examples-error").textContent = "";
    for (const other of $("example-list").children) other.setAttribute("aria-pressed", String(other === button));
    try {
      const inputs = this.form.inputs;
      this.form.setTask(example.task);
      for (const slot of ["first", "last"]) {
        const name = example.keyframes[slot];
        await inputs.setKeyframe(slot, name ? await exampleFile(name) : null);
      }
      inputs.clearReferences();
      await inputs.addReferences(await Promise.all(example.references.map(exampleFile)));
      $("prompt").value = example.prompt;
      $("seconds").value = example.seconds;
      $("steps").value = example.steps;
      $("seed").value = example.seed;
      this.form.update();
    } catch (e) {
      $("examples-error").textContent = `could not load the example: ${e.message}`;
    }
  }
}
