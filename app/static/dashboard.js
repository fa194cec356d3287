// Stepline's live SLO dashboard: polls /v1/dashboard/data every second and draws it. Plain JS,
// no build step; charts by the vendored uPlot, the worker timeline on a canvas.
//
// Every figure taken from /v1/stats sits in an element with data-field="a/b/c" (its path in the
// stats object) and data-value=<the raw value as JSON>, so a test can hold the page to the API.
"use strict";

(() => {
  const POLL_MS = 1000;
  const HISTORY_POINTS = 600;           // 10 minutes of one-second samples for the charts
  const CHART_SPAN_S = 300;             // the charts show the last 5 minutes
  let timelineS = 60;                   // the timeline's length, chosen in the page
  const CLASSES = ["realtime", "interactive", "batch"];
  const CHART_QUEUES = ["realtime", "interactive", "batch", "standby"];
  const COLORS = {realtime: "#d62728", interactive: "#ff7f0e", batch: "#1f77b4",
                  standby: "#6b7280", other: "#9aa1ab"};

  const $ = (selector) => document.querySelector(selector);

  // formatting -----------------------------------------------------------------------------
  const fmt = {
    pct: (v) => (v == null ? "—" : `${(v * 100).toFixed(1)} %`),
    secs: (v) => {
      if (v == null) return "—";
      if (v < 1) return `${Math.round(v * 1000)} ms`;
      if (v < 120) return `${v.toFixed(2)} s`;
      return `${(v / 60).toFixed(1)} min`;
    },
    count: (v) => (v == null ? "—" : String(v)),
    number: (v) => (v == null ? "—" : Number(v).toFixed(2)),
    text: (v) => (v == null || v === "" ? "—" : String(v)),
    clock: (v) => (v == null ? "—" : new Date(v * 1000).toLocaleTimeString()),
    list: (v) => (v == null ? "—" : v.length ? v.join(", ") : "none"),
  };

  function valueAt(object, path) {
    let value = object;
    for (const key of path.split("/")) {
      if (value == null || typeof value !== "object") return null;
      value = key === "length" && Array.isArray(value) ? value.length : value[key];
    }
    return value === undefined ? null : value;
  }

  function show(el, value, text) {
    el.dataset.value = JSON.stringify(value);
    el.textContent = text;
  }

  function cell(row, text, className) {
    const td = row.insertCell();
    td.textContent = text;
    if (className) td.className = className;
    return td;
  }

  function fieldCell(row, stats, path, format, className) {
    const td = cell(row, "", className);
    td.dataset.field = path;
    const value = valueAt(stats, path);
    show(td, value, format(value));
    return td;
  }

  // the fixed fields ----------------------------------------------------------------------
  const FIXED = {
    "window/jobs": fmt.count,
    "load/load": fmt.number,
    "load/effective_load": fmt.number,
    "load/compute_load": fmt.number,
    "load/retry_after_s": fmt.secs,
    "load/policy": fmt.text,
    "load/reserved_workers": fmt.list,
    "load/measured_at_s": fmt.clock,
    "workers/length": fmt.count,
  };

  function renderFixed(stats) {
    for (const [path, format] of Object.entries(FIXED)) {
      for (const el of document.querySelectorAll(`[data-field="${path}"]`)) {
        const value = valueAt(stats, path);
        show(el, value, format(value));
      }
    }
    const origin = $('[data-field="origin"]');
    show(origin, stats.origin,
         stats.origin ? stats.origin : stats.origin_active ? "another tenant's job" : "none");
    const state = $('[data-field="load/state"]');
    const admission = valueAt(stats, "load/state");
    show(state, admission, admission == null ? "no tick yet" : admission);
    state.className = `pill ${admission || ""}`;
    $("#window-seconds").textContent = fmt.secs(stats.window.seconds);
  }

  // per-class cards ------------------------------------------------------------------------
  function attainmentClass(value, target) {
    if (value == null) return "";
    if (value >= target) return "good";
    return value >= target - 0.1 ? "warn" : "bad";
  }

  function renderClasses(stats, targets) {
    const box = $("#classes");
    box.replaceChildren();
    for (const slo of CLASSES) {
      const card = document.createElement("div");
      card.className = `card ${slo}`;
      const title = document.createElement("h3");
      const target = document.createElement("small");
      target.textContent = `target < ${targets[slo] < 1 ? fmt.secs(targets[slo]) : `${Number(targets[slo].toFixed(2))} s`}`;
      title.append(slo[0].toUpperCase() + slo.slice(1), target);
      const big = document.createElement("div");
      const base = `window/classes/${slo}`;
      const attainment = valueAt(stats, `${base}/attainment`);
      big.className = `big ${attainmentClass(attainment, 0.99)}`;
      big.dataset.field = `${base}/attainment`;
      show(big, attainment, fmt.pct(attainment));
      const facts = document.createElement("dl");
      const rows = [
        ["met / ended", [[`${base}/met`, fmt.count], [`${base}/finished`, fmt.count]]],
        ["p50 latency", [[`${base}/p50_latency_s`, fmt.secs]]],
        ["p95 latency", [[`${base}/p95_latency_s`, fmt.secs]]],
        ["unfinished now", [[`classes/${slo}/unfinished`, fmt.count]]],
      ];
      for (const [label, fields] of rows) {
        const dt = document.createElement("dt");
        dt.textContent = label;
        const dd = document.createElement("dd");
        fields.forEach(([path, format], i) => {
          if (i) dd.append(" / ");
          const span = document.createElement("span");
          span.dataset.field = path;
          const value = valueAt(stats, path);
          show(span, value, format(value));
          dd.append(span);
        });
        facts.append(dt, dd);
      }
      card.append(title, big, facts);
      box.append(card);
    }
  }

  // tables ---------------------------------------------------------------------------------
  function renderQueues(stats) {
    const body = $("#queues tbody");
    body.replaceChildren();
    for (const queue of Object.keys(stats.queues)) {
      const row = body.insertRow();
      cell(row, queue);
      fieldCell(row, stats, `queues/${queue}`, fmt.count, "num");
      fieldCell(row, stats, `queue_oldest_age_s/${queue}`, fmt.secs, "num");
    }
  }

  function renderTenants(stats) {
    const body = $("#tenants tbody");
    body.replaceChildren();
    for (const row of stats.tenants || []) {
      const tr = body.insertRow();
      cell(tr, row.band);
      cell(tr, row.tenant);
      cell(tr, fmt.secs(row.service_s), "num");
      cell(tr, row.share === null ? "—" : fmt.pct(row.share), "num");
    }
  }

  function rates(map, skip) {
    const parts = Object.entries(map || {}).filter(([name]) => name !== skip)
      .map(([name, rate]) => `${name} ${fmt.pct(rate)}`);
    return parts.length ? parts.join(", ") : "—";
  }

  function megabytes(bytes) {
    return `${(bytes / 1e6).toFixed(1)} MB`;
  }

  // the models a worker holds: on its device (bytes of its budget), in host memory, staging
  function residencyText(models) {
    const parts = [];
    if ((models.device || []).length) {
      const budget = models.budget_bytes == null ? "" : ` of ${megabytes(models.budget_bytes)}`;
      parts.push(`${models.device.join(", ")} (${megabytes(models.device_bytes)}${budget})`);
    }
    if ((models.host || []).length) parts.push(`host: ${models.host.join(", ")}`);
    if ((models.staging || []).length) parts.push(`staging: ${models.staging.join(", ")}`);
    if (models.loading) {
      const expected = models.loading.expected_s == null ? ""
        : ` (${models.loading.expected_s.toFixed(1)} s expected)`;
      parts.push(`loading: ${models.loading.model}${expected}`);
    }
    return parts.length ? parts.join(" · ") : "—";
  }

  function renderWorkers(stats) {
    const body = $("#workers tbody");
    body.replaceChildren();
    stats.workers.forEach((worker, i) => {
      const row = body.insertRow();
      cell(row, worker.name);
      fieldCell(row, stats, `workers/${i}/busy_job`, (v) => (v == null ? "idle" : v),
                worker.busy_job ? "" : "dim");
      fieldCell(row, stats, `workers/${i}/chunks_run`, fmt.count, "num");
      fieldCell(row, stats, `workers/${i}/age_s`, fmt.secs, "num");
      fieldCell(row, stats, `workers/${i}/cache_hit_rates/ckpt_cache`, fmt.pct, "num");
      const resident = Object.entries(worker.experts_resident || {});
      cell(row, resident.length ? resident.map(([m, n]) => `${m}: ${n}`).join(", ") : "—");
      cell(row, residencyText(worker.models || {}));
      fieldCell(row, stats, `workers/${i}/models/loads`, fmt.count, "num");
      fieldCell(row, stats, `workers/${i}/models/load_s`, fmt.secs, "num");
      cell(row, rates(worker.cache_hit_rates, "ckpt_cache"));
      cell(row, (worker.queues || []).join(", "), "dim");
    });
  }

  // charts ---------------------------------------------------------------------------------
  const history = {t: [], attainment: CLASSES.map(() => []), depth: CHART_QUEUES.map(() => [])};
  let charts = null;

  function clockTick(t) {
    return new Date(t * 1000).toLocaleTimeString([], {hour: "2-digit", minute: "2-digit"});
  }

  function makeChart(el, names, yRange, yFormat) {
    const opts = {
      width: Math.max(el.clientWidth, 300), height: 220,
      // A fixed span of time, so a short history does not stretch into sub-second ticks.
      scales: {x: {time: true, range: (u, min, max) => [max - CHART_SPAN_S, max]},
               y: yRange ? {range: yRange} : {}},
      series: [{}, ...names.map((name) => ({label: name, stroke: COLORS[name], width: 2,
                                              spanGaps: true, value: (u, v) => yFormat(v)}))],
      axes: [{space: 80, values: (u, ticks) => ticks.map(clockTick)},
             {values: (u, ticks) => ticks.map(yFormat), size: 60}],
      legend: {live: false},
    };
    return new uPlot(opts, [[], ...names.map(() => [])], el);
  }

  function ensureCharts() {
    if (charts || typeof uPlot === "undefined") return;
    const pct = (v) => (v == null ? "—" : `${Math.round(v)}%`);
    const depth = (v) => (v == null ? "—" : String(Math.round(v)));
    charts = {
      attainment: makeChart($("#chart-attainment"), CLASSES, [0, 100], pct),
      depth: makeChart($("#chart-queues"), CHART_QUEUES, null, depth),
    };
    window.addEventListener("resize", () => {
      for (const [chart, id] of [[charts.attainment, "#chart-attainment"],
                                 [charts.depth, "#chart-queues"]]) {
        chart.setSize({width: Math.max($(id).clientWidth, 300), height: 220});
      }
    });
  }

  function renderCharts(stats) {
    ensureCharts();
    history.t.push(stats.measured_at);
    CLASSES.forEach((slo, i) => {
      const value = valueAt(stats, `window/classes/${slo}/attainment`);
      history.attainment[i].push(value == null ? null : value * 100);
    });
    CHART_QUEUES.forEach((queue, i) => history.depth[i].push(stats.queues[queue] ?? null));
    if (history.t.length > HISTORY_POINTS) {
      history.t.shift();
      history.attainment.forEach((series) => series.shift());
      history.depth.forEach((series) => series.shift());
    }
    if (!charts) return;
    charts.attainment.setData([history.t, ...history.attainment]);
    charts.depth.setData([history.t, ...history.depth]);
  }

  // the worker timeline ----------------------------------------------------------------------
  const LANE_PX = 26, LABEL_PX = 150, AXIS_PX = 22, RIGHT_PX = 12;
  let drawn = {spans: [], lanes: [], x: null};

  function renderTimeline(timeline) {
    const canvas = $("#timeline");
    const lanes = timeline.workers;
    const cssWidth = Math.max(canvas.parentElement.clientWidth, 400);
    const cssHeight = AXIS_PX + Math.max(lanes.length, 1) * LANE_PX + 8;
    const ratio = window.devicePixelRatio || 1;
    canvas.width = Math.round(cssWidth * ratio);
    canvas.height = Math.round(cssHeight * ratio);
    canvas.style.height = `${cssHeight}px`;
    const g = canvas.getContext("2d");
    g.setTransform(ratio, 0, 0, ratio, 0, 0);
    g.clearRect(0, 0, cssWidth, cssHeight);
    g.font = "12px system-ui, sans-serif";
    const span = Math.max(timeline.until - timeline.since, 1e-6);
    const plotWidth = cssWidth - LABEL_PX - RIGHT_PX;
    const x = (t) => LABEL_PX + ((t - timeline.since) / span) * plotWidth;
    drawAxis(g, timeline, x, cssHeight);
    if (!lanes.length) {
      g.fillStyle = "#6b7280";
      g.fillText("no live worker", LABEL_PX + 8, AXIS_PX + 17);
    }
    lanes.forEach((worker, lane) => {
      const y = AXIS_PX + lane * LANE_PX;
      g.fillStyle = lane % 2 ? "#fafbfc" : "#f1f3f6";
      g.fillRect(LABEL_PX, y, plotWidth, LANE_PX);
      g.fillStyle = "#1d2330";
      g.fillText(clip(g, worker, LABEL_PX - 10), 4, y + 17);
    });
    const laneOf = new Map(lanes.map((w, i) => [w, i]));
    const boxes = [];
    for (const s of timeline.spans) {
      const lane = laneOf.get(s.worker);
      if (lane === undefined) continue;
      const left = x(s.start), width = Math.max(x(s.end) - left, 1.5);
      const top = AXIS_PX + lane * LANE_PX + 4, height = LANE_PX - 8;
      g.fillStyle = s.job == null ? COLORS.other : COLORS[s.slo] || COLORS.other;
      g.fillRect(left, top, width, height);
      if (width > 54 && s.job) {
        g.fillStyle = "#fff";
        g.fillText(clip(g, s.job, width - 6), left + 3, top + 13);
      }
      boxes.push({left, width, top, height, span: s});
    }
    for (const p of timeline.preemptions) {
      const lane = laneOf.get(p.worker);
      if (lane === undefined) continue;
      const px = x(p.at), top = AXIS_PX + lane * LANE_PX;
      g.fillStyle = "#000";
      g.beginPath();
      g.moveTo(px - 6, top);
      g.lineTo(px + 6, top);
      g.lineTo(px, top + 10);
      g.closePath();
      g.fill();
      boxes.push({left: px - 6, width: 12, top, height: 10, preemption: p});
    }
    drawn = {boxes};
    canvas.dataset.spans = String(timeline.spans.length);
    canvas.dataset.preemptions = String(timeline.preemptions.length);
    canvas.dataset.workers = String(lanes.length);
    canvas.setAttribute("aria-label", `worker occupancy over the last ${timelineS} s: ` +
      `${timeline.spans.length} spans on ${lanes.length} workers, ` +
      `${timeline.preemptions.length} preemptions`);
  }

  function drawAxis(g, timeline, x, height) {
    g.strokeStyle = "#e3e6eb";
    g.fillStyle = "#6b7280";
    const step = timelineS <= 60 ? 10 : timelineS <= 180 ? 30 : 60;
    for (let back = 0; back <= timeline.until - timeline.since + 1e-9; back += step) {
      const px = x(timeline.until - back);
      g.beginPath();
      g.moveTo(px, AXIS_PX - 4);
      g.lineTo(px, height);
      g.stroke();
      const label = back === 0 ? "now" : `−${back} s`;
      g.fillText(label, Math.min(px - g.measureText(label).width / 2,
                                 x(timeline.until) - g.measureText(label).width), 13);
    }
  }

  function clip(g, text, width) {
    if (g.measureText(text).width <= width) return text;
    let cut = text;
    while (cut.length > 1 && g.measureText(`${cut}…`).width > width) cut = cut.slice(0, -1);
    return `${cut}…`;
  }

  function describe(box) {
    const when = (t) => `${(t - Date.now() / 1000).toFixed(1)} s`;
    if (box.preemption) {
      const p = box.preemption;
      return `▼ ${p.job || "another tenant's job"} (${p.slo}) preempted on ${p.worker} ` +
             `at ${when(p.at)}: ${p.reason}`;
    }
    const s = box.span;
    return `${s.job || "another tenant's job"} (${s.slo}) on ${s.worker}: ` +
           `${when(s.start)} → ${s.running ? "running" : when(s.end)}`;
  }

  function hookTooltip() {
    const canvas = $("#timeline"), tip = $("#timeline-tip");
    canvas.addEventListener("mousemove", (event) => {
      const r = canvas.getBoundingClientRect();
      const mx = event.clientX - r.left, my = event.clientY - r.top;
      const hit = (drawn.boxes || []).slice().reverse().find(
        (b) => mx >= b.left && mx <= b.left + b.width && my >= b.top && my <= b.top + b.height);
      tip.hidden = !hit;
      if (hit) {
        tip.textContent = describe(hit);
        tip.style.left = `${Math.min(mx + 12, r.width - 320)}px`;
        tip.style.top = `${my + 14}px`;
      }
    });
    canvas.addEventListener("mouseleave", () => { tip.hidden = true; });
  }

  // polling --------------------------------------------------------------------------------
  function setStatus(state, text) {
    const el = $("#status");
    el.dataset.state = state;
    el.textContent = text;
  }

  function render(data) {
    const stats = data.stats;
    renderFixed(stats);
    renderClasses(stats, data.slo_targets_s);
    renderQueues(stats);
    renderTenants(stats);
    renderWorkers(stats);
    renderCharts(stats);
    renderTimeline(data.timeline);
    $("#viewer").textContent = data.viewer;
    const updated = $("#updated");
    updated.textContent = fmt.clock(stats.measured_at);
    updated.dataset.value = JSON.stringify(stats.measured_at);
  }

  async function poll() {
    try {
      const response = await fetch(`/v1/dashboard/data?timeline_s=${timelineS}`,
                                   {credentials: "same-origin", cache: "no-store"});
      if (response.status === 401) {
        location.assign("/dashboard");   // the session ended: back to the sign-in page
        return;
      }
      if (!response.ok) {
        const body = await response.json().catch(() => ({}));
        throw new Error(body.detail || `HTTP ${response.status}`);
      }
      render(await response.json());
      setStatus("live", "live");
    } catch (error) {
      setStatus("stale", `stale: ${error.message}`);
    }
    setTimeout(poll, POLL_MS);
  }

  function hookTimelineLength() {
    const select = $("#timeline-length");
    select.value = String(timelineS);
    select.addEventListener("change", () => { timelineS = Number(select.value); });
  }

  hookTooltip();
  hookTimelineLength();
  poll();
})();
