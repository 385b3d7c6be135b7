// kvroute console: read-only pages over the admin API, plain DOM, no dependencies.
//
// Every data call carries the admin token the operator typed in, kept in this tab's
// sessionStorage. Data is only ever inserted as text (textContent, attributes), never as HTML;
// pictures are the server's SVG answers shown through <img> from blob URLs.
"use strict";

const TOKEN_KEY = "kvroute.adminToken";
const enc = encodeURIComponent;

class ApiError extends Error {
  constructor(status, problem) {
    super(problem.detail || `HTTP ${status}`);
    this.status = status;
    this.problem = problem;
  }
}

async function api(path, as = "json") {
  const token = sessionStorage.getItem(TOKEN_KEY);
  const headers = token ? { Authorization: `Bearer ${token}` } : {};
  const response = await fetch(path, { headers, cache: "no-store" });
  if (!response.ok) {
    let problem;
    try {
      problem = await response.json();
    } catch {
      problem = { detail: response.statusText };
    }
    throw new ApiError(response.status, problem);
  }
  return as === "blob" ? response.blob() : response.json();
}

function el(tag, props = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(props)) {
    if (key === "class") node.className = value;
    else if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
    else node.setAttribute(key, value);
  }
  for (const child of children) node.append(child instanceof Node ? child : text(child));
  return node;
}

function text(value) {
  if (value === undefined) return "-";
  if (value === null || typeof value === "object") return JSON.stringify(value);
  return String(value);
}

// rows: [{cells: [...], class: "..."}]; numbers are right-aligned.
function table(id, columns, rows) {
  const head = el("tr", {}, ...columns.map((name) => el("th", {}, name)));
  const body = rows.map((row) =>
    el(
      "tr",
      row.class ? { class: row.class } : {},
      ...row.cells.map((cell) => el("td", typeof cell === "number" ? { class: "number" } : {}, cell)),
    ),
  );
  return el("table", { id }, el("thead", {}, head), el("tbody", {}, ...body));
}

function show(message, error = false) {
  const line = document.getElementById("message");
  line.textContent = message;
  line.className = error ? "error" : "";
}

async function picture(id, path, alt) {
  const blob = await api(path, "blob");
  const image = el("img", { id, class: "picture", alt });
  image.src = URL.createObjectURL(blob);
  return image;
}

function done(page, ...nodes) {
  const view = document.getElementById("view");
  view.replaceChildren(...nodes);
  view.dataset.page = page;
}

async function deploymentsPage() {
  const { deployments } = await api("/v1/deployments");
  const rows = deployments.map((d) => ({
    cells: [
      el("a", { id: `deployment-${d.name}`, href: `#/deployments/${enc(d.name)}` }, d.name),
      d.instances,
      d.live_ranks,
      d.expired_ranks,
      d.created_at,
    ],
  }));
  const columns = ["deployment", "instances", "live ranks", "expired ranks", "created"];
  const empty = deployments.length ? [] : [el("p", {}, "No deployment has registered a rank yet.")];
  done("deployments", el("h2", {}, "Deployments"), table("deployments", columns, rows), ...empty);
}

function instancesSection(instances) {
  const summary = table(
    "instances",
    ["instance", "role", "TP", "PP", "attention DP", "live ranks", "expired ranks"],
    instances.map((i) => ({
      cells: [i.name, i.role, i.tp_size, i.pp_size, i.attention_dp ? i.dp_size : "no", i.live_ranks, i.expired_ranks],
    })),
  );
  const ranks = instances.flatMap((i) => [
    el("h3", {}, `${i.name} (${i.role}) ranks`),
    table(
      `ranks-${i.name}`,
      ["rank", "lease", "generation", "lease expires", "registered"],
      i.ranks.map((r) => ({
        class: r.state,
        cells: [r.rank, r.state, r.generation, r.lease_expires_at, r.registered_at],
      })),
    ),
  ]);
  return [el("h2", {}, "Instances, ranks and leases"), summary, ...ranks];
}

function compatibilityRow(pair) {
  const refusal = pair.refusal || {};
  const missing = Object.entries(pair.missing_ranks || {}).map(([name, ranks]) => `${name} misses ranks ${ranks.join(",")}`);
  const ranks = pair.refusal ? `gen rank ${refusal.generation_rank} / ctx rank ${refusal.context_rank}` : "-";
  return {
    class: pair.status,
    cells: [
      pair.generation,
      pair.context,
      el("span", { class: "status" }, pair.status),
      refusal.code,
      refusal.field,
      pair.refusal ? refusal.local : undefined,
      pair.refusal ? refusal.peer : undefined,
      ranks,
      pair.refusal ? refusal.detail : missing.join("; ") || "-",
    ],
  };
}

