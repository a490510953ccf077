// accel-dash's page: polls /api/state every 2 s and draws every host, job and card. Every string that comes from a
// heartbeat goes into the page through textContent, never parsed as HTML, so a run named <img src=x ...> is text.
"use strict";

(function () {
  const REFRESH_MS = 2000;
  const charts = new Map(); // chart key -> {plot, box, seen}
  let generation = 0;

  function el(tag, className, text) {
    const node = document.createElement(tag);
    if (className) node.className = className;
    if (text !== undefined && text !== null) node.textContent = String(text);
    return node;
  }

  function num(value, digits, unit) {
    if (value === null || value === undefined || !isFinite(value)) return "–";
    return Number(value).toFixed(digits) + (unit || "");
  }

  function duration(seconds) {
    if (seconds === null || seconds === undefined) return "–";
    const s = Math.max(0, Math.round(seconds));
    const h = Math.floor(s / 3600), m = Math.floor((s % 3600) / 60);
    return h ? `${h} h ${String(m).padStart(2, "0")} min` : `${m} min ${String(s % 60).padStart(2, "0")} s`;
  }

  function ago(seconds) {
    return seconds < 90 ? `${Math.round(seconds)} s ago` : `${duration(seconds)} ago`;
  }

  // A sparkline: one uPlot per key, kept across refreshes (its box moves into the new DOM) and fed new data.
  function sparkline(key, t, values, color) {
    const data = [t, values.map((v) => (v === null ? null : v))];
    let chart = charts.get(key);
    if (!chart) {
      const box = el("div", "sparkline");
      const opts = {
        width: 150, height: 34, pxAlign: false, legend: { show: false }, cursor: { show: false },
        select: { show: false }, scales: { x: { time: false } }, axes: [{ show: false }, { show: false }],
        series: [{}, { stroke: color, width: 1.5, fill: color + "22", spanGaps: false }],
      };
      chart = { plot: new uPlot(opts, data, box), box: box };
      charts.set(key, chart);
    } else {
      chart.plot.setData(data);
    }
    chart.seen = generation;
    chart.box.dataset.points = String(values.filter((v) => v !== null).length);
    return chart.box;
  }

  function signalRow(grid, label, value, className, chartNode) {
    const cell = el("span", "spark");
    if (chartNode) cell.append(chartNode);
    grid.append(el("span", "label", label), el("span", "value " + className, value), cell);
  }

  function gpuCard(job, gpu, jobKey) {
    const latest = gpu.latest || {};
    const history = gpu.history || {};
    const t = (job.history && job.history.t) || [];
    const card = el("div", "card");
    card.dataset.uuid = gpu.uuid;
    card.dataset.index = String(gpu.index);
    const head = el("div", "card-head");
    head.append(el("b", "", `GPU ${gpu.index} · ${gpu.name}`), el("span", "uuid", gpu.uuid));
    card.append(head);
    const grid = el("div", "signals");
    const key = `${jobKey}/${gpu.uuid}`;
    const series = (name) => history[name] || [];
    const gpm = latest.sm_activity_pct !== undefined && latest.sm_activity_pct !== null;
    if (gpm) {
      signalRow(grid, "SM active", num(latest.sm_activity_pct, 0, " %"), "sm-active",
        sparkline(`${key}/sm`, t, series("sm_activity_pct"), "#1a7f37"));
      signalRow(grid, "tensor active", num(latest.tensor_activity_pct, 0, " %"), "tensor-active",
        sparkline(`${key}/tensor`, t, series("tensor_activity_pct"), "#8250df"));
    } else {
      signalRow(grid, "util (fallback)", num(latest.utilization_pct, 0, " %"), "utilization",
        sparkline(`${key}/util`, t, series("utilization_pct"), "#9a6700"));
      const note = el("span", "fallback", "no GPM on this card: utilisation is the share of time any kernel ran");
      grid.append(note);
    }
    signalRow(grid, "power", `${num(latest.power_w, 0)} / ${num(latest.power_limit_w, 0)} W`, "power",
      sparkline(`${key}/power`, t, series("power_w"), "#cf222e"));
    signalRow(grid, "temperature", num(latest.temperature_c, 0, " °C"), "temperature",
      sparkline(`${key}/temp`, t, series("temperature_c"), "#bc4c00"));
    const gib = (mib) => (mib === null || mib === undefined ? null : mib / 1024);
    signalRow(grid, "memory", `${num(gib(latest.memory_used_mib), 1)} / ${num(gib(latest.memory_total_mib), 1)} GiB`,
      "memory", sparkline(`${key}/mem`, t, series("memory_used_mib"), "#0969da"));
    const throttled = [["thermal", "throttle_thermal_frac"], ["power", "throttle_power_frac"],
      ["hw slowdown", "throttle_hw_slowdown_frac"]]
      .filter(([, k]) => (latest[k] || 0) > 0).map(([name, k]) => `${name} ${num(100 * latest[k], 0)} %`);
    signalRow(grid, "throttled", throttled.length ? throttled.join(", ") : "no", "throttle", null);
    signalRow(grid, "energy", gpu.energy_j === null || gpu.energy_j === undefined ? "–"
      : `${num(gpu.energy_j / 3600, 2)} Wh`, "energy", null);
    if (gpu.health) {  // XID, ECC, remapped rows, a lost card (the job's HealthReader)
      const problems = gpu.health.problems || [];
      signalRow(grid, "health", problems.length ? problems.join("; ") : "ok", "health", null);
      if (problems.length) card.classList.add("unhealthy");
    }
    card.append(grid);
    return card;
  }

  // One job: `entry` is {file, status (now), age_s (since its file changed, by accel-dash's clock), heartbeat (what
  // the job wrote; its `updated` is the job's clock, which may be off)}.
  function jobArticle(entry) {
    const job = entry.heartbeat;
    const status = entry.status;
    const article = el("article", "job");
    article.dataset.runId = job.run_id;
    article.dataset.status = status;
    article.dataset.host = job.host;
    article.dataset.file = entry.file;
    const head = el("div", "job-head");
    head.append(el("span", "badge " + status, status), el("span", "job-name", job.name),
      el("span", "muted run-id", job.run_id),
      el("span", "muted", `${job.user} · pid ${job.pid} · node ${job.node_rank + 1} of ${job.num_nodes}`),
      el("span", "muted", `updated ${ago(entry.age_s)}`));
    article.append(head);
    const facts = el("div", "facts");
    const fact = (label, value, className) => {
      const span = el("span", "", label + " ");
      span.append(el("b", className, value));
      facts.append(span);
    };
    fact("step", job.max_steps ? `${job.step} / ${job.max_steps}` : String(job.step), "step");
    fact("samples/s", num(job.samples_per_s, 1), "samples-per-s");
    if (status === "running") fact("ETA", duration(job.eta_s), "eta");
    fact("ranks", job.ranks.map((r) => `${r.rank} → ${r.device}`).join(", ") || "–", "ranks");
    fact("cards", String(job.gpus.length), "card-count");
    const t = (job.history && job.history.t) || [];
    const rate = el("span", "spark");
    rate.append(sparkline(`${entry.file}/rate`, t, (job.history && job.history.samples_per_s) || [], "#57606a"));
    facts.append(rate);
    article.append(facts);
    const command = el("div", "muted command", job.command);
    command.title = job.command; // the whole line on hover (an attribute set as text, never parsed)
    article.append(command);
    if (job.reason) article.append(el("p", "reason", job.reason));
    if (job.alerts.length) {
      const list = el("ul", "alerts");
      for (const alert of job.alerts) list.append(el("li", "", `step ${alert.step}, ${alert.name}: ${alert.message}`));
      article.append(list);
    }
    if (job.gpus.length) {
      const cards = el("div", "cards");
      for (const gpu of job.gpus) cards.append(gpuCard(job, gpu, entry.file));
      article.append(cards);
    } else {
      article.append(el("p", "muted", "no GPU: a CPU job"));
    }
    return article;
  }

  function freeCards(host) {
    const table = el("table", "free");
    const head = el("tr");
    for (const title of ["GPU", "name", "activity", "power", "temp", "memory", "processes (pid user name)"]) {
      head.append(el("th", "", title));
    }
    table.append(head);
    for (const card of host.cards) {
      const l = card.latest || {};
      const row = el("tr");
      row.dataset.uuid = card.uuid;
      const activity = l.sm_activity_pct !== undefined && l.sm_activity_pct !== null
        ? `SM ${num(l.sm_activity_pct, 0)} %` : `util ${num(l.utilization_pct, 0)} % (fallback)`;
      const procs = card.processes.map((p) => `${p.pid} ${p.user} ${p.name}`).join("; ") || "idle";
      row.append(el("td", "num", card.index), el("td", "", card.name), el("td", "num", activity),
        el("td", "num", `${num(l.power_w, 0)} W`), el("td", "num", num(l.temperature_c, 0, " °C")),
        el("td", "num", `${num((l.memory_used_mib || 0) / 1024, 1)} / ${num((l.memory_total_mib || 0) / 1024, 1)} GiB`),
        el("td", "processes", procs));
      table.append(row);
    }
    return table;
  }

  // The cards held while idle past the threshold: owner, what holds it, host, card, for how long, GPU-hours idle.
  function idleHeld(state) {
    const cards = state.idle_held || [];
    document.getElementById("idle-title").textContent =
      `Idle-held cards (held, under ${state.idle_threshold_pct} % active for ${duration(state.idle_after_s)} or more)`;
    const table = document.getElementById("idle");
    const head = el("tr");
    for (const title of ["owner", "held by", "host", "GPU", "idle for", "idle GPU-hours", "now"]) {
      head.append(el("th", "", title));
    }
    const rows = cards.map((card) => {
      const row = el("tr");
      row.dataset.uuid = card.uuid;
      row.dataset.host = card.host;
      row.append(el("td", "owner", card.owner), el("td", "holder", card.holder), el("td", "", card.host),
        el("td", "", `${card.index} ${card.name}`), el("td", "num for", duration(card.for_s)),
        el("td", "num", num(card.idle_gpu_hours, 3)), el("td", "num", `${card.signal} ${num(card.activity_pct, 0)} %`));
      return row;
    });
    table.replaceChildren(head, ...rows);
    document.getElementById("idle-section").hidden = cards.length === 0;
  }

  function render(state) {
    generation += 1;
    const now = state.generated;
    document.getElementById("where").textContent =
      `on ${state.host} · runs directory ${state.runs_dir} · stale after ${state.stale_after_s} s`;
    const hosts = el("main");
    hosts.id = "hosts";
    for (const host of state.hosts) {
      const section = el("section", "host");
      section.dataset.host = host.host;
      section.append(el("h2", "", `host ${host.host}`));
      for (const entry of host.jobs) section.append(jobArticle(entry));
      if (!host.jobs.length) section.append(el("p", "muted", "no job of ours on this host"));
      if (host.cards.length) {
        section.append(el("h3", "", "cards no job of ours holds"));
        section.append(freeCards(host));
      }
      hosts.append(section);
    }
    if (state.cards_problem) hosts.append(el("p", "muted", `this host's cards are not shown: ${state.cards_problem}`));
    document.getElementById("hosts").replaceWith(hosts);
    idleHeld(state);
    for (const [key, chart] of charts) {
      if (chart.seen !== generation) {
        chart.plot.destroy();
        charts.delete(key);
      }
    }
    const notes = document.getElementById("notes");
    notes.replaceChildren(...state.notes.map((note) => el("li", "", note)));
    document.getElementById("notes-section").hidden = state.notes.length === 0;
    document.body.dataset.generated = String(now);
  }

  async function refresh() {
    try {
      const response = await fetch("/api/state", { cache: "no-store" });
      if (!response.ok) throw new Error(`HTTP ${response.status}`);
      render(await response.json());
      document.getElementById("updated").textContent = `updated ${new Date().toLocaleTimeString()}`;
    } catch (err) {
      document.getElementById("updated").textContent = `accel-dash cannot be reached (${err}); retrying`;
    } finally {
      setTimeout(refresh, REFRESH_MS);
    }
  }

  refresh();
})();
