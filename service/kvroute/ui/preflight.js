// kvroute console, pre-flight page: paste a model's config.json and two layouts, see the verdict
// registration would give (code, field, both values), what a request moves and the plan picture.
// One POST /v1/preflight (worker scope, which the admin token also has); nothing is stored.
// Uses console.js's helpers (el, table, show, failed, done, ApiError, TOKEN_KEY).
"use strict";

async function apiPost(path, body) {
  const token = sessionStorage.getItem(TOKEN_KEY);
  const headers = { "Content-Type": "application/json" };
  if (token) headers.Authorization = `Bearer ${token}`;
  const response = await fetch(path, { method: "POST", headers, body: JSON.stringify(body), cache: "no-store" });
  let answer;
  try {
    answer = await response.json();
  } catch {
    answer = { detail: response.statusText };
  }
  if (!response.ok) throw new ApiError(response.status, answer);
  return answer;
}

function field(label, control) {
  return el("label", {}, label, control);
}

// A pasted config: an object, or null when the box is empty (optional boxes).
function pastedConfig(name, value, required) {
  if (!value.trim()) {
    if (required) throw new Error(`${name}: paste the model's config.json`);
    return null;
  }
  let parsed;
  try {
    parsed = JSON.parse(value);
  } catch (error) {
    throw new Error(`${name} is not JSON: ${error.message}`);
  }
  if (parsed === null || typeof parsed !== "object" || Array.isArray(parsed)) throw new Error(`${name} must be a JSON object`);
  return parsed;
}

function refusalNodes(refusal) {
  const verdict = el(
    "p",
    { id: "preflight-verdict", class: "error" },
    `refused: ${refusal.code} (${refusal.status}) registering ${refusal.instance} rank ${refusal.rank}`,
  );
  const columns = ["code", "status", "field", "local", "peer", "against", "detail"];
  const against = refusal.peer_instance ? `${refusal.peer_instance} rank ${refusal.peer_rank}` : "-";
  const row = { class: "incompatible", cells: [refusal.code, refusal.status, refusal.field, refusal.local, refusal.peer, against, refusal.detail] };
  return [verdict, table("preflight-refusal", columns, [row])];
}

function compatibleNodes(answer) {
  const { summary } = answer;
  const verdict = el("p", { id: "preflight-verdict" }, `compatible: context ${answer.ranks.context} ranks -> generation ${answer.ranks.generation} ranks`);
  const receivers = table(
    "preflight-receivers",
    ["generation rank", "writers", "bytes/block", "fragments/block", "NIXL descriptors/block", "state bytes/request", "state fragments", "fan-in bounce safe"],
    summary.receivers.map((r) => ({
      cells: [
        r.rank,
        r.expected_writers,
        r.bytes_per_block,
        r.fragments_per_block,
        r.nixl_descriptors_per_block,
        r.state_bytes,
        r.state_fragments,
        String(r.fanin_bounce_safe),
      ],
    })),
  );
  const senders = table(
    "preflight-senders",
    ["context rank", `bytes/request (${summary.prompt_tokens} tokens)`, "generation ranks written"],
    summary.senders.map((s) => ({ cells: [s.rank, s.bytes_per_request, s.receivers] })),
  );
  const image = el("img", { id: "preflight-picture", class: "picture", alt: `plan of generation rank ${answer.rank}` });
  image.src = URL.createObjectURL(new Blob([answer.svg], { type: "image/svg+xml" }));
  const plan = el("pre", { id: "preflight-plan" }, answer.plan_text);
  return [verdict, receivers, senders, el("h3", {}, `Plan of generation rank ${answer.rank}`), image, plan];
}

async function runPreflight(form) {
  const result = document.getElementById("preflight-result");
  result.replaceChildren();
  delete result.dataset.verdict;
  show("");
  try {
    const body = {
      model: pastedConfig("model config", form.model.value, true),
      context: form.context.value.trim(),
      generation: form.generation.value.trim(),
      rank: Number(form.rank.value || 0),
    };
    for (const [key, name] of [["generation_model", "generation model config"], ["draft", "draft config"]]) {
      const config = pastedConfig(name, form[key].value, false);
      if (config) body[key] = config;
    }
    const answer = await apiPost("/v1/preflight", body);
    result.replaceChildren(...(answer.compatible ? compatibleNodes(answer) : refusalNodes(answer.refusal)));
    result.dataset.verdict = answer.compatible ? "compatible" : "refused";
  } catch (error) {
    result.dataset.verdict = "error";
    if (error instanceof ApiError) failed(error);
    else show(error.message, true);
  }
}

function preflightPage() {
  const box = (id, name, placeholder) => el("textarea", { id, name, rows: "8", cols: "70", spellcheck: "false", placeholder });
  const line = (id, name, value) => el("input", { id, name, value, size: "28", spellcheck: "false" });
  const form = el(
    "form",
    { id: "preflight-form", class: "preflight" },
    field("model config.json", box("preflight-model", "model", '{"model_type": "llama", ...}')),
    field("generation model config.json (optional: another revision)", box("preflight-generation-model", "generation_model", "")),
    field("draft config.json (optional: an Eagle draft on both sides)", box("preflight-draft", "draft", "")),
    el(
      "div",
      { class: "plan" },
      field("context layout", line("preflight-context", "context", "tp=8,pp=2,tpb=32")),
      field("generation layout", line("preflight-generation", "generation", "tp=4,tpb=64")),
      field("plan of generation rank", el("input", { id: "preflight-rank", name: "rank", type: "number", min: "0", value: "0" })),
      el("button", { id: "preflight-check", type: "submit" }, "Check"),
    ),
  );
  form.addEventListener("submit", (event) => {
    event.preventDefault();
    runPreflight(form);
  });
  const help = el(
    "p",
    {},
    "Layouts: tp, pp, split (layers per stage, 41/39), dp (attention-DP groups), tpb (tokens per block), " +
      "dtype (auto, fp8, bfloat16...), state_dtype, mtp (MTP layers as draft layers). Nothing is registered.",
  );
  done("preflight", el("h2", {}, "Pre-flight: will this layout pair work?"), help, form, el("div", { id: "preflight-result" }));
}