async function compatibilitySection(name, matrix) {
  const columns = ["generation", "context", "status", "code", "field", "generation value", "context value", "ranks", "detail"];
  const nodes = [el("h2", {}, "Compatibility"), table("compatibility", columns, matrix.pairs.map(compatibilityRow))];
  if (matrix.pairs.length) {
    nodes.push(await picture("compatibility-picture", `/v1/deployments/${enc(name)}/compatibility?format=svg`, "compatibility matrix"));
  } else {
    nodes.push(el("p", {}, "No pair yet: the deployment needs a context and a generation instance."));
  }
  return nodes;
}

// KV integrity per path (producer instance -> consumer rank): the latest canary or sampled digest.
function integritySection(paths) {
  const columns = ["producer", "consumer rank", "state", "source", "first wrong element", "cost ms", "reported"];
  const rows = paths.map((p) => ({
    class: p.state,
    cells: [
      p.producer,
      `${p.consumer} rank ${p.consumer_rank}`,
      el("span", { class: "status" }, p.state === "stale" ? `stale (was ${p.reported})` : p.state),
      p.source,
      p.element ? p.element.detail : "-",
      p.cost_ms === undefined ? "-" : p.cost_ms.toFixed(1),
      p.reported_at,
    ],
  }));
  const empty = paths.length ? [] : [el("p", {}, "No path attested yet: workers report a canary when they first pair.")];
  return [el("h2", {}, "KV integrity"), table("kv-paths", columns, rows), ...empty];
}

function transfersSection(jobs) {
  const columns = ["job", "sender -> receiver", "receiver ranks", "blocks", "moves", "state", "bytes", "seconds", "created", "error"];
  const rows = jobs.map((job) => ({
    class: job.state,
    cells: [
      el("span", { class: "mono", title: job.id }, job.id.slice(0, 8)),
      `${job.sender} -> ${job.receiver}`,
      job.receiver_ranks.join(","),
      job.blocks,
      moves(job),
      job.state,
      job.bytes,
      job.duration_seconds === null ? "-" : job.duration_seconds.toFixed(4),
      job.created_at,
      job.error === null ? "" : job.error,
    ],
  }));
  const empty = jobs.length ? [] : [el("p", {}, "No transfer job yet.")];
  return [el("h2", {}, "Transfer jobs"), table("transfers", columns, rows), ...empty];
}

// What a job moves: its token range (else its blocks as pairs), and the request's state slots.
function moves(job) {
  const tokens = job.tokens ? `tokens [${job.tokens.start}, ${job.tokens.end})` : "block pairs";
  const state = job.src_state_slot === undefined ? "" : `, state slot ${job.src_state_slot} -> ${job.dst_state_slot}`;
  return tokens + state;
}

// "0-3" for a contiguous run, "0,2,5" otherwise (as in the text table and the pictures).
function span(values) {
  const ordered = [...new Set(values)].sort((a, b) => a - b);
  if (!ordered.length) return "-";
  const contiguous = ordered[ordered.length - 1] - ordered[0] === ordered.length - 1;
  if (!contiguous) return ordered.join(",");
  return ordered.length === 1 ? `${ordered[0]}` : `${ordered[0]}-${ordered[ordered.length - 1]}`;
}

function heads(view) {
  if (view.mapper === "replicated") return "all";
  const [low, high] = view.heads.dst;
  return high - low === 1 ? `${low}` : `${low}-${high - 1}`;
}

function planTable(plan) {
  const rows = plan.peers.flatMap((peer) => {
    if (!peer.views.length) return [{ cells: [peer.rank, "no", "-", "-", "-", "-", "-", "-", 0, 0] }];
    return peer.views.map((view) => ({
      cells: [
        peer.rank,
        peer.sends ? "yes" : "no",
        `${view.src_view}->${view.dst_view}`,
        view.owner,
        view.roles.join("+"),
        view.mapper,
        heads(view),
        span(view.layers),
        view.bytes_per_block,
        view.descriptors_per_block,
      ],
    }));
  });
  const columns = ["sender rank", "sends", "view", "owner", "roles", "mapper", "heads", "layers", "bytes/block", "fragments"];
  return table("plan-table", columns, rows);
}

async function showPlan(name, form) {
  const query = new URLSearchParams({
    sender: form.sender.value,
    receiver: form.receiver.value,
    receiver_rank: form.rank.value,
  });
  const path = `/v1/deployments/${enc(name)}/plans?${query}`;
  const target = document.getElementById("plan");
  target.replaceChildren();
  delete target.dataset.plan;
  try {
    const plan = await api(path);
    const summary = el(
      "p",
      { id: "plan-summary" },
      `${plan.sender.instance} -> ${plan.receiver.instance} rank ${plan.receiver.rank}: ` +
        `${plan.expected_writers} writers, ${plan.bytes_per_block} bytes and ${plan.fragments_per_block} ` +
        `fragments per block, fan-in bounce safe ${plan.fanin_bounce_safe}; ${plan.fingerprint}`,
    );
    const image = await picture("plan-picture", `${path}&format=svg`, "plan picture");
    target.replaceChildren(summary, image, planTable(plan));
    target.dataset.plan = query.toString();
  } catch (error) {
    failed(error);
  }
}

