"""The launcher's status page: one self-contained HTML file (no external resources) that
reads `status.json` every two seconds and draws the tasks, the recent events and the
training curve."""

HTML = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>kfit_ps job</title>
<style>
body{font:14px system-ui,sans-serif;margin:1.5em;color:#222}
h1{font-size:1.3em;margin:0 0 .3em} h2{font-size:1.05em;margin:1.2em 0 .4em}
table{border-collapse:collapse} td,th{padding:.25em .7em;border-bottom:1px solid #ddd;
text-align:right} td:first-child,th:first-child,td.state{text-align:left}
tr.running td.state{color:#17702a} tr.down td.state,tr.restarting td.state{color:#b3261e}
.flag{color:#b3261e;font-weight:600} #events td{text-align:left} .muted{color:#777}
</style></head><body>
<h1>kfit_ps job <span id="job"></span></h1>
<div id="summary" class="muted">loading status.json ...</div>
<h2>Tasks</h2>
<table id="tasks"><thead><tr><th>task</th><th>state</th><th>pid</th><th>restarts</th>
<th>steps/s</th><th>CPU cores</th><th>memory (MiB)</th><th>diagnosis</th></tr></thead>
<tbody></tbody></table>
<h2>Training curve</h2>
<svg id="curve" width="640" height="200" role="img" aria-label="training curve"></svg>
<div id="curve-caption" class="muted"></div>
<h2>Recent events</h2>
<table id="events"><thead><tr><th>time</th><th>event</th><th>task</th><th>reason</th></tr>
</thead><tbody></tbody></table>
<script>
function fmt(x, digits) { return x === null || x === undefined ? "" : x.toFixed(digits); }
function cell(row, text, cls) {
  const td = document.createElement("td"); td.textContent = text;
  if (cls) td.className = cls; row.appendChild(td); return td;
}
function drawCurve(points, key) {
  const svg = document.getElementById("curve"); svg.innerHTML = "";
  const caption = document.getElementById("curve-caption");
  if (!points.length) { caption.textContent = "no epoch finished yet"; return; }
  const xs = points.map(p => p.x), ys = points.map(p => p.y);
  const x0 = Math.min(...xs), x1 = Math.max(...xs) || 1, y0 = Math.min(...ys),
        y1 = Math.max(...ys);
  const sx = x => 40 + 580 * (x1 > x0 ? (x - x0) / (x1 - x0) : 0.5);
  const sy = y => 180 - 160 * (y1 > y0 ? (y - y0) / (y1 - y0) : 0.5);
  const line = document.createElementNS("http://www.w3.org/2000/svg", "polyline");
  line.setAttribute("points", points.map(p => sx(p.x) + "," + sy(p.y)).join(" "));
  line.setAttribute("fill", "none"); line.setAttribute("stroke", "#1f5fbf");
  line.setAttribute("stroke-width", "2"); svg.appendChild(line);
  caption.textContent = key + " by " + points[0].axis + ": " + points.map(
    p => p.y.toPrecision(4)).join(", ");
}
async function refresh() {
  let status;
  try { status = await (await fetch("status.json", {cache: "no-store"})).json(); }
  catch (e) { document.getElementById("summary").textContent = "launcher unreachable"; return; }
  document.getElementById("job").textContent = status.job;
  document.getElementById("summary").textContent = status.state + " \\u00b7 " +
    status.tasks.length + " tasks \\u00b7 " + status.restarts + " restarts \\u00b7 up " +
    Math.round(status.now - status.started) + " s";
  const body = document.querySelector("#tasks tbody"); body.innerHTML = "";
  for (const t of status.tasks) {
    const row = document.createElement("tr"); row.className = t.state;
    row.dataset.task = t.task;
    cell(row, t.task); cell(row, t.state, "state"); cell(row, t.pid === null ? "" : t.pid);
    cell(row, t.restarts, "restarts"); cell(row, fmt(t.steps_per_second, 1));
    cell(row, fmt(t.cpu_cores, 2)); cell(row, t.rss_bytes ? fmt(t.rss_bytes / 1048576, 0) : "");
    cell(row, [t.straggler ? "straggler" : "", t.hot ? "hot ps" : ""].filter(x => x).join(", "),
         "flag");
    body.appendChild(row);
  }
  const events = document.querySelector("#events tbody"); events.innerHTML = "";
  for (const e of status.events.slice().reverse()) {
    const row = document.createElement("tr"); row.dataset.event = e.event;
    cell(row, new Date(e.time * 1000).toLocaleTimeString()); cell(row, e.event);
    cell(row, e.task || ""); cell(row, e.reason || ""); events.appendChild(row);
  }
  drawCurve(status.curve.points, status.curve.metric);
  document.body.dataset.loaded = "1";
}
refresh(); setInterval(refresh, 2000);
</script></body></html>
"""
