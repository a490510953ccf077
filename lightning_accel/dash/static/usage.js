// accel-dash's usage page: GPU-hours held per user per UTC day (stacked: busy below, idle-held above) and the top
// idle-held jobs, from /api/usage. Strings go into the page through textContent only; the bars are SVG attributes.
"use strict";

(function () {
  const SVG = "http://www.w3.org/2000/svg";

  function el(tag, className, text) {
    const node = document.createElement(tag);
    if (className) node.className = className;
    if (text !== undefined && text !== null) node.textContent = String(text);
    return node;
  }

  function svg(tag, attrs) {
    const node = document.createElementNS(SVG, tag);
    for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, String(v));
    return node;
  }

  function chart(days, held, idle, top) {
    const width = Math.max(240, days.length * 14), height = 120, bar = Math.max(4, width / days.length - 3);
    const root = svg("svg", { width, height: height + 16, viewBox: `0 0 ${width} ${height + 16}`, role: "img" });
    days.forEach((day, i) => {
      const x = i * (width / days.length);
      const h = top ? (held[i] / top) * height : 0, hi = top ? (idle[i] / top) * height : 0;
      const busy = svg("rect", { x, y: height - h + hi, width: bar, height: Math.max(0, h - hi), fill: "#0969da" });
      const idled = svg("rect", { x, y: height - h, width: bar, height: hi, fill: "#d97706", class: "idle-bar" });
      const title = svg("title", {});
      title.textContent = `${day}: ${held[i].toFixed(2)} GPU-h held, ${idle[i].toFixed(2)} idle-held`;
      busy.append(title);
      root.append(busy, idled);
    });
    const first = svg("text", { x: 0, y: height + 12, "font-size": 10 }), last = svg("text", {
      x: width, y: height + 12, "font-size": 10, "text-anchor": "end" });
    first.textContent = days[0] || "";
    last.textContent = days[days.length - 1] || "";
    root.append(first, last);
    return root;
  }

  function render(data) {
    document.getElementById("where").textContent =
      `${data.days.length} days (UTC) from ${data.databases.length} database(s)`;
    const users = document.getElementById("users");
    const names = Object.keys(data.held_gpu_hours).sort();
    const top = Math.max(0, ...names.flatMap((u) => data.held_gpu_hours[u]));
    users.replaceChildren(...names.map((user) => {
      const box = el("div", "usage-user");
      box.dataset.user = user;
      const held = data.held_gpu_hours[user], idle = data.idle_gpu_hours[user] || held.map(() => 0);
      const sum = (xs) => xs.reduce((a, b) => a + b, 0);
      box.append(el("h3", "", `${user}: ${sum(held).toFixed(1)} GPU-h held, ${sum(idle).toFixed(1)} idle-held`),
        chart(data.days, held, idle, top));
      return box;
    }));
    if (!names.length) users.append(el("p", "muted", "no usage recorded in this range"));
    const table = document.getElementById("top");
    const head = el("tr");
    for (const t of ["user", "job", "idle-held GPU-h", "held GPU-h", "kWh"]) head.append(el("th", "", t));
    table.replaceChildren(head, ...data.top_idle_jobs.map((job) => {
      const row = el("tr");
      row.append(el("td", "", job.key[0]), el("td", "", job.key[1]), el("td", "num", job.idle_gpu_hours.toFixed(2)),
        el("td", "num", job.gpu_hours.toFixed(2)), el("td", "num", job.kwh.toFixed(2)));
      return row;
    }));
    const notes = document.getElementById("usage-notes");
    notes.replaceChildren(...data.notes.map((n) => el("li", "", n)));
    document.getElementById("usage-notes-section").hidden = data.notes.length === 0;
    document.body.dataset.loaded = "1";
  }

  fetch("/api/usage", { cache: "no-store" })
    .then((r) => (r.ok ? r.json() : Promise.reject(new Error(`HTTP ${r.status}`))))
    .then(render)
    .catch((err) => { document.getElementById("where").textContent = `usage cannot be read (${err})`; });
})();