function planSection(name, instances) {
  const options = (role) => instances.filter((i) => i.role === role).map((i) => el("option", { value: i.name }, i.name));
  const senders = options("context");
  const receivers = options("generation");
  if (!senders.length || !receivers.length) {
    return [el("h2", {}, "Plans"), el("p", {}, "A plan needs a context and a generation instance.")];
  }
  const form = el(
    "form",
    { id: "plan-form", class: "plan" },
    el("label", {}, "sender (context)", el("select", { id: "plan-sender", name: "sender" }, ...senders)),
    el("label", {}, "receiver (generation)", el("select", { id: "plan-receiver", name: "receiver" }, ...receivers)),
    el("label", {}, "receiver rank", el("input", { id: "plan-rank", name: "rank", type: "number", min: "0", value: "0" })),
    el("button", { id: "plan-show", type: "submit" }, "Show plan"),
  );
  form.addEventListener("submit", (event) => {
    event.preventDefault();
    showPlan(name, form);
  });
  return [el("h2", {}, "Plans"), form, el("div", { id: "plan" })];
}

async function deploymentPage(name) {
  const base = `/v1/deployments/${enc(name)}`;
  const deployment = await api(base);
  const [instances, matrix, jobs, kvPaths] = await Promise.all([
    Promise.all(deployment.instances.map((i) => api(`${base}/instances/${enc(i.name)}`))),
    api(`${base}/compatibility`),
    api(`${base}/transfers?limit=50`),
    api(`${base}/kv-paths`),
  ]);
  done(
    `deployment:${name}`,
    el("h2", { id: "deployment-name" }, `Deployment ${name}`),
    el("p", { id: "live", role: "status" }, liveText()),
    el("p", {}, `${deployment.live_ranks} live ranks, ${deployment.expired_ranks} expired, since ${deployment.created_at}`),
    ...instancesSection(instances),
    ...(await compatibilitySection(name, matrix)),
    ...integritySection(kvPaths.paths),
    ...transfersSection(jobs.transfers),
    ...planSection(name, instances),
  );
}

async function refusalsPage() {
  const { rejections } = await api("/v1/rejections?limit=200");
  const columns = ["when", "deployment", "instance", "rank", "stage", "code", "field", "local", "peer", "detail"];
  const rows = rejections.map((r) => ({
    cells: [r.at, r.deployment, r.instance, r.rank, r.stage, r.code, r.field, r.problem.local, r.problem.peer, r.detail],
  }));
  const empty = rejections.length ? [] : [el("p", {}, "No refusal recorded.")];
  done("refusals", el("h2", {}, "Recent refusals"), table("refusals", columns, rows), ...empty);
}

function failed(error) {
  if (!(error instanceof ApiError)) {
    show(`cannot reach kvroute: ${error.message}`, true);
    return;
  }
  const { status, problem } = error;
  if (status === 401) show("kvroute answered 401: type the admin token above (KVROUTE_ADMIN_TOKEN).", true);
  else if (status === 403) show("kvroute answered 403: this token is not the admin token.", true);
  else show(`kvroute answered ${status} ${problem.code || ""}: ${problem.detail}`, true);
}

async function route() {
  const hash = location.hash || "#/";
  show("");
  try {
    const deployment = hash.startsWith("#/deployments/") ? decodeURIComponent(hash.slice("#/deployments/".length)) : null;
    // The deployment page redraws on each change of the deployment (watch.js), not on a timer.
    followDeployment(deployment, () => deploymentPage(deployment).catch(failed));
    if (hash === "#/refusals") await refusalsPage();
    else if (hash === "#/preflight") preflightPage();
    else if (deployment !== null) await deploymentPage(deployment);
    else await deploymentsPage();
  } catch (error) {
    done("error");
    failed(error);
  }
}

function tokenState() {
  document.getElementById("token-state").textContent = sessionStorage.getItem(TOKEN_KEY) ? "token set" : "no token";
}

document.addEventListener("DOMContentLoaded", () => {
  document.getElementById("token-form").addEventListener("submit", (event) => {
    event.preventDefault();
    const input = document.getElementById("token");
    if (input.value.trim()) sessionStorage.setItem(TOKEN_KEY, input.value.trim());
    input.value = "";
    tokenState();
    route();
  });
  document.getElementById("token-forget").addEventListener("click", () => {
    sessionStorage.removeItem(TOKEN_KEY);
    tokenState();
    route();
  });
  window.addEventListener("hashchange", route);
  tokenState();
  route();
});
