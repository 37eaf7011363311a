// poollab interactive report: timelines (Plotly) and the segment view (canvas), offline.
// Data: the JSON in <script id="poollab-data">, one entry per trace (sim/report/interactive/page.py says what).
// Public API for tests and users: window.poollab.{setRange (a promise), showTime, segmentState, range, levels}.
(function () {
  "use strict";
  const DATA = JSON.parse(document.getElementById("poollab-data").textContent);
  const COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf",
                  "#7f7f7f", "#bcbd22"];
  const MiB = 1048576;
  const fmtBytes = (b) => (b == null || isNaN(b)) ? "–" : (b / MiB).toLocaleString(undefined,
    {maximumFractionDigits: 2}) + " MiB";
  const state = DATA.map(() => ({range: null, sample: 0, runs: {}}));

  // Min and max of every bucket of [x0, x1] (in time order, so a line through them keeps every
  // peak and every trough): what a pixel column can show, never dropping the maximum. lo/hi: each
  // row's minimum and maximum (a zoom level's buckets), or the same array twice (plain rows).
  function bucketMinMax(t, lo, hi, x0, x1, numBuckets) {
    const xs = [], ys = [];
    let a0 = 0, a1 = t.length;
    while (a0 < a1) { const m = (a0 + a1) >> 1; if (t[m] < x0) a0 = m + 1; else a1 = m; }
    const start = Math.max(0, a0 - 1);
    const width = (x1 - x0) / numBuckets || 1;
    let b = -1, iMin = -1, iMax = -1;
    const flush = () => {
      if (iMin < 0) return;
      if (iMin === iMax) { xs.push(t[iMin]); ys.push(lo[iMin]); if (hi[iMax] !== lo[iMin]) { xs.push(t[iMax]); ys.push(hi[iMax]); } return; }
      if (iMin < iMax) { xs.push(t[iMin], t[iMax]); ys.push(lo[iMin], hi[iMax]); }
      else { xs.push(t[iMax], t[iMin]); ys.push(hi[iMax], lo[iMin]); }
    };
    for (let i = start; i < t.length; i++) {
      if (lo[i] == null || hi[i] == null || Number.isNaN(lo[i])) continue;
      const k = t[i] < x0 ? -1 : Math.floor((t[i] - x0) / width);
      if (k !== b) { flush(); b = k; iMin = iMax = i; }
      else { if (lo[i] < lo[iMin]) iMin = i; if (hi[i] > hi[iMax]) iMax = i; }
      if (t[i] > x1) break;
    }
    flush();
    return [xs, ys];
  }

  // --- zoom detail (sim/report/interactive/detail.py): levels of min/max buckets in gzip'd chunks of
  // byte-shuffled columns (level.columns: [name, "i8d" | "f8" | "f4"]); a chunk is decoded the
  // first time a shown range needs it, then kept.
  const WIDTH = {i8d: 8, f8: 8, f4: 4};

  function decodeChunk(level, chunk) {
    if (!chunk.decoded) chunk.decoded = (async () => {
      const text = atob(chunk.data), packed = new Uint8Array(text.length);
      for (let k = 0; k < text.length; k++) packed[k] = text.charCodeAt(k);
      const stream = new Blob([packed]).stream().pipeThrough(new DecompressionStream("gzip"));
      const raw = new Uint8Array(await new Response(stream).arrayBuffer());
      const n = chunk.n, cols = {};
      let at = 0;
      for (const [name, kind] of level.columns) {
        const w = WIDTH[kind], bytes = new Uint8Array(n * w);
        for (let j = 0; j < w; j++) {
          const base = at + j * n;
          for (let v = 0; v < n; v++) bytes[v * w + j] = raw[base + v];
        }
        at += n * w;
        if (kind === "i8d") {  // differences, back to running values (exact below 2**53)
          const diffs = new BigInt64Array(bytes.buffer), out = new Float64Array(n);
          let sum = 0;
          for (let v = 0; v < n; v++) { sum += Number(diffs[v]); out[v] = sum; }
          cols[name] = out;
        } else cols[name] = kind === "f8" ? new Float64Array(bytes.buffer) : new Float32Array(bytes.buffer);
      }
      cols.t = cols.t_us.map((v) => v / 1e6);
      return cols;
    })();
    return chunk.decoded;
  }

  function countIn(t, x0, x1) {
    let a = 0, b = t.length, c = 0, d = t.length;
    while (a < b) { const m = (a + b) >> 1; if (t[m] < x0) a = m + 1; else b = m; }
    while (c < d) { const m = (c + d) >> 1; if (t[m] <= x1) c = m + 1; else d = m; }
    return c - a;
  }

  // The run's series for [x0, x1] at numBuckets pixel buckets: the overview when the run has no zoom
  // levels (it then holds every row), else the coarsest level with a bucket per pixel column there
  // (or the finest there is; the overview's bucket maxima would lose the troughs), only the chunks
  // the range needs (and one either side, so the line runs on past the edges).
  async function seriesFor(run, x0, x1, numBuckets) {
    const overview = {level: "overview", buckets: run.t.length, t: run.t};
    METRICS.forEach(([m]) => { overview[m + "Min"] = run[m]; overview[m + "Max"] = run[m]; });
    const inOverview = countIn(run.t, x0, x1);
    if (!run.detail.length) return overview;
    const share = Math.max(inOverview, 1) / run.t.length;  // of the rows, from the overview's buckets
    const level = run.detail.find((l) => l.buckets * share >= numBuckets) || run.detail[run.detail.length - 1];
    const chunks = level.chunks;
    let first = chunks.findIndex((c) => c.t1 >= x0);
    if (first < 0) first = chunks.length - 1;
    let last = first;
    while (last + 1 < chunks.length && chunks[last + 1].t0 <= x1) last++;
    const parts = await Promise.all(chunks.slice(Math.max(0, first - 1), last + 2).map((c) => decodeChunk(level, c)));
    const out = {level: run.detail.indexOf(level), buckets: level.buckets};
    for (const key of Object.keys(parts[0])) {
      const joined = new parts[0][key].constructor(parts.reduce((n, p) => n + p[key].length, 0));
      let at = 0;
      parts.forEach((p) => { joined.set(p[key], at); at += p[key].length; });
      out[key] = joined;
    }
    return out;
  }

  const METRICS = [["reserved", "reserved (MiB)", MiB, "y"], ["live", "live (MiB)", MiB, "y2"],
                   ["frag", "external fragmentation", 1, "y3"]];

  async function timelineTraces(i, x0, x1) {
    const d = DATA[i], out = [], width = document.getElementById("tl-" + i).clientWidth || 1000;
    const numBuckets = Math.max(100, Math.floor(width / 2));
    const series = await Promise.all(d.runs.map((run) => seriesFor(run, x0, x1, numBuckets)));
    state[i].levels = {};
    d.runs.forEach((run, r) => {
      const s = series[r];
      state[i].levels[run.label] = {level: s.level, buckets: s.buckets};
      METRICS.forEach(([key, name, scale, axis]) => {
        const [xs, ys] = bucketMinMax(s.t, s[key + "Min"], s[key + "Max"], x0, x1, numBuckets);
        out.push({x: xs, y: ys.map((v) => v / scale), name: run.label, legendgroup: run.label,
                  showlegend: key === "reserved", yaxis: axis, type: "scatter", mode: "lines",
                  line: {color: COLORS[r % COLORS.length], width: 1.4},
                  hovertemplate: run.label + " " + name + ": %{y:,.2f}<extra></extra>"});
      });
    });
    const fails = d.failures;
    if (fails.length) {
      out.push({x: fails.map((f) => f.t), y: fails.map((f) => f.request_bytes / MiB), yaxis: "y",
                type: "scatter", mode: "markers", name: "refused request (click)", marker: {color: "#d62728",
                symbol: "x", size: 10}, customdata: fails.map((_, k) => k),
                hovertemplate: "%{text}<extra></extra>", text: fails.map((f) => f.run + ": refused " +
                fmtBytes(f.request_bytes) + ", largest free " + fmtBytes(f.largest_free_bytes))});
    }
    const comps = d.compactions;
    if (comps.length) {
      out.push({x: comps.map((c) => c.t), y: comps.map(() => 0), yaxis: "y", type: "scatter", mode: "markers",
                name: "compaction", marker: {color: "#2ca02c", symbol: "triangle-up", size: 9},
                hovertemplate: "%{text}<extra></extra>", text: comps.map((c) => c.run + ": " + c.num_compactions +
                " compaction pass(es) by " +
                (c.step == null ? "event " + c.event.toLocaleString() : "step " + c.step.toLocaleString()) +
                (c.num_moves == null ? "" : ", " + c.num_moves.toLocaleString() + " moves") + ", " +
                fmtBytes(c.moved_bytes) + " moved" + (c.released_bytes == null ? "" : ", " +
                fmtBytes(c.released_bytes) + " released"))});
    }
    return out;
  }

  // Compactions drawn as full-height lines too when there are at most this many (else markers only).
  const MAX_COMPACTION_LINES = 40;

  function timelineLayout(i) {
    const d = DATA[i], shapes = [];
    const vline = (t, color, dash) => ({type: "line", xref: "x", yref: "paper", x0: t, x1: t, y0: 0, y1: 1,
                                         line: {color, width: 1, dash}});
    if (d.first_failure != null) shapes.push(vline(d.first_failure, "#d62728", "dash"));
    d.preemptions.forEach((t) => shapes.push(vline(t, "#ff7f0e", "dot")));
    if (d.compactions.length <= MAX_COMPACTION_LINES) d.compactions.forEach((c) => shapes.push(vline(c.t, "#2ca02c", "dot")));
    const axis = (title, domain) => ({title: {text: title}, domain, rangemode: "tozero", fixedrange: true});
    const span = {showspikes: true, spikemode: "across", spikesnap: "cursor", spikethickness: 1, spikedash: "solid"};
    return {height: 620, margin: {l: 70, r: 20, t: 30, b: 40}, hovermode: "x unified", shapes,
            xaxis: Object.assign({title: {text: "time (s)"}, anchor: "y3"}, span),
            yaxis: axis("reserved (MiB)", [0.68, 1]), yaxis2: axis("live (MiB)", [0.35, 0.64]),
            yaxis3: axis("ext. fragmentation", [0, 0.31]), legend: {orientation: "h", y: 1.08},
            dragmode: "zoom"};
  }

  function fullRange(i) { return [DATA[i].t_min, DATA[i].t_max]; }

  // Resolves once the timeline shows [x0, x1] (its detail decoded); a later call supersedes it.
  async function setRange(i, x0, x1) {
    const [a, b] = fullRange(i);
    x0 = Math.max(a, x0); x1 = Math.min(b, x1);
    if (!(x1 > x0)) { x0 = a; x1 = b; }
    state[i].range = [x0, x1];
    document.getElementById("from-" + i).value = x0.toPrecision(6);
    document.getElementById("to-" + i).value = x1.toPrecision(6);
    restrictSlider(i);
    const el = document.getElementById("tl-" + i);
    const lay = timelineLayout(i);
    lay.xaxis.range = [x0, x1];
    lay.xaxis.autorange = false;
    const seq = state[i].seq = (state[i].seq || 0) + 1;
    const traces = await timelineTraces(i, x0, x1);
    if (seq !== state[i].seq) return;  // the range moved on while the detail was decoded
    el.__poollabBusy = true;
    await Plotly.react(el, traces, lay, {displaylogo: false, responsive: true});
    el.__poollabBusy = false;
  }

  // --- the segment view ---
  function samplesOf(i) { return DATA[i].layouts.length ? DATA[i].layouts[0].samples : []; }

  function restrictSlider(i) {
    const slider = document.getElementById("slider-" + i);
    if (!slider) return;
    const [x0, x1] = state[i].range || fullRange(i);
    const ss = samplesOf(i);
    let lo = ss.findIndex((s) => s.t >= x0);
    if (lo < 0) lo = ss.length - 1;
    let hi = ss.length - 1;
    while (hi > lo && ss[hi].t > x1) hi--;
    slider.min = lo; slider.max = hi;
    const v = Math.min(hi, Math.max(lo, state[i].sample));
    slider.value = v;
    drawSample(i, v);
  }

  function nearestAtOrBefore(samples, t) {
    let best = 0;
    for (let k = 0; k < samples.length; k++) { if (samples[k].t <= t + 1e-12) best = k; else break; }
    return best;
  }

  // totals of the whole layout (page.py embeds them: only the drawn lanes' segments and holes are embedded)
  function summarise(sample) {
    const [n, reserved, free, largest, numFree] = sample.sum;
    return {event: sample.event, time_s: sample.t, num_segments: n, reserved_bytes: reserved,
            free_bytes: free, largest_free_bytes: largest, num_free_blocks: numFree, live_bytes: reserved - free};
  }

  function drawLayout(canvas, sample, maxSegBytes, recorded, highlightBytes) {
    const lane = 7, gap = 2;
    const segs = sample.segs;
    const width = canvas.clientWidth || 560;
    canvas.width = width;
    canvas.height = Math.max(1, segs.length) * (lane + gap);
    const ctx = canvas.getContext("2d");
    ctx.clearRect(0, 0, canvas.width, canvas.height);
    const px = width / maxSegBytes;
    const largest = sample.sum[3];
    // free holes by segment: extents sorted by address, segments too
    const holes = sample.free.slice().sort((a, b) => a[0] - b[0]);
    let h = 0;
    segs.forEach((g, k) => {
      const y = k * (lane + gap);
      ctx.fillStyle = recorded ? "#6b7c8f" : "#3b6ea8";
      ctx.fillRect(0, y, Math.max(1, g[1] * px), lane);
      while (h < holes.length && holes[h][0] < g[0]) h++;
      for (let j = h; j < holes.length && holes[j][0] < g[0] + g[1]; j++) {
        const [o, l] = holes[j];
        const isLargest = l === largest;
        ctx.fillStyle = "#ffffff";
        ctx.fillRect((o - g[0]) * px, y, Math.max(1, l * px), lane);
        if (isLargest || (highlightBytes != null && l >= highlightBytes)) {
          ctx.strokeStyle = "#d62728"; ctx.lineWidth = 1;
          ctx.strokeRect((o - g[0]) * px + 0.5, y + 0.5, Math.max(1, l * px) - 1, lane - 1);
        }
      }
    });
    canvas.dataset.lanesHidden = sample.sum[0] - segs.length;
  }

  function drawSample(i, k, failure) {
    const d = DATA[i], ss = samplesOf(i);
    if (!ss.length) return;
    k = Math.max(0, Math.min(ss.length - 1, +k));
    state[i].sample = k;
    const t = failure ? failure.t : ss[k].t;
    document.getElementById("segtime-" + i).textContent = "t = " + t.toPrecision(6) + " s (event " +
      (failure ? failure.event : ss[k].event).toLocaleString() + ")";
    d.layouts.forEach((run, r) => {
      let sample;
      if (failure && failure.run === run.label) sample = failure.layout;
      else sample = run.samples[nearestAtOrBefore(run.samples, t)];
      const s = summarise(sample);
      state[i].runs[run.label] = s;
      const canvas = document.getElementById("segcanvas-" + i + "-" + r);
      drawLayout(canvas, sample, d.max_segment_bytes, run.recorded, failure ? failure.request_bytes : null);
      const hidden = +canvas.dataset.lanesHidden;
      let detail;
      if (!run.blocks) detail = " (blocks not recorded)";
      else if (run.recorded) detail = ", live blocks " + fmtBytes(s.live_bytes) + " (bytes asked), gaps " +
        fmtBytes(s.free_bytes) + " in " + s.num_free_blocks + " (free or rounding), largest " +
        fmtBytes(s.largest_free_bytes);
      else detail = ", free " + fmtBytes(s.free_bytes) + " in " + s.num_free_blocks + " holes, largest " +
        fmtBytes(s.largest_free_bytes);
      document.getElementById("seginfo-" + i + "-" + r).textContent = s.num_segments + " segments, reserved " +
        fmtBytes(s.reserved_bytes) + detail + (hidden ? ` (${hidden} more segments not drawn)` : "");
    });
  }

  function showFailure(i, k) {
    const f = DATA[i].failures[k];
    const s = summarise(f.layout);
    const top = f.layout.free.map((g) => g[1]).sort((a, b) => b - a).slice(0, 8).map(fmtBytes).join(", ");
    document.getElementById("fail-" + i).innerHTML = "";
    const p = document.createElement("p");
    p.className = "failure";
    p.textContent = `${f.run}: at t = ${f.t.toPrecision(6)} s (event ${f.event.toLocaleString()}) a request of ` +
      `${fmtBytes(f.request_bytes)} was refused. Free in the pool: ${fmtBytes(s.free_bytes)} in ` +
      `${s.num_free_blocks} blocks; largest free ${fmtBytes(s.largest_free_bytes)} ` +
      `(${(100 * s.largest_free_bytes / f.request_bytes).toFixed(1)}% of the size asked). Largest blocks: ${top || "none"}.`;
    document.getElementById("fail-" + i).appendChild(p);
    drawSample(i, nearestAtOrBefore(samplesOf(i), f.t), f);
  }

  function showTime(i, t) {
    const ss = samplesOf(i), k = nearestAtOrBefore(ss, t);
    const slider = document.getElementById("slider-" + i);
    if (slider) slider.value = k;
    drawSample(i, k);
    return state[i].runs;
  }

  async function initTrace(i) {
    const el = document.getElementById("tl-" + i);
    const [a, b] = fullRange(i);
    await setRange(i, a, b);  // Plotly gives the element its .on once drawn
    el.on("plotly_relayout", (ev) => {
      if (el.__poollabBusy) return;
      if (ev["xaxis.range[0]"] != null) setRange(i, +ev["xaxis.range[0]"], +ev["xaxis.range[1]"]);
      else if (ev["xaxis.autorange"]) setRange(i, a, b);
    });
    el.on("plotly_click", (ev) => {
      const pt = ev.points && ev.points[0];
      if (!pt) return;
      if (pt.customdata != null && pt.data.name.startsWith("refused")) showFailure(i, pt.customdata);
      else showTime(i, pt.x);
    });
    document.getElementById("apply-" + i).addEventListener("click", () =>
      setRange(i, +document.getElementById("from-" + i).value, +document.getElementById("to-" + i).value));
    document.getElementById("reset-" + i).addEventListener("click", () => setRange(i, a, b));
    const slider = document.getElementById("slider-" + i);
    if (!slider) return;
    slider.addEventListener("input", () => drawSample(i, slider.value));
    const play = document.getElementById("play-" + i);
    let timer = null;
    play.addEventListener("click", () => {
      if (timer) { clearInterval(timer); timer = null; play.textContent = "▶ play"; return; }
      play.textContent = "❚❚ pause";
      timer = setInterval(() => {
        let v = +slider.value + 1;
        if (v > +slider.max) v = +slider.min;
        slider.value = v; drawSample(i, v);
      }, 120);
    });
    const firstFail = DATA[i].failures.length ? 0 : -1;
    const button = document.getElementById("firstfail-" + i);
    if (button && firstFail >= 0) button.addEventListener("click", () => showFailure(i, firstFail));
  }

  // --- sortable tables: click a header to sort by it (again: the other way) ---
  function sortable(table) {
    table.querySelectorAll("thead th").forEach((th, col) => {
      th.style.cursor = "pointer";
      th.title = "click to sort";
      th.addEventListener("click", () => {
        const body = table.tBodies[0], rows = Array.from(body.rows);
        const dir = th.dataset.sort === "asc" ? -1 : 1;
        table.querySelectorAll("thead th").forEach((h) => delete h.dataset.sort);
        th.dataset.sort = dir === 1 ? "asc" : "desc";
        const key = (r) => {
          const s = r.cells[col] ? r.cells[col].textContent.trim() : "";
          const n = parseFloat(s.replace(/,/g, ""));
          return isNaN(n) ? s : n;
        };
        rows.sort((x, y) => {
          const a = key(x), b = key(y);
          if (typeof a === "number" && typeof b === "number") return dir * (a - b);
          return dir * String(a).localeCompare(String(b));
        });
        rows.forEach((r) => body.appendChild(r));
      });
    });
  }

  window.poollab = {
    setRange, showTime, showFailure,
    range: (i) => state[i].range,
    // per run: the zoom level drawn ("overview" or an index into its detail levels) and its buckets
    levels: (i) => state[i].levels,
    segmentState: (i) => state[i].runs,
    ready: false,
  };
  document.querySelectorAll("table.tbl").forEach(sortable);
  Promise.all(DATA.map((_, i) => initTrace(i))).then(() => { window.poollab.ready = true; });
})();
