// kvroute console: the deployment page follows GET /v1/deployments/{d}/events instead of polling.
//
// EventSource cannot send the admin token, so the stream is read with fetch() and parsed here
// (server-sent events: "id:", "event:", "data:" lines, a blank line ends an event). Each event
// redraws the page (at most every 500 ms); a dropped stream resumes after the last revision seen.
"use strict";

const follow = { name: null, controller: null, revision: null, timer: null, message: "" };

function followDeployment(name, redraw) {
  if (follow.name === name && follow.controller) return;
  if (follow.controller) follow.controller.abort();
  Object.assign(follow, { name, controller: null, revision: null, message: "live: connecting to the event stream" });
  if (name !== null) readEvents(name, redraw, new AbortController());
}

// The page is drawn after the stream opened as often as before: it shows the latest line.
function liveText() {
  return follow.message;
}

function liveLine(message) {
  follow.message = message;
  const line = document.getElementById("live");
  if (line) line.textContent = message;
}

async function readEvents(name, redraw, controller) {
  follow.controller = controller;
  while (!controller.signal.aborted) {
    try {
      await streamOnce(name, redraw, controller.signal);
    } catch (error) {
      if (controller.signal.aborted) return;
      liveLine(`event stream lost (${error.message}); reconnecting`);
    }
    await new Promise((resolve) => setTimeout(resolve, 1000));
  }
}

async function streamOnce(name, redraw, signal) {
  const token = sessionStorage.getItem(TOKEN_KEY);
  const headers = token ? { Authorization: `Bearer ${token}` } : {};
  if (follow.revision !== null) headers["Last-Event-ID"] = String(follow.revision);
  const response = await fetch(`/v1/deployments/${enc(name)}/events`, { headers, signal, cache: "no-store" });
  if (!response.ok) throw new Error(`HTTP ${response.status}`);
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) throw new Error("the stream ended");
    buffer += value;
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      handleBlock(buffer.slice(0, end), redraw);
      buffer = buffer.slice(end + 2);
    }
  }
}

function handleBlock(block, redraw) {
  let id = null;
  let kind = null;
  let data = null;
  for (const line of block.split("\n")) {
    if (line.startsWith(": revision ") && follow.revision === null) follow.revision = Number(line.slice(11));
    else if (line.startsWith("id: ")) id = Number(line.slice(4));
    else if (line.startsWith("event: ")) kind = line.slice(7);
    else if (line.startsWith("data: ")) data = JSON.parse(line.slice(6));
  }
  if (id === null || kind === null) {
    if (follow.revision !== null) liveLine(`live: watching from revision ${follow.revision}`);
    return;
  }
  follow.revision = id;
  const where = data && data.instance ? ` ${data.instance}${data.rank !== undefined ? ` rank ${data.rank}` : ""}` : "";
  const message = `live: revision ${id}, ${kind}${where}`;
  liveLine(message);
  clearTimeout(follow.timer);
  follow.timer = setTimeout(redraw, 500);
}
