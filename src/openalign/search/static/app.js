// The search page: gathers text, an optional image and +/- texts, calls POST /search, draws the grid.
"use strict";

const $ = (id) => document.getElementById(id);
const state = { image: null, imageId: null };

function addModifier(sign, value = "") {
  const row = document.createElement("div");
  row.className = `modifier ${sign}`;
  const mark = document.createElement("span");
  mark.className = "sign";
  mark.textContent = sign === "plus" ? "+" : "−";
  const input = document.createElement("input");
  input.type = "text";
  input.value = value;
  input.placeholder = sign === "plus" ? "add, e.g. blue" : "remove, e.g. stripes";
  input.dataset.sign = sign;
  const remove = document.createElement("button");
  remove.type = "button";
  remove.className = "small";
  remove.textContent = "×";
  remove.title = "remove";
  remove.addEventListener("click", () => row.remove());
  row.append(mark, input, remove);
  $("modifiers").append(row);
  input.focus();
}

function modifiers(sign) {
  return [...document.querySelectorAll(`#modifiers input[data-sign=${sign}]`)]
    .map((el) => el.value.trim())
    .filter(Boolean);
}

function setImage(dataUrl, imageId = null) {
  state.image = imageId === null ? dataUrl : null;
  state.imageId = imageId;
  const img = $("query-image");
  img.src = dataUrl;
  img.hidden = false;
  $("clear-image").hidden = false;
  $("drop-hint").hidden = true;
}

function clearImage() {
  state.image = null;
  state.imageId = null;
  $("query-image").hidden = true;
  $("query-image").removeAttribute("src");
  $("clear-image").hidden = true;
  $("drop-hint").hidden = false;
  $("file").value = "";
}

function readFile(file) {
  if (!file || !file.type.startsWith("image/")) {
    showMessage("that is not an image file", true);
    return;
  }
  const reader = new FileReader();
  reader.onload = () => setImage(reader.result);
  reader.readAsDataURL(file);
}

function showMessage(text, isError = false) {
  const el = $("message");
  el.textContent = text;
  el.classList.toggle("error", isError);
}

async function search() {
  const body = {
    text: $("query").value.trim() || null,
    plus: modifiers("plus"),
    minus: modifiers("minus"),
    k: Number($("k").value),
    modality: $("modality").value,
  };
  if (state.image) body.image = state.image;
  if (state.imageId !== null) body.image_id = state.imageId;
  if (!body.text && !body.image && body.image_id === undefined && body.plus.length === 0) {
    showMessage("type something or add an image", true);
    return;
  }
  showMessage("searching…");
  try {
    const response = await fetch("/search", {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify(body),
    });
    const data = await response.json();
    if (!response.ok) {
      const detail = typeof data.detail === "string" ? data.detail : JSON.stringify(data.detail);
      showMessage(`error ${response.status}: ${detail}`, true);
      return;
    }
    render(data);
  } catch (err) {
    showMessage(`request failed: ${err}`, true);
  }
}

function render(data) {
  const grid = $("results");
  grid.replaceChildren();
  for (const r of data.results) {
    const card = document.createElement("figure");
    card.className = "result";
    card.dataset.id = r.id;
    card.title = r.caption || r.key || "";
    const img = document.createElement("img");
    img.src = r.thumbnail;
    img.alt = r.caption || `image ${r.image_id}`;
    img.loading = "lazy";
    const meta = document.createElement("figcaption");
    meta.className = "meta";
    const score = document.createElement("div");
    score.className = "score";
    score.textContent = r.score.toFixed(3);
    const caption = document.createElement("div");
    caption.className = "caption";
    caption.textContent = r.caption || r.key || "";
    meta.append(score, caption);
    card.append(img, meta);
    // Clicking an image searches by its stored embedding; clicking a caption searches by its text.
    card.addEventListener("click", () => {
      if (data.modality === "text" && r.caption) {
        clearImage();
        $("query").value = r.caption;
        $("modality").value = "image";
      } else {
        $("query").value = "";
        setImage(r.thumbnail, r.image_id);
      }
      search();
    });
    grid.append(card);
  }
  showMessage(`${data.results.length} results in ${data.took_ms.toFixed(1)} ms`);
}

function setup() {
  $("search-form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    search();
  });
  $("add-plus").addEventListener("click", () => addModifier("plus"));
  $("add-minus").addEventListener("click", () => addModifier("minus"));
  $("clear-image").addEventListener("click", (ev) => {
    ev.stopPropagation();
    clearImage();
  });
  $("file").addEventListener("change", (ev) => readFile(ev.target.files[0]));
  const drop = $("drop");
  drop.addEventListener("dragover", (ev) => {
    ev.preventDefault();
    drop.classList.add("over");
  });
  drop.addEventListener("dragleave", () => drop.classList.remove("over"));
  drop.addEventListener("drop", (ev) => {
    ev.preventDefault();
    drop.classList.remove("over");
    readFile(ev.dataTransfer.files[0]);
  });
  $("modifiers").addEventListener("keydown", (ev) => {
    if (ev.key === "Enter") {
      ev.preventDefault();
      search();
    }
  });
  fetch("/health")
    .then((r) => r.json())
    .then((h) => {
      $("status").textContent = `${h.images} images · ${h.captions} captions · ${h.embed_dim}-d`;
      if (!h.captions) $("modality").querySelector("option[value=text]").disabled = true;
    })
    .catch(() => ($("status").textContent = "server unreachable"));
}

setup();
