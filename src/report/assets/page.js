// memfl report page: renders window.MEMFL_DATA (report or comparison).
(function () {
  'use strict';
  var D = window.MEMFL_DATA, app = document.getElementById('app');
  var charts = 0, flames = 0;
  var MiB = function (b) { return (b / 1048576).toFixed(1); };
  function el(tag, attrs, text) {
    var e = document.createElement(tag);
    for (var k in (attrs || {})) e.setAttribute(k, attrs[k]);
    if (text !== undefined) e.textContent = text;
    return e;
  }
  function section(title) { app.appendChild(el('h2', {}, title)); var d = el('div'); app.appendChild(d); return d; }
  function table(parent, head, rows, left) {
    var t = el('table'), tr = el('tr');
    head.forEach(function (h, i) { tr.appendChild(el('th', { class: (left || [0]).indexOf(i) >= 0 ? 'l' : '' }, h)); });
    t.appendChild(tr);
    rows.forEach(function (r) {
      var tr2 = el('tr');
      r.forEach(function (c, i) {
        var td = el('td', { class: (left || [0]).indexOf(i) >= 0 ? 'l' : '' });
        if (c && c.cls) { td.textContent = c.text; td.className += ' ' + c.cls; } else td.textContent = c;
        tr2.appendChild(td);
      });
      t.appendChild(tr2);
    });
    parent.appendChild(t);
  }
  var COLORS = ['#1f77b4', '#d62728', '#2ca02c', '#9467bd', '#ff7f0e', '#8c564b', '#17becf', '#e377c2'];
  var BANDS = { broadcast: 'rgba(31,119,180,.10)', train: 'rgba(44,160,44,.10)', upload: 'rgba(255,127,14,.12)',
                aggregate: 'rgba(214,39,40,.12)', evaluate: 'rgba(148,103,189,.10)', checkpoint: 'rgba(140,86,75,.10)' };

  // One timeline chart: RSS (MiB) over seconds, phase bands, the peak marked.
  function timeline(parent, title, series, phases, peak) {
    var box = el('div', { class: 'chart' }); parent.appendChild(box);
    var xs = {}, names = [];
    series.forEach(function (s) { s.t.forEach(function (t) { xs[t] = 1; }); });
    var x = Object.keys(xs).map(Number).sort(function (a, b) { return a - b; });
    var data = [x.map(function (t) { return t / 1000; })];
    series.forEach(function (s) {
      var m = {}; s.t.forEach(function (t, i) { m[t] = s.v[i] / 1048576; });
      data.push(x.map(function (t) { return t in m ? m[t] : null; }));
      names.push(s.name);
    });
    var opts = {
      title: title, width: Math.min(1100, window.innerWidth - 60) || 900, height: 260,
      scales: { x: { time: false } }, axes: [{ label: 'seconds' }, { label: 'MiB' }],
      series: [{}].concat(names.map(function (n, i) { return { label: n, stroke: COLORS[i % COLORS.length], spanGaps: true, width: 1.5 }; })),
      hooks: { draw: [function (u) {
        var ctx = u.ctx; ctx.save();
        (phases || []).forEach(function (p) {
          var x0 = u.valToPos(p.start_ms / 1000, 'x', true), x1 = u.valToPos(p.end_ms / 1000, 'x', true);
          ctx.fillStyle = BANDS[p.phase] || 'rgba(0,0,0,.03)';
          ctx.fillRect(x0, u.bbox.top, Math.max(1, x1 - x0), u.bbox.height);
        });
        if (peak) {
          var px = u.valToPos(peak.t_ms / 1000, 'x', true), py = u.valToPos(peak.bytes / 1048576, 'y', true);
          ctx.fillStyle = '#b00020'; ctx.beginPath(); ctx.arc(px, py, 5, 0, 2 * Math.PI); ctx.fill();
          ctx.fillText('peak ' + MiB(peak.bytes) + ' MiB', px + 8, py - 6);
        }
        ctx.restore();
      }] }
    };
    new uPlot(opts, data, box);
    charts++;
  }

  // Accuracy and loss over rounds: one chart each, from the metrics rows
  // (the report's metrics.csv, or the live page's /api/state).
  function curves(parent, metrics, title) {
    var rows = (metrics || []).filter(function (m) { return m.round !== undefined && m.round !== ''; });
    if (!rows.length) { parent.appendChild(el('p', { class: 'note' }, 'No finished round yet.')); return; }
    var x = rows.map(function (m) { return +m.round; });
    var col = function (k) { return rows.map(function (m) { var v = m[k]; return v === null || v === '' || v === undefined || isNaN(+v) ? null : +v; }); };
    var w = Math.min(540, (window.innerWidth - 80) / 2) || 520;
    [['accuracy', ['train_accuracy', 'test_accuracy'], ['train accuracy', 'test accuracy']],
     ['loss', ['train_loss', 'test_loss'], ['train loss', 'test loss']]].forEach(function (c, k) {
      var box = el('div', { class: 'chart curve', 'data-curve': c[0] }); parent.appendChild(box);
      var data = [x].concat(c[1].map(col));
      new uPlot({ title: (title ? title + ': ' : '') + c[0] + ' per round', width: w, height: 220,
        scales: { x: { time: false } }, axes: [{ label: 'round' }, { label: c[0] }],
        series: [{}].concat(c[2].map(function (n, i) { return { label: n, stroke: COLORS[(2 * k + i) % COLORS.length], width: 1.5, spanGaps: true, points: { show: rows.length < 60 } }; })) },
        data, box);
      charts++;
    });
  }

  function flamegraph(parent, title, tree, differential) {
    if (!tree || !tree.value) { parent.appendChild(el('p', {}, title + ': no tracked allocations')); return; }
    parent.appendChild(el('h3', {}, title));
    var search = el('input', { class: 'search', placeholder: 'search frames…' });
    parent.appendChild(search);
    var box = el('div', { class: 'flame' }); parent.appendChild(box);
    var fg = flamegraph_lib().width(Math.min(1100, window.innerWidth - 60) || 900).cellHeight(16)
      .label(function (d) { return d.data.name + ' — ' + MiB(d.value) + ' MiB' + (d.data.delta !== undefined ? ' (' + (d.data.delta >= 0 ? '+' : '') + MiB(d.data.delta) + ' MiB)' : ''); });
    if (differential) {
      // Each node's data.delta is its own change; the library sums them up
      // the tree and colours red (grew) and blue (shrank).
      fg.computeDelta(true);
      if (window.flamegraph.colorMapper) fg.setColorMapper(window.flamegraph.colorMapper.differentialColorMapper);
    }
    d3.select(box).datum(tree).call(fg);
    search.addEventListener('input', function () { if (search.value) fg.search(search.value); else fg.clear(); });
    flames++;
  }
  function flamegraph_lib() { return (window.flamegraph && window.flamegraph.flamegraph) ? window.flamegraph.flamegraph() : window.flamegraph(); }

  function report(run) {
    var peaks = section('Peak memory per process');
    table(peaks, ['process', 'peak RSS MiB', 'anon MiB', 'file MiB', 'round', 'phase', '× model', 'baseline MiB', 'tracked peak MiB', 'small MiB', 'malloc-kept MiB', 'model', 'aggregation', 'gradients', 'optimizer', 'data'],
      run.processes.map(function (p) {
        var L = function (c) { return p.ledger[c] ? MiB(p.ledger[c].at_rss_peak_bytes) : '-'; };
        return [p.name, MiB(p.peak_rss_bytes), MiB(p.peak_rss_anon_bytes), MiB(p.peak_rss_file_bytes), p.peak_phase.round, p.peak_phase.phase,
          p.model_bytes ? (p.peak_rss_bytes / p.model_bytes).toFixed(2) : '-', MiB(p.baseline_rss_bytes),
          p.profile ? MiB(p.profile.peak_tracked_bytes) : '-', p.profile ? MiB(p.profile.small_at_peak_bytes) : '-',
          p.profile ? MiB(p.profile.malloc_free_retained_at_peak_bytes) : '-', L('model'), L('aggregation'), L('gradients'), L('optimizer'), L('data')];
      }), [0, 5]);
    peaks.appendChild(el('p', { class: 'note' }, 'The ledger columns are the bytes memfl\'s own code declared as held at the RSS peak ' +
      '(model arenas, the aggregator\'s running sum, data). Gradients and optimizer state are libtorch\'s: they are counted from a ' +
      'client\'s first training step to the end of its turn, so a peak outside training (or a process that does not train, such as a ' +
      'server) shows 0 for them. The rest of RSS is the allocator, libraries and code.'));
    var cv = section('Accuracy and loss per round');
    run.processes.forEach(function (p) { if (p.metrics.length) curves(cv, p.metrics, run.processes.length > 1 ? p.name : ''); });
    if (!run.processes.some(function (p) { return p.metrics.length; })) cv.appendChild(el('p', { class: 'note' }, 'No process wrote metrics rows.'));
    var tl = section('Memory timeline per process (RSS from the kernel; bands are phases; the dot is the peak)');
    run.processes.forEach(function (p) {
      var s = [{ name: p.name + ' RSS', t: p.samples.t_ms, v: p.samples.rss_bytes }];
      if (p.profile && p.profile.tracked_timeline.length) {
        s.push({ name: 'tracked allocations', t: p.profile.tracked_timeline.map(function (e) { return e[0]; }), v: p.profile.tracked_timeline.map(function (e) { return e[1]; }) });
      }
      if (p.gpu) {
        s.push({ name: 'GPU allocated', t: p.gpu.t_ms, v: p.gpu.allocated_bytes });
        s.push({ name: 'GPU reserved', t: p.gpu.t_ms, v: p.gpu.reserved_bytes });
      }
      timeline(tl, p.name, s, p.phases, { t_ms: p.peak_t_ms, bytes: p.peak_rss_bytes });
    });
    var fl = section('High-water-mark flamegraphs (allocations live at each process\'s tracked peak; click to zoom)');
    var any = false;
    run.processes.forEach(function (p) {
      if (!p.profile) return; any = true;
      flamegraph(fl, p.name + ': ' + MiB(p.profile.peak_tracked_bytes) + ' MiB live in round ' + p.profile.peak_round + ' ' + p.profile.peak_phase, p.profile.flame, false);
    });
    if (!any) fl.appendChild(el('p', {}, 'No allocation profile: run with --profile (or memory_configs.profile: true).'));
    var st = section('Top allocation sites');
    if (!any) st.appendChild(el('p', { class: 'note' }, 'No allocation sites: the run was not profiled. Sites come from the allocation tracker; run with --profile (or memory_configs.profile: true).'));
    run.processes.forEach(function (p) {
      if (!p.profile) return;
      st.appendChild(el('h3', {}, p.name));
      table(st, ['site', 'total MiB', 'count', 'live at peak MiB'], p.profile.top_sites.map(function (s) { return [s.site, MiB(s.total_bytes), s.count, MiB(s.at_peak_bytes)]; }));
    });
    var rm = section('Rounds');
    run.processes.forEach(function (p) {
      if (!p.metrics.length) return;
      rm.appendChild(el('h3', {}, p.name));
      table(rm, ['round', 'clients', 'train loss', 'test accuracy', 'MiB moved', 'seconds', 'peak RSS MiB'],
        p.metrics.map(function (m) { return [m.round, m.clients, (+m.train_loss).toFixed(4), (+m.test_accuracy).toFixed(4), MiB(m.bytes_moved), (+m.round_seconds).toFixed(2), MiB(m.peak_rss_bytes)]; }));
    });
    // A process run with --http left its live page as it ended: the report
    // shows what only that page has (clients, staleness) and links it.
    run.processes.forEach(function (p) {
      if (!p.live) return;
      live_clients(p.live, ' (' + p.name + ', as the live page ended)');
      var n = el('p', { class: 'note' }, 'The whole live page as it ended: ');
      n.appendChild(el('a', { href: p.live_page }, p.live_page)); app.lastChild.appendChild(n);
    });
    var cf = section('Resolved configuration');
    run.processes.forEach(function (p) { if (p.config) { cf.appendChild(el('h3', {}, p.name)); cf.appendChild(el('pre', {}, p.config)); } });
  }

  function compare(runs) {
    var base = runs[0], roles = base.processes.map(function (p) { return p.name; });
    var find = function (run, name) { return run.processes.filter(function (p) { return p.name === name; })[0]; };
    var pk = section('Peak RSS per role (change against ' + base.name + ')');
    var rows = [];
    roles.forEach(function (r) {
      var b = find(base, r).peak_rss_bytes;
      runs.forEach(function (run, k) {
        var p = find(run, r); if (!p) return;
        var d = p.peak_rss_bytes - b, pct = b ? 100 * d / b : 0;
        rows.push([r, run.name, MiB(p.peak_rss_bytes), k ? { text: (d >= 0 ? '+' : '') + MiB(d), cls: d > 0 ? 'grew' : 'shrank' } : '-',
          k ? { text: (pct >= 0 ? '+' : '') + pct.toFixed(1) + ' %', cls: d > 0 ? 'grew' : 'shrank' } : '-']);
      });
    });
    table(pk, ['role', 'run', 'peak RSS MiB', 'change MiB', 'change'], rows, [0, 1]);
    var tl = section('Timelines overlaid');
    roles.forEach(function (r) {
      var s = [];
      runs.forEach(function (run, k) { var p = find(run, r); if (p) s.push({ name: 'run ' + k + ': ' + r, t: p.samples.t_ms, v: p.samples.rss_bytes }); });
      timeline(tl, r, s, null, null);
    });
    var df = section('Differential flamegraphs (red grew, blue shrank, against the baseline)');
    var keys = Object.keys(D.diff_flames || {});
    if (!keys.length) df.appendChild(el('p', {}, 'Differential flamegraphs need both runs profiled (--profile).'));
    keys.forEach(function (k) { flamegraph(df, k, D.diff_flames[k], true); });
    var rt = section('Rounds side by side');
    var rrows = [];
    roles.forEach(function (r) {
      runs.forEach(function (run, k) {
        var p = find(run, r); if (!p || !p.metrics.length) return;
        var secs = p.metrics.reduce(function (a, m) { return a + (+m.round_seconds); }, 0) / p.metrics.length;
        rrows.push([r, 'run ' + k, p.metrics.length, secs.toFixed(2), (+p.metrics[p.metrics.length - 1].test_accuracy).toFixed(4)]);
      });
    });
    table(rt, ['role', 'run', 'rounds', 'mean round s', 'final accuracy'], rrows, [0, 1]);
  }

  // The clients table and, for an asynchronous run, the staleness
  // histogram: the live page's, and the report's for a run with --http.
  function live_clients(S, where) {
    var ct = section('Clients' + where);
    // Bytes on the wire, each client's own (compressed frames when
    // compressed). An asynchronous server counts uploads only.
    if (!S.clients.length) ct.appendChild(el('p', { class: 'note' }, 'No client seen yet.'));
    else table(ct, ['client', 'state', S.frozen_at ? 'last seen s before the end' : 'last seen s ago', 'last round', 'updates', 'MiB down', 'MiB up'],
      S.clients.map(function (c) { return [c.client, c.state, c.last_seen_seconds_ago.toFixed(1), c.last_round, c.updates, S.asynchronous ? '-' : MiB(c.bytes_down), MiB(c.bytes_up)]; }), [0, 1]);
    if (S.clients_not_listed) ct.appendChild(el('p', { class: 'note' }, S.clients_not_listed + ' more client events not listed (the table is bounded).'));
    clients = S.clients.length;
    if (S.asynchronous) {
      var sh = section('Staleness of applied updates (versions behind)' + where);
      if (!S.staleness.length) sh.appendChild(el('p', { class: 'note' }, 'No update applied yet.'));
      else table(sh, ['staleness', 'updates'], S.staleness.map(function (b) { return [b[0], b[1]]; }));
    }
  }
  // The live page: the endpoint's /api/state, polled; each answer redraws
  // the page with the report's own chart code.
  function live(S) {
    var state = S.running ? 'running' : 'finished';
    var head = el('p', { class: 'live-head' }, S.role + ' — ' + state + ' — ' + (S.asynchronous ? 'version ' : 'round ') + S.round +
      (S.planned ? ' of ' + S.planned : '') + ' — RSS ' + MiB(S.rss_bytes) + ' MiB (peak ' + MiB(S.peak_rss_bytes) + ' MiB' +
      (S.memory_bound_bytes ? ', bound ' + MiB(S.memory_bound_bytes) + ' MiB' : '') + ') — ' +
      (S.frozen_at ? 'as it ended, ' + S.frozen_at : 'updated ' + new Date().toLocaleTimeString()));
    app.appendChild(head);
    curves(section('Accuracy and loss per round'), S.metrics, '');
    var tl = section('Memory timeline (RSS, max per point, downsampled; bands are phases)');
    timeline(tl, S.role, [{ name: S.role + ' RSS', t: S.samples.t_ms, v: S.samples.rss_bytes }], S.phases, null);
    live_clients(S, '');
    var ld = section(S.frozen_at ? 'Memory ledger at the end (MiB)' : 'Memory ledger now (MiB)');
    var cats = Object.keys(S.ledger);
    table(ld, cats, [cats.map(function (c) { return MiB(S.ledger[c]); })], []);
    var rm = section('Rounds');
    table(rm, ['round', 'clients', 'train loss', 'test accuracy', 'test loss', 'MiB moved', 'seconds', 'peak RSS MiB'],
      S.metrics.slice().reverse().map(function (m) { return [m.round, m.clients, (+m.train_loss).toFixed(4), m.test_accuracy === null ? '-' : (+m.test_accuracy).toFixed(4), m.test_loss === null ? '-' : (+m.test_loss).toFixed(4), MiB(m.bytes_moved), (+m.round_seconds).toFixed(2), MiB(m.peak_rss_bytes)]; }));
  }
  var clients = 0, polls = 0;
  function show_status() {
    var status = document.getElementById('memfl-status');
    status.textContent = (window.MEMFL_ERRORS.length ? 'error: ' + window.MEMFL_ERRORS.join(' | ') : 'ok') + ' charts=' + charts + ' flames=' + flames +
      (window.MEMFL_MODE === 'live' ? ' clients=' + clients + ' polls=' + polls : '');
  }
  function poll() {
    fetch('api/state' + location.search, { cache: 'no-store' }).then(function (r) {
      if (!r.ok) throw new Error('api/state: HTTP ' + r.status);
      return r.json();
    }).then(function (S) {
      app.textContent = ''; charts = 0; polls++;
      try { live(S); } catch (e) { window.MEMFL_ERRORS.push(String(e && e.stack || e)); }
      show_status();
      if (S.running) setTimeout(poll, 1000);
    }).catch(function (e) {
      // The run is over and the endpoint gone: the page keeps what it drew.
      var n = el('p', { class: 'note' }, 'Not updating: ' + e.message); app.insertBefore(n, app.firstChild);
    });
  }

  try {
    if (window.MEMFL_MODE === 'live') { poll(); return; }
    // A run's live page as it ended (RUN_DIR/live.html): drawn once.
    if (window.MEMFL_MODE === 'frozen') live(D);
    else if (window.MEMFL_MODE === 'compare') compare(D.runs); else report(D.runs[0]);
  } catch (e) { window.MEMFL_ERRORS.push(String(e && e.stack || e)); }
  show_status();
})();
