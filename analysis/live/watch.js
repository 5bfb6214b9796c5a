// The live page of `dynamics watch`: draws the watcher's figures once, then extends their
// traces with the rows each poll brings. A trace's `meta` ({run, series, column}) names what it
// draws. The figures are drawn anew when the watcher's key changes (a run joined, or its file
// was replaced), when a group's first rows arrive, and when a trace outgrows twice the display
// budget (the watcher decimates it again, keeping every bucket's extremes).
"use strict";
(function () {
  const root = document.getElementById("watch");
  const EVERY_MS = 1000 * Number(root.dataset.every);
  const BUDGET = Number(root.dataset.budget);
  const RATE_WINDOW_MS = 10000;
  const CONFIG = { displaylogo: false, responsive: true };
  const TYPED = {
    i1: Int8Array, u1: Uint8Array, i2: Int16Array, u2: Uint16Array,
    i4: Int32Array, u4: Uint32Array, f4: Float32Array, f8: Float64Array,
  };
  // The page has no icon: without one named in its head, a browser asks the watcher for
  // /favicon.ico and logs the 404 as an error.
  const icon = document.createElement("link");
  icon.rel = "icon";
  icon.href = "data:,";
  document.head.appendChild(icon);

  let key = null;
  let since = {};
  let redraw = true;
  const arrivals = {}; // label -> [[time, steps recorded], ...] over the rate window
  const events = {}; // label -> events shown

  // plotly's JSON keeps arrays as base64 of their bytes; a trace extended in place must hold
  // plain numbers (an int8 step array would wrap at 128).
  function plain(value) {
    if (Array.isArray(value)) return value.map(plain);
    if (value && typeof value === "object") {
      if (typeof value.bdata === "string" && TYPED[value.dtype]) return decoded(value);
      const out = {};
      for (const k of Object.keys(value)) out[k] = plain(value[k]);
      return out;
    }
    return value;
  }

  function decoded(spec) {
    const bytes = Uint8Array.from(atob(spec.bdata), (c) => c.charCodeAt(0));
    const flat = Array.from(new TYPED[spec.dtype](bytes.buffer));
    if (spec.shape === undefined) return flat;
    const [rows, columns] = String(spec.shape).split(",").map(Number);
    return Array.from({ length: rows }, (_, r) => flat.slice(r * columns, (r + 1) * columns));
  }

  async function fetchJSON(url, body) {
    const options = body === undefined ? {} : { method: "POST", body: JSON.stringify(body) };
    const response = await fetch(url, options);
    if (!response.ok) throw new Error(`${url}: HTTP ${response.status}`);
    const reply = await response.json();
    if (reply.error) throw new Error(reply.error);
    return reply;
  }

  async function drawFigures() {
    const drawn = await fetchJSON("api/figures");
    const container = document.getElementById("figures");
    const wanted = new Set(drawn.figures.map((f) => `figure-${f.group}`));
    for (const old of [...container.children]) {
      if (!wanted.has(old.id)) {
        Plotly.purge(old);
        old.remove();
      }
    }
    for (const { group, figure } of drawn.figures) {
      let div = document.getElementById(`figure-${group}`);
      if (div === null) {
        div = document.createElement("div");
        div.id = `figure-${group}`;
        div.className = "figure plotly-graph-div"; // the class plotly gives its own divs
        div.dataset.group = group;
        container.appendChild(div);
      }
      const { data, layout } = plain(figure);
      // A zoom or a hidden trace outlives a redraw of the same runs (plotly keeps what the
      // user changed while uirevision stays), not the arrival of other runs.
      layout.uirevision = `${drawn.key} ${group}`;
      await Plotly.react(div, data, layout, CONFIG);
    }
    document.getElementById("empty").hidden = drawn.figures.length > 0;
    if (drawn.key !== key) {
      // Other runs, or a run's file replaced: their events are listed anew from the first.
      document.getElementById("events").replaceChildren();
      for (const label of Object.keys(events)) delete events[label];
    }
    key = drawn.key;
    since = drawn.since;
    for (const label of Object.keys(since)) since[label].events = events[label] || 0;
  }

  // Extends every trace drawing one of the run's series of `group`; false when none does
  // (the group's first rows: its figure is drawn anew).
  function extend(label, group, rows) {
    const div = document.getElementById(`figure-${group}`);
    if (div === null || !(group in ((since[label] || {}).groups || {}))) return false;
    const data = div.data.map((trace) => {
      const meta = trace.meta;
      if (!meta || meta.run !== label || !(meta.series in rows.series)) return trace;
      const values = rows.series[meta.series];
      if (trace.type === "heatmap") {
        const z = trace.z.map((row, j) =>
          row.concat(values.map((v) => (meta.log10 ? log10(v[j]) : v[j]))));
        return { ...trace, x: trace.x.concat(rows.step), z };
      }
      const y = values.map((v) => v[meta.column]);
      return { ...trace, x: trace.x.concat(rows.step), y: trace.y.concat(y) };
    });
    if (data.some((t) => (t.x || []).length > 2 * BUDGET)) redraw = true;
    Plotly.react(div, data, div.layout, CONFIG);
    return true;
  }

  function log10(v) {
    return v === null || v <= 0 ? null : Math.log10(v);
  }

  function showRuns(runs) {
    const body = document.querySelector("#runs tbody");
    const now = Date.now();
    const paths = new Set(runs.map((run) => run.path));
    for (const row of [...body.children]) if (!paths.has(row.dataset.path)) row.remove();
    for (const run of runs) {
      let row = body.querySelector(`tr[data-path="${CSS.escape(run.path)}"]`);
      if (row === null) {
        row = document.createElement("tr");
        row.dataset.path = run.path;
        for (let i = 0; i < 6; i++) row.appendChild(document.createElement("td"));
        body.appendChild(row);
      }
      const state = run.problem && !run.state ? "unreadable" : run.state || "waiting";
      row.dataset.state = state;
      row.className = state;
      const updated = run.updated_at ? `${Math.max(0, now / 1000 - run.updated_at).toFixed(0)} s ago` : "—";
      const note = [run.exception, run.problem].filter(Boolean).join(" · ");
      const cells = [run.name, state, run.last_step ?? "—", rate(run.label), updated, note];
      cells.forEach((text, i) => (row.children[i].textContent = String(text)));
      if (run.events) showEvents(run);
    }
  }

  // Rows a second over the rate window: the rows of the polls after its first, over the time
  // since that one. The first poll's rows are left out, as the time they took to come is not
  // known (the page's load, a redraw); "—" until two polls are in the window.
  function rate(label) {
    const seen = arrivals[label] || [];
    if (seen.length < 2) return "—";
    const rows = seen.slice(1).reduce((n, [, count]) => n + count, 0);
    return ((1000 * rows) / (seen[seen.length - 1][0] - seen[0][0])).toFixed(1);
  }

  function showEvents(run) {
    const list = document.getElementById("events");
    for (const event of run.events) {
      const item = document.createElement("li");
      item.className = event.kind;
      item.textContent = `${run.name} · step ${event.step} · ${event.probe} · ${event.kind}: ${event.message}`;
      list.appendChild(item);
    }
    if (run.events_left_out) {
      const item = document.createElement("li");
      item.textContent = `${run.name}: ${run.events_left_out} more events (dynamics info ${run.path})`;
      list.appendChild(item);
    }
    events[run.label] = run.events_seen;
    if (since[run.label]) since[run.label].events = run.events_seen;
    document.getElementById("no-events").hidden = list.children.length > 0;
  }

  async function poll() {
    if (redraw) {
      redraw = false;
      await drawFigures();
    }
    const update = await fetchJSON(`api/update?key=${encodeURIComponent(key)}`, since);
    if (update.key !== key) redraw = true;
    const now = Date.now();
    for (const [label, groups] of Object.entries(update.rows)) {
      // A run's rate is of its rows (steps recorded), not of its groups' rows added up.
      let count = 0;
      for (const [group, rows] of Object.entries(groups)) {
        count = Math.max(count, rows.step.length);
        if (redraw) continue; // the figures are drawn anew with these rows in them
        if (!extend(label, group, rows)) {
          redraw = true;
          continue;
        }
        since[label].groups[group] = rows.step[rows.step.length - 1];
      }
      arrivals[label] = (arrivals[label] || []).filter(([t]) => now - t <= RATE_WINDOW_MS);
      arrivals[label].push([now, count]);
    }
    showRuns(update.runs);
  }

  async function loop() {
    const status = document.getElementById("watcher");
    try {
      await poll();
      status.textContent = `updated ${new Date().toLocaleTimeString()}`;
      status.className = "meta";
    } catch (error) {
      // The watcher stopped, or a file could not be read for a moment: keep trying.
      status.textContent = `cannot update: ${error.message}`;
      status.className = "meta warning";
      redraw = true;
    }
    setTimeout(loop, EVERY_MS);
  }

  loop();
})();
