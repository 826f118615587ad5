/* pagemill dashboard: draws the engine's pictures (see dashboard/snapshot.py).
 *
 * Live: an EventSource on dashboard/events sends `init` (config, chart history, events, the
 * last picture), then `snapshot` and `points` messages. Replay (`pagemill simulate --html`):
 * the recording is embedded in the page (gzip + base64, inflated with DecompressionStream).
 * Read-only: nothing here sends anything but the GETs of the page itself. All text from the
 * server goes through textContent, never innerHTML.
 */
(function () {
  "use strict";

  var $ = function (id) { return document.getElementById(id); };
  var state = {
    config: {}, snap: null, series: [], events: [], cells: [], grid: "", owners: null,
    snapshots: 0, charts: [], highlighted: [], cores: [],
  };
  window.pagemill = state;

  // ------------------------------------------------------------------ formatting

  function pct(x) { return (x * 100).toFixed(1) + "%"; }
  function num(x) { return x == null ? "–" : String(x); }
  function clock(t) {
    if (state.config.mode !== "live") return t.toFixed(2) + " s";
    var d = new Date(t * 1000);
    return d.toLocaleTimeString();
  }
  function el(tag, cls, text) {
    var e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text != null) e.textContent = text;
    return e;
  }

  // ------------------------------------------------------------------ the block grid

  function cellState(c) {
    if (c === ".") return ["free", 0];
    if (c === "c") return ["cached", 0];
    var ref = c === "+" ? 10 : +c;
    return [ref > 1 ? "shared" : "used", ref];
  }

  // Paints `grid` into `g`, reusing `cells` (the previous grid's) and repainting only the
  // cells that changed since `prev`; returns the cells. `engine` tags a data-parallel core's.
  function paint(g, grid, cells, prev, engine) {
    var dense = grid.length > 1024;
    if (cells.length !== grid.length) {
      g.textContent = "";
      cells = [];
      var frag = document.createDocumentFragment();
      for (var i = 0; i < grid.length; i++) {
        var cell = el("div", "cell free");
        cell.dataset.block = i;
        cell.dataset.state = "free";
        cell.dataset.ref = "0";
        if (engine != null) cell.dataset.engine = engine;
        cells.push(cell);
        frag.appendChild(cell);
      }
      g.appendChild(frag);
      g.classList.toggle("dense", dense);
      prev = "";
    }
    for (var j = 0; j < grid.length; j++) {
      var c = grid[j];
      if (c === prev[j]) continue;
      var s = cellState(c), e = cells[j];
      e.className = "cell " + s[0];
      e.dataset.state = s[0];
      e.dataset.ref = c === "+" ? "10+" : String(s[1]);
      e.textContent = s[1] > 1 && !dense ? c : "";
    }
    return cells;
  }

  function renderGrid(snap) {
    var g = $("grid"), grid = snap.grid;
    if (state.cores.length) { g.textContent = ""; g.className = "grid"; state.cores = []; state.cells = []; }
    state.cells = paint(g, grid, state.cells, state.grid);
    state.grid = grid;
    state.owners = null;
    $("pool-note").textContent = snap.num_blocks + " blocks of " + snap.block_size + " tokens" +
      (grid.length < snap.num_blocks ? " (first " + grid.length + " shown)" : "");
  }

  // Data parallel: one pool per engine core, each with its own block ids.
  function renderCores(snap) {
    var box = $("grid"), views = state.cores;
    if (views.length !== snap.cores.length) {
      box.textContent = "";
      box.className = "cores";
      state.cells = []; state.grid = "";
      views = state.cores = snap.cores.map(function () {
        var wrap = el("div", "core"), head = el("h3"), g = el("div", "grid");
        wrap.appendChild(head);
        wrap.appendChild(g);
        box.appendChild(wrap);
        return { head: head, g: g, cells: [], grid: "" };
      });
    }
    snap.cores.forEach(function (c, i) {
      var v = views[i], pc = c.prefix_cache;
      v.cells = paint(v.g, c.grid, v.cells, v.grid, c.engine);
      v.grid = c.grid;
      v.head.textContent = "core " + c.engine + " · " + c.num_blocks + " blocks · KV " +
        pct(c.in_use / c.num_blocks) + " · prefix hits " + (pc.enabled ? pct(pc.hit_rate) : "off") +
        " · " + c.num_running + " running, " + c.num_waiting + " waiting";
    });
    state.owners = null;
    $("pool-note").textContent = snap.cores.length + " engine cores, " + snap.num_blocks +
      " blocks of " + snap.block_size + " tokens in all";
  }

  function cellsOf(engine) {
    return engine != null && state.cores[engine] ? state.cores[engine].cells : state.cells;
  }

  function owners() {
    if (state.owners) return state.owners;
    var map = {};
    (state.snap ? state.snap.running : []).forEach(function (r) {
      var at = r.engine != null ? r.engine + ":" : "";
      (r.blocks || []).forEach(function (b) { (map[at + b] = map[at + b] || []).push(r.id); });
    });
    state.owners = map;
    return map;
  }

  function showTip(ev) {
    var tip = $("tip"), t = ev.target;
    if (!t.dataset || t.dataset.block == null || !state.snap) { tip.hidden = true; return; }
    var b = +t.dataset.block, st = t.dataset.state, core = t.dataset.engine;
    var text = (core != null ? "core " + core + ", " : "") + "block " + b + ": ";
    if (st === "free") text += "free";
    else if (st === "cached") text += "free, cached (a prefix hit revives it; evicted when reused)";
    else {
      var who = owners()[(core != null ? core + ":" : "") + b] || [];
      text += "ref count " + t.dataset.ref + (who.length ? " · " + who.join(", ") : "");
    }
    tip.textContent = text;
    tip.hidden = false;
    tip.style.left = (ev.clientX + 12) + "px";
    tip.style.top = (ev.clientY + 12) + "px";
  }

  function highlight(blocks, engine) {
    state.highlighted.forEach(function (e) { e.classList.remove("hl"); });
    var cells = cellsOf(engine);
    state.highlighted = (blocks || []).map(function (b) { return cells[b]; }).filter(Boolean);
    state.highlighted.forEach(function (e) { e.classList.add("hl"); });
  }

  function requestId(r) { return (r.engine != null ? "core " + r.engine + " · " : "") + r.id; }

  // ------------------------------------------------------------------ requests

  function bar(r) {
    var b = el("div", "bar"), p = el("i"), total = r.prompt_tokens + Math.max(1, r.max_tokens || 1);
    p.style.width = (100 * Math.min(r.computed, r.prompt_tokens) / total) + "%";
    b.appendChild(p);
    if (r.output_tokens) {
      var o = el("i", "out");
      o.style.left = p.style.width;
      o.style.width = (100 * r.output_tokens / total) + "%";
      b.appendChild(o);
    }
    b.title = r.computed + " of " + r.prompt_tokens + " prompt tokens computed, " +
      r.output_tokens + " of " + num(r.max_tokens) + " generated";
    return b;
  }

  function blockList(blocks) {
    if (!blocks) return "";
    var shown = blocks.slice(0, 24).join(" ");
    return "[" + shown + (blocks.length > 24 ? " … +" + (blocks.length - 24) : "") + "]";
  }

  function renderRunning(snap) {
    var body = $("running");
    body.textContent = "";
    snap.running.forEach(function (r) {
      var tr = el("tr");
      tr.dataset.request = r.id;
      var id = el("td", "id", requestId(r));
      id.title = r.id;
      tr.appendChild(id);
      var ph = el("td");
      ph.appendChild(el("span", "phase " + r.phase,
        r.phase === "prefill" ? "prefill " + r.computed + "/" + r.prompt_tokens : "decode"));
      tr.appendChild(ph);
      var pr = el("td");
      pr.appendChild(bar(r));
      if (r.prompt != null) pr.appendChild(el("div", "prompt", r.prompt));
      tr.appendChild(pr);
      tr.appendChild(el("td", null, r.prompt_tokens + " + " + r.output_tokens + "/" + num(r.max_tokens)));
      tr.appendChild(el("td", null, r.cached_tokens ? r.cached_tokens + " tok" : "–"));
      tr.appendChild(el("td", null, r.preemptions ? "×" + r.preemptions : "–"));
      tr.appendChild(el("td", "blocks", blockList(r.blocks)));
      tr.addEventListener("mouseenter", function () { highlight(r.blocks, r.engine); });
      tr.addEventListener("mouseleave", function () { highlight([]); });
      body.appendChild(tr);
    });
    $("running-note").textContent = snap.running.length ? "" : "(none)";
  }

  function renderWaiting(snap) {
    var body = $("waiting");
    body.textContent = "";
    snap.waiting.forEach(function (r) {
      var tr = el("tr");
      tr.dataset.request = r.id;
      var id = el("td", "id", requestId(r));
      id.title = r.prompt != null ? r.prompt : r.id;
      tr.appendChild(id);
      tr.appendChild(el("td", null, r.status));
      tr.appendChild(el("td", null, String(r.prompt_tokens)));
      tr.appendChild(el("td", null, String(r.computed)));
      tr.appendChild(el("td", null, r.preemptions ? "×" + r.preemptions : "–"));
      body.appendChild(tr);
    });
    var more = snap.num_waiting - snap.waiting.length;
    $("waiting-note").textContent = snap.num_waiting ? (more > 0 ? "(+" + more + " more)" : "") : "(none)";
  }

  // ------------------------------------------------------------------ events

  function eventText(e) {
    var where = e.engine != null ? "  core " + e.engine + ":" : "";
    if (e.kind === "preempt") {
      return clock(e.t) + where + "  preempted " + e.count + (e.ids && e.ids.length ? " (" + e.ids.join(", ") + ")" : "") +
        ": blocks freed, recomputed later";
    }
    return clock(e.t) + where + "  evicted " + e.count + " cached block" + (e.count > 1 ? "s" : "") + " for reuse";
  }

  function renderEvents(events) {
    var list = $("events");
    list.textContent = "";
    events.slice(-100).reverse().forEach(function (e) { list.appendChild(el("li", e.kind, eventText(e))); });
    if (!events.length) list.appendChild(el("li", "muted", "none yet"));
  }

  // ------------------------------------------------------------------ the picture

  function render(snap) {
    if (!snap) return;
    state.snap = snap;
    if (snap.cores) renderCores(snap); else renderGrid(snap);
    renderRunning(snap);
    renderWaiting(snap);
    var n = snap.num_blocks;
    $("c-kv").textContent = pct(snap.in_use / n);
    $("c-used").textContent = String(snap.in_use);
    $("c-free").textContent = String(snap.free);
    $("c-evictable").textContent = String(snap.evictable);
    $("c-shared").textContent = String(snap.shared);
    var pc = snap.prefix_cache;
    $("c-hit").textContent = pc.enabled ? pct(pc.hit_rate) : "off";
    $("c-hit").title = pc.hits + " of " + pc.queries + " prompt tokens";
    $("c-running").textContent = String(snap.running.length);
    $("c-waiting").textContent = String(snap.num_waiting);
    $("c-preempt").textContent = String(snap.preemptions);
    $("c-evict").textContent = String(snap.evictions);
    $("c-cost").textContent = snap.cost_us != null ? snap.cost_us + " µs" : "–";
    state.snapshots += 1;
    document.body.dataset.snapshots = String(state.snapshots);
  }

  // ------------------------------------------------------------------ charts (uPlot)

  var CHARTS = [
    { title: "tokens / s", series: [["generated", "tok_s", "#2f7d5b"], ["prompt", "prompt_s", "#7a4fb5"]] },
    { title: "batch size", series: [["running", "batch", "#2f7d5b"], ["waiting", "waiting", "#c2571a"]] },
    { title: "KV cache in use (%)", series: [["KV %", "kv", "#3a6ea5"]] },
    { title: "time to first token (ms)", series: [["TTFT", "ttft", "#7a4fb5", true]] },
    { title: "inter-token latency (ms)", series: [["ITL", "itl", "#c2571a", true]] },
    { title: "step time (ms)", series: [["step", "step_ms", "#59616b"]] },
    { title: "speculative drafts accepted (%)", series: [["accepted", "spec_accept", "#3a6ea5", true]] },
  ];

  function chartData(points, spec) {
    var xs = [], cols = spec.series.map(function () { return []; });
    points.forEach(function (p) {
      xs.push(p.t);
      spec.series.forEach(function (s, i) { cols[i].push(p.gap ? null : (p[s[1]] == null ? null : p[s[1]])); });
    });
    return [xs].concat(cols);
  }

  function buildCharts() {
    var box = $("charts");
    if (typeof uPlot === "undefined" || state.charts.length) return;
    var width = Math.max(200, Math.floor((box.clientWidth - 12) / 2));
    CHARTS.forEach(function (spec) {
      var wrap = el("div", "chart");
      var h = el("h3", null, spec.title + " ");
      if (spec.series.length > 1) {
        spec.series.forEach(function (s) {
          var key = el("span", "key", "● " + s[0] + " ");
          key.style.color = s[2];
          h.appendChild(key);
        });
      }
      wrap.appendChild(h);
      box.appendChild(wrap);
      var opts = {
        width: width, height: 130, legend: { show: false },
        scales: { x: { time: state.config.mode === "live" } },
        axes: [{ size: 28, font: "10px system-ui" }, { size: 54, font: "10px system-ui" }],
        series: [{}].concat(spec.series.map(function (s) {
          // A TTFT or ITL is not measured in every bucket: join those; an idle gap stays open.
          return { label: s[0], stroke: s[2], width: 1.5, spanGaps: !!s[3] };
        })),
      };
      state.charts.push({ spec: spec, plot: new uPlot(opts, chartData([], spec), wrap) });
    });
    window.addEventListener("resize", function () {
      var w = Math.max(200, Math.floor(($("charts").clientWidth - 12) / 2));
      state.charts.forEach(function (c) { c.plot.setSize({ width: w, height: 130 }); });
    });
  }

  function drawCharts(points) {
    state.charts.forEach(function (c) { c.plot.setData(chartData(points, c.spec)); });
  }

  // ------------------------------------------------------------------ live

  function live() {
    var status = $("status");
    var source = new EventSource("dashboard/events");
    source.addEventListener("init", function (m) {
      var msg = JSON.parse(m.data);
      state.config = msg.config;
      $("model").textContent = msg.config.model || "";
      buildCharts();
      state.series = msg.history;
      state.events = msg.events;
      drawCharts(state.series);
      renderEvents(state.events);
      render(msg.snapshot);
      status.dataset.state = "live";
      status.textContent = "live";
    });
    source.addEventListener("snapshot", function (m) {
      var msg = JSON.parse(m.data);
      render(msg.snapshot);
      if (msg.events.length) {
        state.events = state.events.concat(msg.events).slice(-200);
        renderEvents(state.events);
      }
    });
    source.addEventListener("points", function (m) {
      var msg = JSON.parse(m.data);
      state.series = state.series.concat(msg.points).slice(-600);
      drawCharts(state.series);
    });
    source.onerror = function () {
      status.dataset.state = "error";
      status.textContent = "disconnected (retrying)";
    };
  }

  // ------------------------------------------------------------------ replay

  function inflate(b64) {
    var bytes = Uint8Array.from(atob(b64), function (c) { return c.charCodeAt(0); });
    var stream = new Blob([bytes]).stream().pipeThrough(new DecompressionStream("gzip"));
    return new Response(stream).json();
  }

  function replay(recording) {
    state.config = recording.config;
    $("model").textContent = recording.config.title || "";
    var status = $("status");
    status.dataset.state = "replay";
    status.textContent = "replay";
    $("replay-bar").hidden = false;
    document.querySelector("h1 .sub").textContent = "simulation replay";
    buildCharts();
    var select = $("replay-run"), slider = $("replay-slider"), play = $("replay-play");
    recording.runs.forEach(function (run, i) { select.appendChild(el("option", null, run.name)).value = i; });
    var run = null, timer = null;

    function show(i) {
      var f = run.frames[i];
      slider.value = i;
      $("replay-frame").textContent = "frame " + (i + 1) + "/" + run.frames.length + " · t = " + f.t.toFixed(2) + " s";
      render(f);
      drawCharts(run.series.filter(function (p) { return p.t <= f.t; }));
      renderEvents(run.events.filter(function (e) { return e.t <= f.t; }));
    }
    function stop() { if (timer) { clearInterval(timer); timer = null; } play.textContent = "▶ play"; }
    function pick(i) {
      stop();
      run = recording.runs[i];
      state.cells = []; state.grid = "";
      slider.max = run.frames.length - 1;
      show(0);
    }
    select.addEventListener("change", function () { pick(+select.value); });
    slider.addEventListener("input", function () { stop(); show(+slider.value); });
    play.addEventListener("click", function () {
      if (timer) { stop(); return; }
      if (+slider.value >= run.frames.length - 1) show(0);
      play.textContent = "❚❚ pause";
      timer = setInterval(function () {
        var i = +slider.value + 1;
        if (i >= run.frames.length) { stop(); return; }
        show(i);
      }, 120);
    });
    pick(0);
  }

  // ------------------------------------------------------------------ start

  $("grid").addEventListener("mouseover", showTip);
  $("grid").addEventListener("mousemove", showTip);
  $("grid").addEventListener("mouseleave", function () { $("tip").hidden = true; });
  var embedded = document.getElementById("pagemill-replay");
  if (embedded) {
    inflate(embedded.textContent.trim()).then(replay, function (err) {
      $("status").dataset.state = "error";
      $("status").textContent = "cannot read the recording: " + err;
    });
  } else {
    live();
  }
})();
