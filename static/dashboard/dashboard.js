// The scheduler dashboard: polls the data endpoint, updates the numbers and the charts.
(function () {
  "use strict";

  const script = document.currentScript;
  const dataUrl = script.dataset.url;
  const conf = JSON.parse(document.getElementById("dashboard-conf").textContent);
  const windowS = conf.chart_window_s;
  const history = []; // chart points, oldest first
  let lastTime = 0;
  let previous = null; // {at, workers: {id: tokens_generated}} for the live tokens/s
  const charts = {};

  const fmt = {
    int: function (v) { return Math.round(v).toLocaleString(); },
    pct: function (v) { return (100 * v).toFixed(1) + " %"; },
    rate: function (v) { return v.toFixed(1); },
  };

  function setText(id, text) {
    const node = document.getElementById(id);
    if (node) node.textContent = text;
  }

  function makeChart(id, series, yRange) {
    const el = document.getElementById(id);
    const opts = {
      width: Math.max(el.clientWidth, 480), height: 220,
      scales: { x: { time: true }, y: yRange ? { range: yRange } : {} },
      series: [{}].concat(series.map(function (s) {
        return { label: s.label, stroke: s.color, width: 2, points: { show: false } };
      })),
      axes: [{}, { size: 60 }],
    };
    const data = [[]].concat(series.map(function () { return []; }));
    return new uPlot(opts, data, el);
  }

  const palette = ["#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c", "#0891b2", "#ca8a04"];

  function initCharts() {
    charts.queues = makeChart("chart-queues", [
      { label: "pending", color: palette[0] }, { label: "prefilling", color: palette[4] },
      { label: "active", color: palette[2] }, { label: "gate 1 queue", color: palette[1] }]);
    charts.tps = makeChart("chart-tps", [{ label: "tokens/s", color: palette[0] }]);
    charts.kv = makeChart("chart-kv", [{ label: "kv_pressure", color: palette[3] }], [0, 1]);
    charts.reserved = makeChart("chart-reserved", [
      { label: "active_kv_reserved", color: palette[5] },
      { label: "kv_admit_blocked", color: palette[1] }]);
    charts.keys = null;
  }

  function column(name) {
    return history.map(function (p) { return p[name]; });
  }

  function keyChart() {
    const keys = new Set();
    history.forEach(function (p) { Object.keys(p.per_key || {}).forEach(function (k) { keys.add(k); }); });
    const names = Array.from(keys).sort();
    const signature = names.join("\u0000");
    if (!charts.keys || charts.keysSignature !== signature) {
      if (charts.keys) charts.keys.destroy();
      document.getElementById("chart-keys").textContent = "";
      charts.keys = makeChart("chart-keys", names.map(function (k, i) {
        return { label: k, color: palette[i % palette.length] };
      }));
      charts.keysSignature = signature;
    }
    const data = [column("t")].concat(names.map(function (k) {
      return history.map(function (p) {
        const row = (p.per_key || {})[k];
        return row ? row.completion_tokens_served : null;
      });
    }));
    charts.keys.setData(data);
  }

  function updateCharts() {
    const t = column("t");
    charts.queues.setData([t, column("num_pending"), column("num_prefilling"),
                           column("num_active"), column("gate1_queued")]);
    charts.tps.setData([t, column("tokens_per_s")]);
    charts.kv.setData([t, column("kv_pressure")]);
    charts.reserved.setData([t, column("active_kv_reserved"), column("kv_admit_blocked")]);
    keyChart();
  }

  function liveRate(live, now) {
    const workers = {};
    Object.keys(live.per_worker).forEach(function (w) {
      workers[w] = live.per_worker[w].tokens_generated;
    });
    let rate = null;
    if (previous && now > previous.at) {
      let tokens = 0;
      Object.keys(workers).forEach(function (w) {
        const before = previous.workers[w];
        if (before !== undefined) tokens += Math.max(0, workers[w] - before);
      });
      rate = tokens / (now - previous.at);
    }
    previous = { at: now, workers: workers };
    return rate;
  }

  // A table's body: a row per item ([its data attribute, the value, its cells' texts]), or one
  // cell of `columns` columns saying `empty`.
  function fillTable(selector, columns, empty, items) {
    const body = document.querySelector(selector + " tbody");
    body.textContent = "";
    if (!items.length) {
      const cell = body.insertRow().insertCell();
      cell.colSpan = columns;
      cell.textContent = empty;
    }
    items.forEach(function (item) {
      const row = body.insertRow();
      row.dataset[item[0]] = item[1];
      item[2].forEach(function (text) { row.insertCell().textContent = text; });
    });
  }

  function updateLive(data) {
    const live = data.live;
    const totals = live.totals;
    setText("dash-updated", "updated " + new Date(data.now * 1000).toLocaleTimeString());
    setText("dash-workers", String(live.workers));
    setText("m-kv_pressure", fmt.pct(totals.kv_pressure));
    setText("m-active_kv_reserved", fmt.int(totals.active_kv_reserved));
    setText("m-active_kv_budget", fmt.int(totals.active_kv_budget));
    setText("m-kv_admit_blocked", fmt.int(totals.kv_admit_blocked));
    setText("m-num_pending", fmt.int(totals.num_pending));
    setText("m-num_prefilling", fmt.int(totals.num_prefilling));
    setText("m-num_active", fmt.int(totals.num_active));
    setText("m-preemptions", fmt.int(totals.preemptions));
    setText("m-preempted_tokens_recomputed", fmt.int(totals.preempted_tokens_recomputed));
    const structured = totals.structured || {};
    setText("m-constrained_requests", fmt.int(structured.constrained_requests || 0));
    setText("m-compile_cache_hits", fmt.int(structured.compile_cache_hits || 0));
    setText("m-compile_refusals", fmt.int(structured.compile_refusals || 0));
    setText("m-gate1_queued", fmt.int(live.gate1_queued));
    setText("m-max_queue_size", fmt.int(live.max_queue_size));
    const batches = live.batches || { lines: {}, active: [] };
    setText("m-batches_active", fmt.int(batches.active.length));
    setText("m-batch_lines_completed", fmt.int(batches.lines.completed || 0));
    setText("m-batch_lines_failed", fmt.int(batches.lines.failed || 0));
    fillTable("#batches", 6, "no batch in progress", batches.active.map(function (b) {
      return ["batch", b.id, [b.id, b.tenant || "", b.status, fmt.int(b.total),
                              fmt.int(b.completed), fmt.int(b.failed)]];
    }));
    const perModel = live.per_model || {};
    fillTable("#per-model", 7, "no worker yet", Object.keys(perModel).sort().map(function (name) {
      const m = perModel[name];
      return ["model", name, [name, fmt.int(m.workers), fmt.int(m.gate1_queued),
                              fmt.int(m.num_pending), fmt.int(m.num_active),
                              fmt.pct(m.kv_pressure), fmt.int(m.tokens_generated)]];
    }));
    const perAdapter = live.per_adapter || {};
    fillTable("#per-adapter", 3, "no adapter loaded", Object.keys(perAdapter).map(function (name) {
      const a = perAdapter[name];
      return ["adapter", name, [name, fmt.int(a.workers), fmt.int(a.running)]];
    }));
    const rate = liveRate(live, data.now);
    if (rate !== null) setText("m-tokens_per_s", fmt.rate(rate));

    fillTable("#per-key", 6, "no requests yet", Object.keys(live.per_key).sort().map(function (key) {
      const k = live.per_key[key];
      return ["key", key, [key, k.vtc_counter.toFixed(1), fmt.int(k.in_flight),
                           fmt.int(k.pending), fmt.int(k.prompt_tokens_served),
                           fmt.int(k.completion_tokens_served)]];
    }));
  }

  function poll() {
    fetch(dataUrl + "?since=" + lastTime, { credentials: "same-origin" })
      .then(function (r) {
        if (!r.ok) throw new Error("HTTP " + r.status);
        return r.json();
      })
      .then(function (data) {
        data.history.forEach(function (p) { history.push(p); });
        if (history.length) lastTime = history[history.length - 1].t;
        const start = data.now - windowS;
        while (history.length && history[0].t < start) history.shift();
        updateLive(data);
        updateCharts();
      })
      .catch(function (err) { setText("dash-updated", "update failed: " + err.message); })
      .finally(function () { setTimeout(poll, conf.poll_interval_ms); });
  }

  initCharts();
  poll();
})();
