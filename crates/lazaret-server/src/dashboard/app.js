// lazaret's dashboard: plain JavaScript over the JSON API, no build step, nothing fetched from elsewhere.
//
// The token typed into the login form is kept in sessionStorage (this tab
// only) and sent as `Authorization: Bearer`; never as a cookie. Every piece
// of text from the server (payloads, error messages, names) is hostile
// input: it goes into the page as text nodes (textContent), never parsed as markup.
'use strict';

(() => {
  const TOKEN_KEY = 'lazaret.token';
  /** Bytes of a payload the page will load to edit; larger ones are edited with the API. */
  const EDIT_BYTES_MAX = 1024 * 1024;
  /** Characters of a request or payload shown in a table cell before "…". */
  const CELL_CHARS_MAX = 160;
  const REFRESH_MS = 5000;

  const state = {
    who: null,
    // The charts' window: 1h or 24h (GET /v1/series?window=).
    chartWindow: '1h',
    timer: null,
    // Counts route() calls: a view that finishes loading after the next
    // route began (a slow overview, then a link followed) starts no timer.
    routes: 0,
    // The plain list's selection: {reason, type} or {group, archived}.
    group: null,
    selected: new Set(),
  };

  // ---------------------------------------------------------------- DOM

  /** An element: attributes (`on*` are listeners, `text` is textContent) and children (strings become text). */
  function el(tag, attrs, ...children) {
    const e = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v === null || v === undefined || v === false) continue;
      if (k === 'text') e.textContent = String(v);
      else if (k === 'class') e.className = v;
      else if (k.startsWith('on')) e.addEventListener(k.slice(2), v);
      else if (v === true) e.setAttribute(k, '');
      else e.setAttribute(k, String(v));
    }
    for (const c of children.flat(Infinity)) {
      if (c === null || c === undefined || c === false) continue;
      e.append(c instanceof Node ? c : document.createTextNode(String(c)));
    }
    return e;
  }

  const $ = (id) => document.getElementById(id);

  function may(what) {
    return !!(state.who && state.who.may.includes(what));
  }

  /** Bytes of a payload the server previews (`payload_preview`), as `/v1/whoami` says. */
  function previewBytesMax() {
    return state.who.payload_preview_bytes;
  }

  /** Shows or hides every `data-needs` element by what the role may do. */
  function gate(root) {
    for (const e of root.querySelectorAll('[data-needs]')) {
      e.hidden = !may(e.dataset.needs);
    }
  }

  /** Says how an action went; `keep`: also through the next change of view. */
  function flash(text, keep) {
    $('flash').textContent = text;
    state.keepFlash = !!keep;
  }

  function showError(err) {
    const a = $('alert');
    a.replaceChildren(
      el('strong', { text: err.code ? `${err.code}: ` : 'Error: ' }),
      String(err.message || err),
      ' ',
      el('button', { type: 'button', class: 'link', onclick: () => { a.hidden = true; } }, 'Dismiss'),
    );
    a.hidden = false;
  }

  function clearError() {
    $('alert').hidden = true;
  }

  // ---------------------------------------------------------------- API

  class ApiError extends Error {
    constructor(status, code, message) {
      super(message);
      this.status = status;
      this.code = code;
    }
  }

  function token() {
    return sessionStorage.getItem(TOKEN_KEY);
  }

  function headers(extra) {
    const h = Object.assign({ Accept: 'application/json' }, extra || {});
    const t = token();
    if (t) h.Authorization = `Bearer ${t}`;
    return h;
  }

  /** Calls the API; `body` is an object, or a string sent as it is. Errors become ApiError with the server's message. */
  async function api(method, path, body) {
    const init = { method, headers: headers(), credentials: 'omit', cache: 'no-store' };
    if (body !== undefined) {
      init.headers['Content-Type'] = 'application/json';
      init.body = typeof body === 'string' ? body : JSON.stringify(body);
    }
    let resp;
    try {
      resp = await fetch(path, init);
    } catch (e) {
      throw new ApiError(0, 'NETWORK', `the server did not answer (${e.message}); is it running?`);
    }
    const text = await resp.text();
    let json = null;
    try {
      json = text ? JSON.parse(text) : null;
    } catch (_) {
      json = null;
    }
    if (!resp.ok) {
      const e = json && json.error;
      throw new ApiError(
        resp.status,
        e ? e.code : `HTTP_${resp.status}`,
        e ? e.message : (text.slice(0, 500) || resp.statusText),
      );
    }
    return json;
  }

  function query(params) {
    const q = new URLSearchParams();
    for (const [k, v] of Object.entries(params)) {
      if (v !== null && v !== undefined && v !== '') q.set(k, v);
    }
    const s = q.toString();
    return s ? `?${s}` : '';
  }

  // ---------------------------------------------------------------- formatting

  function fmtTime(iso) {
    if (!iso) return el('span', { class: 'muted', text: '—' });
    const d = new Date(iso);
    return el('time', { datetime: iso, title: iso }, `${d.toISOString().replace('T', ' ').slice(0, 19)}Z`);
  }

  function fmtAge(seconds) {
    if (seconds === null || seconds === undefined || Number.isNaN(seconds)) return '—';
    if (seconds < 60) return `${seconds.toFixed(seconds < 10 ? 1 : 0)} s`;
    if (seconds < 3600) return `${(seconds / 60).toFixed(1)} min`;
    if (seconds < 86400) return `${(seconds / 3600).toFixed(1)} h`;
    return `${(seconds / 86400).toFixed(1)} d`;
  }

  function fmtBytes(n) {
    if (n === null || n === undefined) return '—';
    if (n < 1024) return `${n} B`;
    if (n < 1024 * 1024) return `${(n / 1024).toFixed(1)} KiB`;
    return `${(n / 1024 / 1024).toFixed(1)} MiB`;
  }

  function cut(text, max) {
    const s = String(text);
    return s.length > max ? `${s.slice(0, max)}…` : s;
  }

  function dash(v) {
    return v === null || v === undefined || v === '' ? '—' : String(v);
  }

  /** A table: columns are [label, (row) => cell content]. */
  function table(caption, columns, rows, empty) {
    if (!rows.length) return el('p', { class: 'muted' }, empty || 'Nothing here.');
    return el('table', {},
      el('caption', {}, caption),
      el('thead', {}, el('tr', {}, columns.map(([label]) => el('th', { scope: 'col' }, label)))),
      el('tbody', {}, rows.map((r) => el('tr', {}, columns.map(([, f]) => el('td', {}, f(r)))))));
  }

  /** A definition list of [term, value] pairs (values may be nodes). */
  function facts(pairs) {
    return el('dl', { class: 'facts' }, pairs.flatMap(([k, v]) => [el('dt', {}, k), el('dd', {}, v)]));
  }

  function badge(text, kind) {
    return el('span', { class: `badge ${kind || ''}` }, text);
  }

  /** An inline confirmation step: what will happen, then Confirm or Cancel. */
  function confirmPanel(container, { title, body, confirmLabel, danger, onConfirm, extra }) {
    const panel = el('section', { class: `confirm ${danger ? 'danger' : ''}`, 'aria-labelledby': 'confirm-h' });
    const go = el('button', { type: 'button', class: danger ? 'danger' : 'primary' }, confirmLabel);
    const cancel = el('button', { type: 'button' }, 'Cancel');
    cancel.addEventListener('click', () => container.replaceChildren());
    go.addEventListener('click', async () => {
      go.disabled = true;
      try {
        await onConfirm(panel);
      } catch (e) {
        showError(e);
        go.disabled = false;
      }
    });
    panel.append(el('h3', { id: 'confirm-h', tabindex: '-1' }, title), ...[body].flat(Infinity), extra || '', el('p', { class: 'actions' }, go, ' ', cancel));
    container.replaceChildren(panel);
    panel.querySelector('h3').focus();
    return panel;
  }

  // ---------------------------------------------------------------- login

  async function signIn() {
    try {
      state.who = await api('GET', '/v1/whoami');
    } catch (e) {
      state.who = null;
      if (e.status === 401) {
        if (token()) {
          sessionStorage.removeItem(TOKEN_KEY);
          showError(e);
        }
        showView('login');
        $('token').focus();
        return false;
      }
      showError(e);
      showView('login');
      return false;
    }
    $('who-text').textContent = state.who.auth
      ? `${state.who.name} (${state.who.role})`
      : `${state.who.name} (${state.who.role}; auth is off: loopback only)`;
    $('who').hidden = false;
    $('logout').hidden = !state.who.auth;
    $('nav').hidden = false;
    gate(document);
    return true;
  }

  // ---------------------------------------------------------------- routing

  /** Shows one view; `nav` names the menu entry it belongs to. */
  function showView(name, nav) {
    const current = nav || (['dead-letter', 'dl-list', 'redrive'].includes(name) ? 'dead-letters' : name);
    for (const v of document.querySelectorAll('.view')) v.hidden = v.id !== `view-${name}`;
    for (const a of document.querySelectorAll('#nav a')) {
      if (a.dataset.view === current) {
        a.setAttribute('aria-current', 'page');
      } else {
        a.removeAttribute('aria-current');
      }
    }
  }

  async function route() {
    const seq = ++state.routes;
    clearInterval(state.timer);
    state.timer = null;
    clearError();
    if (!state.keepFlash) flash('');
    state.keepFlash = false;
    if (!state.who) {
      showView('login');
      return;
    }
    const hash = location.hash.replace(/^#\/?/, '');
    const [path, q] = hash.split('?');
    const params = new URLSearchParams(q || '');
    const parts = path.split('/');
    try {
      if (parts[0] === 'dead-letters' && parts[1] === 'list' && may('read_dead_letters')) {
        await dlList(params);
      } else if (parts[0] === 'dead-letters' && may('read_dead_letters')) {
        await groupsView(params);
      } else if (parts[0] === 'redrive' && parts[1] && may('read_dead_letters')) {
        await redriveReport(decodeURIComponent(parts[1]));
      } else if (parts[0] === 'dead-letter' && parts[1] && may('read_dead_letters')) {
        await deadLetter(parts[1]);
      } else if (parts[0] === 'jobs' && may('list_jobs')) {
        await jobs(params);
      } else if (parts[0] === 'job' && parts[1] && may('read_jobs')) {
        await job(parts[1]);
      } else if (parts[0] === 'audit' && may('read_dead_letters')) {
        await audit(params);
      } else if (parts[0] === 'breakers') {
        await breakersView(params);
      } else {
        await overview();
        // Another route began while the overview loaded: its refresh would
        // take the page back from that view every few seconds.
        if (seq === state.routes) {
          state.timer = setInterval(() => {
            if (!document.hidden) overview().catch(showError);
          }, REFRESH_MS);
        }
      }
    } catch (e) {
      showError(e);
    }
  }

  // ---------------------------------------------------------------- overview

  async function overview() {
    showView('overview');
    const [stats, breakers, series] = await Promise.all([
      api('GET', '/v1/stats'),
      api('GET', '/v1/breakers'),
      api('GET', `/v1/series${query({ window: state.chartWindow })}`),
    ]);
    drawCharts(series);
    $('overview-updated').textContent = `Updated ${new Date().toISOString().slice(11, 19)}Z; refreshes every ${REFRESH_MS / 1000} s.`;

    const dl = stats.dead_letters || {};
    const surges = surgesOf(stats);
    $('overview-surge').replaceChildren(...surges.map((surge) => el('div', { class: 'surge', role: 'note' },
      el('strong', {}, `Systemic failure likely${surge.type ? ` in ${surge.type}` : ''}: `),
      `${Math.round(surge.share * 100)}% of the last ${surge.total} dead letters${surge.type ? ' of this type' : ''} share one cause (${surge.count} × `,
      el('code', {}, surge.key), '). One bug or one outage, not scattered bad data.')));

    const lanes = Object.entries(stats.lanes || {});
    const rows = lanes.map(([lane, c]) => ({ lane, ...c }));
    $('overview-lanes').replaceChildren(table(
      'Lanes: depth, and how long the longest-waiting ready job has waited',
      [
        ['Lane', (r) => el('code', {}, r.lane)],
        ['Queued', (r) => String(r.queued)],
        ['Scheduled', (r) => String(r.scheduled)],
        ['Leased', (r) => String(r.leased)],
        // 0 is "none ready", not a job that waited no time.
        ['Oldest job', (r) => (r.oldest_age_ms ? fmtAge(r.oldest_age_ms / 1000) : '—')],
      ],
      rows,
      'No lane has jobs.',
    ));

    $('overview-dl').replaceChildren(
      facts([
        ['Held now', `${dl.total ?? 0}${dl.warn_at ? ` (warning above ${dl.warn_at})` : ''}`],
        ['Inflow', `${Number(dl.rate_per_min || 0).toFixed(1)} per minute`],
        ['Succeeded jobs kept', dash(stats.succeeded_kept)],
      ]),
      table(
        'Dead letters by type and reason',
        [
          ['Type', (r) => dash(r.type)],
          ['Reason', (r) => el('code', {}, r.reason)],
          ['Count', (r) => String(r.count)],
          ['Surge', (r) => surgeBadge(surgeFor(surges, r))],
          ['', (r) => (may('read_dead_letters')
            ? el('a', { href: `#/dead-letters${query({ reason: r.reason, type: r.type })}` }, `Groups of ${r.reason} in ${dash(r.type)}`)
            : '')],
        ],
        dl.by_type_reason || [],
        'No dead letters.',
      ),
    );

    const bs = breakers.breakers || [];
    $('overview-breakers').replaceChildren(table(
      'Circuit breakers that are not closed',
      [
        ['Type', (b) => el('a', { href: `#/breakers${query({ type: b.type })}` }, b.type)],
        ['Error kind', (b) => el('code', {}, b.kind)],
        ['State', (b) => badge(b.state, b.state === 'open' ? 'bad' : 'warn')],
        ['Until', (b) => fmtTime(b.until)],
      ],
      bs.filter((b) => b.state !== 'closed'),
      'Every breaker is closed.',
    ));

    const paused = stats.paused;
    const pausedRows = paused
      ? [...paused.types.map((n) => ({ kind: 'type', name: n })), ...paused.lanes.map((n) => ({ kind: 'lane', name: n }))]
      : [];
    $('overview-paused').replaceChildren(paused
      ? table('Paused types and lanes', [
        ['What', (p) => p.kind],
        ['Name', (p) => el('code', {}, p.name)],
        ['', (p) => (may('operate')
          ? el('button', { type: 'button', onclick: () => pauseResume(false, p.kind, p.name) }, `Resume ${p.kind} ${p.name}`)
          : '')],
      ], pausedRows, 'Nothing is paused.')
      : el('p', { class: 'muted' }, 'This server does not report pauses.'));
  }

  // ---------------------------------------------------------------- charts

  /** What each signal of /v1/series is called on the page. */
  const SIGNALS = {
    dlq_depth: 'DLQ depth (held)',
    dead_lettered: 'Dead-lettered per minute (poison rate)',
    redrive_sent: 'Redrives sent per minute',
    redrive_succeeded: 'Redrives succeeded per minute',
    redrive_failed_again: 'Redrives failed again per minute',
    failure_reasons: 'Distinct failure reasons held',
    throughput: 'Jobs succeeded per minute (throughput)',
    oldest_age_ms: 'Oldest ready job: how long it has waited',
  };
  const AXES = { type: 'by type', source: 'by source', lane: 'by lane' };
  /** Line colours, each readable on white. */
  const PALETTE = ['#0b5cad', '#b42318', '#1a7f37', '#8a5a00', '#6f42c1', '#0e7490', '#c2410c', '#57606a'];
  /** An SVG element, as `el` makes HTML ones (children: nodes or text). Its
   * namespace is read from the page's own empty `<svg>`, which the HTML
   * parser put in it: the page names no address, not even this one. */
  function svg(tag, attrs, ...children) {
    const e = document.createElementNS($('svg-namespace').namespaceURI, tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v !== null && v !== undefined) e.setAttribute(k, String(v));
    }
    for (const c of children.flat(Infinity)) {
      if (c === null || c === undefined) continue;
      e.append(c instanceof Node ? c : document.createTextNode(String(c)));
    }
    return e;
  }

  /** A line's name as shown: `null` is "no type" or lazaret's own jobs. */
  function lineName(line) {
    if (line.name !== null) return line.name;
    return line.by === 'source' ? 'lazaret (own jobs)' : line.by === 'type' ? '(no type)' : '—';
  }

  function chartValue(signal, v) {
    if (v === null || v === undefined) return 'no sample';
    return signal === 'oldest_age_ms' ? fmtAge(v / 1000) : String(v);
  }

  function clock(iso) {
    return `${iso.slice(11, 16)}Z`;
  }

  /** One chart: a signal by one axis, a line per name, every point a circle holding its value. */
  function chart(signal, by, lines, at, windowWord) {
    const id = `chart-${signal}-${by}`;
    const title = `${SIGNALS[signal] || signal} ${AXES[by] || by}, last ${windowWord === '24h' ? 'day' : 'hour'}`;
    const fig = el('figure', { class: 'chart', 'data-signal': signal, 'data-by': by });
    fig.append(el('figcaption', { id: `${id}-caption` }, title));
    if (!lines.length) {
      fig.append(el('p', { class: 'muted' }, 'Nothing in this window.'));
      return fig;
    }
    const W = 360;
    const H = 120;
    const left = 34;
    const right = 6;
    const top = 8;
    const bottom = 16;
    const n = at.length;
    const values = lines.flatMap((l) => l.values.filter((v) => v !== null));
    const max = Math.max(1, ...values);
    const x = (i) => left + (n > 1 ? (i * (W - left - right)) / (n - 1) : 0);
    const y = (v) => top + (H - top - bottom) * (1 - v / max);
    const latest = (l) => {
      for (let i = l.values.length - 1; i >= 0; i -= 1) if (l.values[i] !== null) return l.values[i];
      return null;
    };
    const desc = lines.map((l) => `${lineName(l)}: ${chartValue(signal, latest(l))} now, at most ${chartValue(signal, Math.max(0, ...l.values.filter((v) => v !== null)))}`).join('; ');
    const plot = svg('svg', {
      viewBox: `0 0 ${W} ${H}`, role: 'img', 'aria-labelledby': `${id}-title ${id}-desc`, focusable: 'false',
    },
    svg('title', { id: `${id}-title` }, title),
    svg('desc', { id: `${id}-desc` }, desc),
    svg('line', { class: 'axis', x1: left, y1: y(0), x2: W - right, y2: y(0) }),
    svg('line', { class: 'axis', x1: left, y1: y(max), x2: W - right, y2: y(max), 'stroke-dasharray': '2 3' }),
    svg('text', { x: left - 4, y: y(max) + 3, 'text-anchor': 'end' }, chartValue(signal, max)),
    svg('text', { x: left - 4, y: y(0) + 3, 'text-anchor': 'end' }, '0'),
    svg('text', { x: left, y: H - 3 }, clock(at[0])),
    svg('text', { x: W - right, y: H - 3, 'text-anchor': 'end' }, clock(at[n - 1])));
    const legend = el('ul', { 'aria-label': `Lines of ${title}` });
    lines.forEach((l, k) => {
      const colour = PALETTE[k % PALETTE.length];
      const g = svg('g', { class: 'line', 'data-name': l.name === null ? '' : l.name, stroke: colour, fill: colour });
      // A gap (a step no sampling covered) breaks the line.
      let run = [];
      const flush = () => {
        if (run.length > 1) g.append(svg('polyline', { points: run.join(' '), fill: 'none', 'stroke-width': 1.5 }));
        run = [];
      };
      l.values.forEach((v, i) => {
        if (v === null) { flush(); return; }
        run.push(`${x(i).toFixed(1)},${y(v).toFixed(1)}`);
        g.append(svg('circle', {
          cx: x(i).toFixed(1), cy: y(v).toFixed(1), r: n > 100 ? 1.2 : 2, stroke: 'none',
          'data-value': v, 'data-at': at[i],
        }, svg('title', {}, `${lineName(l)} at ${clock(at[i])}: ${chartValue(signal, v)}`)));
      });
      flush();
      plot.append(g);
      legend.append(el('li', {},
        svg('svg', { viewBox: '0 0 10 10', 'aria-hidden': 'true' }, svg('rect', { width: 10, height: 10, fill: colour })),
        `${lineName(l)}: ${chartValue(signal, latest(l))}`));
    });
    fig.append(plot, legend);
    return fig;
  }

  /** The charts of a /v1/series answer: per signal, a chart per axis it is broken down by. */
  function drawCharts(series) {
    const box = $('overview-charts');
    box.dataset.window = series.window;
    box.dataset.to = series.to;
    for (const b of document.querySelectorAll('[data-window]')) {
      if (b.tagName === 'BUTTON') b.setAttribute('aria-pressed', String(b.dataset.window === series.window));
    }
    const axes = { throughput: ['lane'], oldest_age_ms: ['lane'] };
    const parts = [];
    for (const signal of Object.keys(SIGNALS)) {
      parts.push(el('h4', {}, SIGNALS[signal]));
      for (const by of axes[signal] || ['type', 'source']) {
        const lines = series.series.filter((l) => l.signal === signal && l.by === by);
        parts.push(chart(signal, by, lines, series.at, series.window));
      }
    }
    box.replaceChildren(...parts);
  }

  async function pauseResume(pause, kind, name) {
    await api('POST', pause ? '/v1/pause' : '/v1/resume', { [kind]: name });
    flash(`${pause ? 'Paused' : 'Resumed'} ${kind} ${name}.`);
    await overview();
  }

  // ---------------------------------------------------------------- dead letters

  /**
   * The surges, per type, by the rule the alerts use (`dead_letters.surges`:
   * type, reason, cause, key, count, total, share). A server without that
   * list gives its one cross-type surge, with the type and cause found
   * among the top failures it names and no reason.
   */
  function surgesOf(stats) {
    const dl = (stats && stats.dead_letters) || {};
    if (Array.isArray(dl.surges)) return dl.surges;
    if (!dl.surge) return [];
    const top = (dl.top_failures || []).find((t) => `${t.type}/${t.cause}: ${t.fingerprint}` === dl.surge.key);
    return [{ ...dl.surge, type: top ? top.type : null, cause: top ? top.cause : null, reason: null }];
  }

  /** The surge of a (reason, type) row: its type's, when it carries the row's reason (any of the type's rows when the reason is unknown). */
  function surgeFor(surges, row) {
    return surges.find((s) => s.type !== null && s.type === row.type && (s.reason === null || s.reason === undefined || s.reason === row.reason)) || null;
  }

  function surgeBadge(surge) {
    return surge ? badge(`systemic: ${Math.round(surge.share * 100)}% ${surge.cause}`, 'bad') : '';
  }

  // ---------------------------------------------------------------- failure groups

  /** The filter form's `since` words, in milliseconds back from now (the API takes an RFC 3339 time). */
  const SINCE_MS = { '1h': 3600e3, '24h': 86400e3, '7d': 7 * 86400e3 };
  const GROUPS_PAGE = 25;

  /**
   * The dead letters' home: their failure groups, filtered by the hash's
   * `type`, `reason`, `source`, `tenant`, `since` and `archived` (the
   * alerts link `#/dead-letters?type=T&reason=R`), a page at a time.
   */
  async function groupsView(params) {
    showView('dead-letters');
    const form = $('groups-form');
    const filters = {};
    for (const k of ['type', 'reason', 'source', 'tenant', 'since']) {
      form.elements[k].value = params.get(k) || '';
      filters[k] = form.elements[k].value;
    }
    form.elements.archived.checked = params.get('archived') === 'true';
    filters.archived = form.elements.archived.checked ? 'true' : '';
    $('groups-confirm').replaceChildren();
    $('groups-list').replaceChildren(el('p', {}, 'Loading…'));
    await loadGroups(filters, null);
  }

  async function loadGroups(filters, cursor) {
    const archived = filters.archived === 'true';
    const since = SINCE_MS[filters.since] ? new Date(Date.now() - SINCE_MS[filters.since]).toISOString() : '';
    const page = await api('GET', `/v1/dead-letters/groups${query({ ...filters, since, limit: GROUPS_PAGE, cursor })}`);
    const list = $('groups-list');
    const box = $('groups-confirm');
    const reload = () => loadGroups(filters, null);
    const t = table(
      archived ? 'Archived failure groups, most recently seen first' : 'Failure groups, most recently seen first',
      [
        ['Failure', (g) => [el('code', {}, g.fingerprint), el('div', { class: 'muted' }, 'e.g. ', cut(g.sample_error || '', CELL_CHARS_MAX))]],
        ['Type · reason · kind', (g) => [el('code', {}, dash(g.type)), el('div', { class: 'muted' }, `${g.reason} · ${dash(g.kind)}`)]],
        ['Count', (g) => [String(g.count), g.held ? [' ', badge(`${g.held} held`, 'warn')] : '']],
        ['Last hour', (g) => dash(g.rate_1h)],
        ['Seen', (g) => [fmtTime(g.last_at), el('div', { class: 'muted' }, 'since ', fmtTime(g.first_at))]],
        ['Tenants · sources', (g) => [dash(cut((g.tenants || []).join(', '), CELL_CHARS_MAX)),
          (g.sources || []).length ? el('div', { class: 'muted' }, cut(g.sources.join(', '), CELL_CHARS_MAX)) : '']],
        ['Verdict', (g) => (g.verdict ? badge(g.verdict, g.verdict === 'systemic' ? 'bad' : '') : '—')],
        ['', (g) => groupActions(g, archived, box, reload)],
      ],
      page.items || [],
      archived ? 'No archived group matches.' : 'No failure group matches: the quarantine holds none of these.',
    );
    // More rows go into the table already shown: one table, one caption.
    const shown = cursor && list.querySelector('tbody');
    if (shown) shown.append(...t.querySelectorAll('tbody tr'));
    else list.replaceChildren(t);
    if (page.next_cursor) {
      const more = el('button', { type: 'button', id: 'groups-more' }, 'Load more groups');
      more.addEventListener('click', () => { more.remove(); loadGroups(filters, page.next_cursor).catch(showError); });
      list.append(el('p', {}, more));
    }
  }

  /** A group's row actions: open its dead letters, redrive, archive or restore, purge; each by `{"filter": {"group": ID}}`. */
  function groupActions(g, archived, box, after) {
    const what = `group ${g.id}`;
    const sel = { filter: { group: g.id } };
    const button = (label, flow, cls) => el('button', { type: 'button', class: cls, onclick: () => flow().catch(showError) }, label);
    const acts = [el('a', { href: `#/dead-letters/list${query({ group: g.id, archived: archived ? 'true' : '' })}` }, `Open ${g.count}`)];
    // A filter redrives and purges active dead letters only.
    if (may('operate') && !archived) acts.push(button('Redrive…', () => redriveFlow(sel, what, box, after)));
    if (may('operate')) {
      acts.push(archived
        ? button('Restore…', () => archiveFlow(sel, 'restore', what, box, after))
        : button('Archive…', () => archiveFlow(sel, 'archive', what, box, after)));
    }
    if (may('administer') && !archived) acts.push(button('Purge…', () => purgeFlow(sel, g.count, box, after), 'danger'));
    return el('div', { class: 'actions' }, acts);
  }

  /** An answer's `not_found`: the requested ids that matched nothing. */
  function notFound(ids) {
    return ids && ids.length
      ? el('p', { class: 'warn' }, `Matched nothing (unknown, gone, or already in that state): ${ids.join(', ')}`)
      : el('p', { class: 'muted' }, 'Not found: none.');
  }

  /** Dead-letter ids as links, the first 200. */
  function idList(ids, label) {
    return [
      el('ul', { class: 'dry-run', 'aria-label': label }, ids.slice(0, 200).map((id) => el('li', {},
        el('a', { href: `#/dead-letter/${encodeURIComponent(id)}` }, `dead letter ${id}`)))),
      ids.length > 200 ? el('p', { class: 'muted' }, `…and ${ids.length - 200} more.`) : '',
    ];
  }

  /** Archive or restore (`verb`): the dry run's count and ids first, then the confirm; then the answer's counts and `not_found`. */
  async function archiveFlow(selection, verb, what, box, after) {
    clearError();
    const path = `/v1/dead-letters/${verb}`;
    const word = verb === 'archive' ? 'archived' : 'restored';
    const Verb = verb === 'archive' ? 'Archive' : 'Restore';
    const dry = await api('POST', path, { ...selection, dry_run: true });
    confirmPanel(box, {
      title: `${Verb} ${what}?`,
      body: [
        el('p', { class: 'dry-count' }, `Dry run: ${dry.matched} would be ${word}.`),
        idList(dry.ids || [], `What the ${verb} would change`),
        notFound(dry.not_found),
        el('p', { class: 'muted' }, verb === 'archive'
          ? 'Archived dead letters are kept, with their jobs and payloads, but leave the active view and never alert again; a restore brings them back.'
          : 'Restored dead letters are active again: listed, counted, redrivable and alerting.'),
      ],
      confirmLabel: `${Verb} ${dry.matched}`,
      onConfirm: async () => {
        const done = await api('POST', path, selection);
        const text = `${Verb === 'Archive' ? 'Archived' : 'Restored'} ${done[word]} of ${done.matched}.`;
        box.replaceChildren(el('div', { class: 'result', role: 'status' }, el('p', {}, text), notFound(done.not_found),
          done.interrupted ? el('p', { class: 'warn' }, 'The server began shutting down halfway: send it again for the rest.') : ''));
        flash(text, true);
        if (after) await after();
      },
    });
    if (!dry.matched) box.querySelector('button.primary').disabled = true;
  }

  // ---------------------------------------------------------------- the plain list

  /** Every dead letter by (reason, type), and below it one selection's dead letters: `?reason=R&type=T`, or a group's (`?group=ID`, `&archived=true`). */
  async function dlList(params) {
    showView('dl-list');
    const [reasons, stats] = await Promise.all([
      api('GET', '/v1/dead-letters/reasons'),
      api('GET', '/v1/stats').catch(() => null),
    ]);
    const surges = surgesOf(stats);
    const all = reasons.reasons || [];
    // `?type=T` alone narrows the reasons to T's; `?reason=R` (with or
    // without a type) opens that selection below them.
    const onlyType = params.get('type');
    const reason = params.get('reason');
    const groupId = params.get('group');
    const narrowed = onlyType && !reason;
    const rows = narrowed ? all.filter((r) => r.type === onlyType) : all;
    $('dl-filter').replaceChildren(narrowed
      ? el('p', { id: 'dl-filter-note' }, `Showing type ${onlyType} only. `,
        el('a', { href: '#/dead-letters/list' }, 'Show every type and reason'))
      : '');
    $('dl-reasons').replaceChildren(table(
      'Dead letters grouped by reason and type',
      [
        ['Reason', (r) => el('code', {}, r.reason)],
        ['Type', (r) => dash(r.type)],
        ['Count', (r) => String(r.count)],
        ['First seen', (r) => fmtTime(r.first_at)],
        ['Last seen', (r) => fmtTime(r.last_at)],
        ['Surge', (r) => surgeBadge(surgeFor(surges, r))],
        ['', (r) => el('a', { href: `#/dead-letters/list${query({ reason: r.reason, type: r.type })}` }, `Show ${r.count} ${r.reason}${r.type ? ` of ${r.type}` : ''}`)],
      ],
      rows,
      narrowed ? 'No dead letter matches.' : 'The quarantine is empty.',
    ));
    if (!reason && !groupId) {
      $('dl-group').hidden = true;
      return;
    }
    const group = groupId
      ? { group: groupId, archived: params.get('archived') === 'true' }
      : { reason, type: onlyType };
    const key = JSON.stringify(group);
    if (JSON.stringify(state.group) !== key) {
      state.selected = new Set();
      // Another group's rows must not stay under this heading while its
      // own load: a box ticked there would select a dead letter of the
      // group before.
      $('dl-list').replaceChildren(el('p', {}, 'Loading…'));
    }
    state.group = group;
    const count = groupId ? null : all
      .filter((r) => r.reason === reason && (!onlyType || r.type === onlyType))
      .reduce((n, r) => n + r.count, 0);
    $('dl-group').hidden = false;
    $('dl-group-h').textContent = groupId
      ? `Failure group ${groupId}${group.archived ? ' (archived)' : ''}`
      : `${reason}${group.type ? ` · ${group.type}` : ''} (${count})`;
    $('dl-confirm').replaceChildren();
    renderGroupActions(group, count);
    await loadGroup(group, null);
  }

  /** The API filter of a plain-list selection. */
  function filterOf(group) {
    if (group.group) return { group: group.group };
    const f = { reason: group.reason };
    if (group.type) f.type = group.type;
    return f;
  }

  function renderGroupActions(group, count) {
    const acts = [];
    const whole = group.group ? 'the whole group' : `all ${count}`;
    // A filter matches active dead letters only: an archived group's are acted on by selection.
    const byFilter = !group.archived;
    if (may('operate')) {
      acts.push(el('button', { type: 'button', onclick: () => redriveFlow({ ids: [...state.selected] }, 'the selected dead letters').catch(showError) }, 'Redrive selected…'));
      if (byFilter) {
        const what = group.group ? `every dead letter of group ${group.group}` : `every ${group.reason} dead letter${group.type ? ` of ${group.type}` : ''}`;
        acts.push(el('button', { type: 'button', onclick: () => redriveFlow({ filter: filterOf(group) }, what).catch(showError) }, group.group ? 'Redrive the whole group…' : `Redrive all ${count} with this reason…`));
      }
    }
    if (may('administer')) {
      acts.push(el('button', { type: 'button', class: 'danger', onclick: () => purgeFlow({ ids: [...state.selected] }, state.selected.size).catch(showError) }, 'Purge selected…'));
      if (byFilter) acts.push(el('button', { type: 'button', class: 'danger', onclick: () => purgeFlow({ filter: filterOf(group) }, count).catch(showError) }, `Purge ${whole}…`));
    }
    $('dl-group-actions').replaceChildren(...acts.flatMap((a) => [a, ' ']));
  }

  async function loadGroup(group, cursor) {
    const page = await api('GET', `/v1/dead-letters${query({ ...filterOf(group), archived: group.archived ? 'true' : '', limit: 100, cursor })}`);
    const list = $('dl-list');
    if (!cursor) list.replaceChildren();
    const items = page.items || [];
    const t = table(
      `${group.group ? `Dead letters of group ${group.group}` : `Dead letters with reason ${group.reason}`}${cursor ? ' (more)' : ''}`,
      [
        ['Select', (d) => {
          const box = el('input', { type: 'checkbox', id: `sel-${d.id}`, 'aria-label': `Select dead letter ${d.id}`, checked: state.selected.has(d.id) });
          box.addEventListener('change', () => {
            if (box.checked) state.selected.add(d.id); else state.selected.delete(d.id);
          });
          return box;
        }],
        ['Dead letter', (d) => [el('a', { href: `#/dead-letter/${encodeURIComponent(d.id)}` }, `Open ${d.id}`), d.held ? [' ', badge('held', 'warn')] : '']],
        ['Job or message', (d) => (d.source ? `${d.source.name}: ${cut(d.source.message_id, 40)}` : dash(d.job_id))],
        ['Tenant', (d) => dash(d.tenant)],
        ['Error', (d) => (d.error ? el('span', {}, el('code', {}, d.error.kind), ' ', cut(d.error.message || '', CELL_CHARS_MAX)) : '—')],
        ['Attempts', (d) => String(d.attempts)],
        ['Dead-lettered', (d) => fmtTime(d.dead_lettered_at)],
        ['Size', (d) => fmtBytes(d.payload_size)],
      ],
      items,
      group.group ? 'None left in this group.' : 'None left with this reason.',
    );
    list.append(t);
    if (page.next_cursor) {
      const more = el('button', { type: 'button' }, 'Load more');
      more.addEventListener('click', async () => {
        more.remove();
        try { await loadGroup(group, page.next_cursor); } catch (e) { showError(e); }
      });
      list.append(el('p', {}, more));
    }
  }

  /** Dry run first; the confirm shows its count and list, and takes a rate; the answer links to the redrive's report. */
  async function redriveFlow(selection, what, container, after) {
    const box = container || $('dl-confirm');
    if (selection.ids && !selection.ids.length) {
      showError(new ApiError(0, 'NOTHING_SELECTED', 'select dead letters first (the boxes in the first column)'));
      return;
    }
    clearError();
    const dry = await api('POST', '/v1/dead-letters/redrive', { ...selection, dry_run: true });
    const items = dry.items || [];
    const rate = el('input', { id: 'redrive-rate', type: 'number', min: '1', step: '1', inputmode: 'numeric' });
    const list = el('ul', { class: 'dry-run', 'aria-label': 'What the redrive would move' }, items.slice(0, 200).map((i) => el('li', {},
      `dead letter ${i.dead_letter_id} → `,
      i.job_id ? `job ${i.job_id}` : `message ${i.message_id} of source ${i.source}`)));
    const body = [
      el('p', { class: 'dry-count' }, `Dry run: ${dry.matched} would be redriven (${what}).`),
      list,
      items.length > 200 ? el('p', { class: 'muted' }, `…and ${items.length - 200} more.`) : '',
      dry.not_found && dry.not_found.length ? el('p', { class: 'warn' }, `Not redrivable (gone, or admission records): ${dry.not_found.join(', ')}`) : '',
      dry.skipped_admission_records ? el('p', { class: 'muted' }, `${dry.skipped_admission_records} admission record(s) are skipped: nothing valid was admitted.`) : '',
      el('p', {}, el('label', { for: 'redrive-rate' }, 'Rate (dead letters per second; empty for no limit) '), rate),
    ];
    confirmPanel(box, {
      title: 'Redrive?',
      body,
      confirmLabel: `Redrive ${dry.matched}`,
      onConfirm: async () => {
        const req = { ...selection };
        if (rate.value) req.rate_per_sec = Number(rate.value);
        const done = await api('POST', '/v1/dead-letters/redrive', req);
        const failed = (done.items || []).filter((i) => i.error);
        box.replaceChildren(el('div', { class: 'result', role: 'status' },
          el('p', {}, `Redriven ${done.redriven} of ${done.matched}.`),
          failed.length ? el('ul', {}, failed.map((i) => el('li', {}, `dead letter ${i.dead_letter_id}: ${i.error}`))) : '',
          notFound(done.not_found),
          done.redrive_id ? el('p', {}, el('a', { href: `#/redrive/${encodeURIComponent(done.redrive_id)}` }, 'Follow this redrive: its report')) : '',
          (done.job_ids || []).length ? el('p', {}, 'Jobs: ', (done.job_ids || []).slice(0, 50).flatMap((j) => [el('a', { href: `#/job/${j}` }, `job ${j}`), ' '])) : ''));
        flash(`Redriven ${done.redriven} of ${done.matched}.`, !!after);
        state.selected = new Set();
        if (after) await after();
        else if (!container && state.group) await loadGroup(state.group, null);
      },
    });
    if (!dry.matched) {
      box.querySelector('button.primary').disabled = true;
    }
  }

  /**
   * Purge after a confirmation. The API's purge has no dry run: for a
   * filter, what it would delete is read first (the same filter over the
   * active dead letters) and listed.
   */
  async function purgeFlow(selection, count, container, after) {
    const box = container || $('dl-confirm');
    if (selection.ids && !selection.ids.length) {
      showError(new ApiError(0, 'NOTHING_SELECTED', 'select dead letters first (the boxes in the first column)'));
      return;
    }
    let preview = [];
    if (selection.filter) {
      const page = await api('GET', `/v1/dead-letters${query({ ...selection.filter, limit: 200 })}`);
      const ids = (page.items || []).map((d) => d.id);
      const more = (count === null || count === undefined) && page.next_cursor;
      if (count === null || count === undefined) count = ids.length;
      preview = [el('p', { class: 'dry-count' }, `Would purge ${count}${more ? ' or more' : ''}, as listed now:`),
        idList(ids, 'What the purge would delete')];
    }
    const sure = el('input', { type: 'checkbox', id: 'purge-sure' });
    const panel = confirmPanel(box, {
      title: `Purge ${count} dead letter${count === 1 ? '' : 's'} for good?`,
      danger: true,
      body: [
        ...preview,
        el('p', {}, 'Purged dead letters and their jobs are deleted; they cannot be redriven or read again. The purge is written to the audit log.'),
        el('p', {}, sure, ' ', el('label', { for: 'purge-sure' }, 'I understand this deletes them for good')),
      ],
      confirmLabel: `Purge ${count}`,
      onConfirm: async () => {
        const done = await api('POST', '/v1/dead-letters/purge', { ...selection, confirm: true });
        box.replaceChildren(el('div', { class: 'result', role: 'status' }, el('p', {}, `Purged ${done.purged}.`), notFound(done.not_found)));
        flash(`Purged ${done.purged}.`, true);
        state.selected = new Set();
        if (after) await after();
        else if (state.group) await dlList(new URLSearchParams({ ...filterOf(state.group), archived: state.group.archived ? 'true' : '' }));
      },
    });
    const go = panel.querySelector('button.danger');
    go.disabled = true;
    sure.addEventListener('change', () => { go.disabled = !sure.checked; });
  }

  // ---------------------------------------------------------------- redrive report

  const REPORT_POLL_MS = 2000;
  /** The report's counts, in the order shown: [label, field]. */
  const REPORT_COUNTS = [['Sent', 'sent'], ['Jobs', 'jobs'], ['Succeeded', 'succeeded'], ['Running', 'running'],
    ['Failed again', 'failed_again'], ['Cancelled', 'cancelled'], ['Gone', 'gone']];

  /** What a redrive did (`GET /v1/redrives/{id}`), read again every 2 s while any of its jobs is running. */
  async function redriveReport(id) {
    showView('redrive');
    const r = await api('GET', `/v1/redrives/${encodeURIComponent(id)}`);
    $('redrive-h').textContent = `Redrive ${r.id}`;
    const groups = (caption, rows, empty) => table(caption, [
      ['Group', (g) => el('a', { href: `#/dead-letters/list${query({ group: g.group })}` }, `group ${g.group}`)],
      ['Count', (g) => String(g.count)],
    ], rows || [], empty);
    $('redrive-body').replaceChildren(
      facts([['When', fmtTime(r.at)], ['Who', r.actor], ['Request', el('code', {}, JSON.stringify(r.request))]]),
      table('Where its jobs stand now', [
        ['Outcome', ([label]) => label],
        ['Count', ([, field]) => String(r[field] ?? 0)],
      ], REPORT_COUNTS),
      el('p', { class: 'muted', id: 'redrive-live' }, r.running > 0
        ? `${r.running} still running: updated every ${REPORT_POLL_MS / 1000} s.`
        : 'None of its jobs is running now.'),
      el('p', { class: 'muted' }, 'Sent counts broker messages too; after their republish only their broker follows them.'),
      el('h3', {}, 'Taken from'),
      groups('The failure groups its dead letters came from', r.from_groups, 'No group recorded.'),
      el('h3', {}, 'Failed again into'),
      groups('The failure groups its jobs fell into when they failed again', r.failed_again_groups, 'None failed again.'),
    );
    if (r.running > 0 && !state.timer) {
      const here = location.hash;
      state.timer = setInterval(() => {
        if (document.hidden || location.hash !== here) return;
        clearInterval(state.timer);
        state.timer = null;
        redriveReport(id).catch(showError);
      }, REPORT_POLL_MS);
    }
  }

  // ---------------------------------------------------------------- one dead letter

  function historyTable(history) {
    return table('Attempt history', [
      ['Attempt', (h) => String(h.attempt)],
      ['Started', (h) => fmtTime(h.started_at)],
      ['Ended', (h) => fmtTime(h.ended_at)],
      ['Worker', (h) => dash(h.worker_id)],
      ['Outcome', (h) => h.outcome],
      ['Error', (h) => (h.error ? el('span', {}, el('code', {}, h.error.kind), ' ', cut(h.error.message || '', CELL_CHARS_MAX)) : '—')],
    ], history || [], 'No attempts were made.');
  }

  async function download(path, name) {
    const resp = await fetch(path, { headers: headers({ Accept: '*/*' }), credentials: 'omit', cache: 'no-store' });
    if (!resp.ok) {
      const text = await resp.text();
      let msg = text.slice(0, 500);
      try { msg = JSON.parse(text).error.message; } catch (_) { /* not the envelope */ }
      throw new ApiError(resp.status, `HTTP_${resp.status}`, msg);
    }
    const url = URL.createObjectURL(await resp.blob());
    const a = el('a', { href: url, download: name, hidden: true });
    document.body.append(a);
    a.click();
    a.remove();
    setTimeout(() => URL.revokeObjectURL(url), 60000);
  }

  /**
   * A dead letter's `lineage` (oldest first: each redrive of its job, and
   * how it ended) as a table. The one place that reads the entries' names:
   * `redrive_id`, `at`, `actor`, `from_group`, `edited`, `to` ({type,
   * lane} or null), `ended`, `group` (where it fell when it failed again).
   */
  function lineageTable(lineage) {
    const groupLink = (g) => el('a', { href: `#/dead-letters/list${query({ group: g })}` }, `group ${g}`);
    // Each redrive of a job that is a dead letter again ended in a failure:
    // into the next entry's group, or (the last) into this dead letter.
    const ended = (o) => [
      badge(o.failed_again ? 'failed again' : dash(o.state), o.failed_again ? 'bad' : 'warn'),
      o.group ? [' into ', groupLink(o.group)] : '',
      o.current ? ' (this dead letter)' : '',
    ];
    return table('Lineage: each redrive of its job, oldest first', [
      ['When', (e) => fmtTime(e.at)],
      ['Who', (e) => dash(e.actor)],
      ['From group', (e) => (e.from_group ? groupLink(e.from_group) : '—')],
      ['Edited', (e) => (e.payload_edited ? 'payload edited' : 'no')],
      ['Sent to', (e) => (e.to ? [e.to.type ? `type ${e.to.type} ` : '', e.to.lane ? `lane ${e.to.lane}` : ''] : 'where it was')],
      ['Ended', (e) => ended(e.outcome || {})],
      ['Report', (e) => (e.redrive_id ? el('a', { href: `#/redrive/${encodeURIComponent(e.redrive_id)}` }, 'redrive report') : '—')],
    ], lineage, 'Never redriven.');
  }

  /** What the page says of a binary payload's preview (null for text). */
  function binaryNote(binary, size) {
    return binary
      ? `A binary payload of ${fmtBytes(size)}: its first bytes are shown as text, with \uFFFD for bytes that are not text; download it for the bytes themselves.`
      : null;
  }

  async function deadLetter(id) {
    showView('dead-letter');
    const body = $('dle-body');
    body.replaceChildren(el('p', { class: 'muted' }, 'Loading…'));
    const d = await api('GET', `/v1/dead-letters/${encodeURIComponent(id)}`);
    $('dle-h').textContent = `Dead letter ${d.id}: ${d.reason}`;
    $('dle-back').href = d.group_id
      ? `#/dead-letters/list${query({ group: d.group_id, archived: d.archived ? 'true' : '' })}`
      : `#/dead-letters/list${query({ reason: d.reason, type: d.type })}`;
    $('dle-back').textContent = '← Dead letters';
    const preview = d.payload_preview || '';
    const previewBytes = new TextEncoder().encode(preview).length;
    // A binary payload's preview is its text, with U+FFFD for what is not:
    // never the payload itself, so never edited from it.
    const binary = d.payload_binary === true;
    const whole = !binary && previewBytes >= d.payload_size;
    const src = d.source;
    const parts = [];
    parts.push(facts([
      ['Reason', el('code', {}, d.reason)],
      ['Stage', d.stage],
      ['Type', dash(d.type)],
      ['Tenant', dash(d.tenant)],
      ['Lane', dash(d.lane)],
      ['Job', d.job_id && !src ? el('a', { href: `#/job/${encodeURIComponent(d.job_id)}` }, `job ${d.job_id}`) : '—'],
      ['Attempts', String(d.attempts)],
      ['Redrives so far', String(d.redrive_count ?? 0)],
      ['Idempotency key', dash(d.idempotency_key)],
      ['Created', fmtTime(d.created_at)],
      ['Dead-lettered', fmtTime(d.dead_lettered_at)],
      ['Payload', `${fmtBytes(d.payload_size)}${d.payload_sha256 ? `, SHA-256 ${d.payload_sha256}` : ''}`],
    ]));
    if (d.held === true) {
      parts.push(el('p', { id: 'dle-held' }, badge('held for a person', 'warn'),
        ' It failed again after too many redrives: redrives by filter skip it; redrive it by its id once the cause is fixed.'));
    }
    if (src) {
      parts.push(el('h3', {}, 'Broker message'), facts([
        ['Source', `${src.name} (${src.broker})`],
        ['Queue', src.queue],
        ['Message id', src.message_id],
        ['Position', JSON.stringify(src.position)],
        ['Content type', dash(src.content_type)],
      ]));
      if (d.celery) {
        parts.push(el('h3', {}, 'Celery task'), facts([
          ['Task', d.celery.task],
          ['Task id', d.celery.id],
          ['Retries', dash(d.celery.retries)],
        ]), el('pre', { class: 'payload' }, JSON.stringify(d.celery.arguments, null, 2)));
      }
    }
    const err = d.error;
    parts.push(el('h3', {}, 'Error'));
    parts.push(err
      ? [facts([['Kind', el('code', {}, err.kind)], ['Class', dash(err.class)]]),
        el('pre', { class: 'message' }, err.message || ''),
        err.traceback ? el('details', { open: true }, el('summary', {}, 'Traceback'), el('pre', { class: 'traceback' }, err.traceback)) : '']
      : el('p', { class: 'muted' }, 'No error was recorded.'));
    parts.push(el('h3', {}, 'Attempts'), historyTable(d.history));
    if (Array.isArray(d.lineage)) parts.push(el('h3', {}, 'Lineage'), lineageTable(d.lineage));

    parts.push(el('h3', {}, 'Payload'));
    parts.push(el('p', { class: 'muted' }, binaryNote(binary, d.payload_size) || (whole
      ? `The whole payload (${fmtBytes(d.payload_size)}).`
      : `The first ${fmtBytes(previewBytes)} of ${fmtBytes(d.payload_size)}; the rest is not loaded.`)));
    parts.push(el('pre', { class: 'payload', id: 'payload-preview', tabindex: '0', 'aria-label': 'Payload preview' }, preview));
    if (d.payload_sha256 !== null || d.stage !== 'admission') {
      parts.push(el('p', {}, el('button', {
        type: 'button',
        onclick: () => download(`/v1/dead-letters/${encodeURIComponent(d.id)}/payload`, `dead-letter-${d.id}.payload`).catch(showError),
      }, `Download the whole payload (${fmtBytes(d.payload_size)})`)));
    }

    const redrivable = d.stage !== 'admission';
    const actions = el('div', { id: 'dle-confirm' });
    if (may('operate') && redrivable) {
      parts.push(el('h3', {}, 'Redrive'));
      parts.push(el('p', { class: 'actions' },
        el('button', { type: 'button', onclick: () => redriveFlow({ ids: [d.id] }, `dead letter ${d.id} as it is`, actions).catch(showError) }, 'Redrive as it is…')));
    }
    if (may('administer')) {
      parts.push(el('p', { class: 'actions' },
        el('button', { type: 'button', class: 'danger', onclick: () => purgeFlow({ ids: [d.id] }, 1, actions, async () => { location.hash = $('dle-back').getAttribute('href'); }).catch(showError) }, 'Purge…')));
    }
    parts.push(actions);
    if (may('operate') && redrivable) parts.push(editForm(d, preview, whole));
    body.replaceChildren(...parts.flat());
    $('dle-h').focus();
  }

  /** Correct the payload and redrive: POST /v1/dead-letters/{id}/redrive with the operator's exact text. */
  function editForm(d, preview, whole) {
    const area = el('textarea', { id: 'edit-payload', rows: '10', spellcheck: 'false', 'aria-describedby': 'edit-help edit-error' });
    const why = el('input', { id: 'edit-reason', 'aria-required': 'true', maxlength: '1024' });
    const errorP = el('p', { id: 'edit-error', class: 'warn', 'aria-live': 'polite' });
    const result = el('div', { id: 'edit-result' });
    const loadButton = el('button', { type: 'button' }, `Load the whole payload to edit (${fmtBytes(d.payload_size)})`);
    const form = el('form', { class: 'edit', id: 'edit-form' },
      el('h3', {}, 'Correct the payload and redrive'),
      el('p', { id: 'edit-help', class: 'muted' }, 'The corrected payload is checked like a new enqueue (size cap, schema). The job keeps its id and idempotency key; the payload it had stays readable in its history; the audit log records that it was edited, by you and why.'),
      el('label', { for: 'edit-payload' }, 'Corrected payload (JSON)'), area,
      el('label', { for: 'edit-reason' }, 'Why (kept in the audit log)'), why,
      errorP,
      el('p', { class: 'actions' }, el('button', { type: 'submit', class: 'primary' }, 'Check and redrive…')),
      result);
    if (whole) {
      area.value = prettyIfJson(preview);
    } else if (d.payload_size <= EDIT_BYTES_MAX) {
      area.disabled = true;
      area.value = '';
      loadButton.addEventListener('click', async () => {
        try {
          const resp = await fetch(`/v1/dead-letters/${encodeURIComponent(d.id)}/payload`, { headers: headers({ Accept: '*/*' }), credentials: 'omit', cache: 'no-store' });
          if (!resp.ok) throw new ApiError(resp.status, `HTTP_${resp.status}`, 'the payload could not be read');
          area.value = prettyIfJson(await resp.text());
          area.disabled = false;
          loadButton.remove();
          area.focus();
        } catch (e) { showError(e); }
      });
      form.insertBefore(el('p', {}, loadButton), area);
    } else {
      area.disabled = true;
      form.insertBefore(el('p', { class: 'muted' }, `At ${fmtBytes(d.payload_size)} this payload is too large to edit here; send the corrected one with POST /v1/dead-letters/${d.id}/redrive.`), area);
    }
    form.addEventListener('submit', (ev) => {
      ev.preventDefault();
      errorP.textContent = '';
      const text = area.value;
      try {
        JSON.parse(text);
      } catch (e) {
        errorP.textContent = `The corrected payload is not valid JSON: ${e.message}`;
        area.focus();
        return;
      }
      if (!why.value.trim()) {
        errorP.textContent = 'Say why the payload was corrected: the audit log keeps it.';
        why.focus();
        return;
      }
      const bytes = new TextEncoder().encode(text).length;
      confirmPanel(result, {
        title: `Redrive dead letter ${d.id} with the corrected payload?`,
        body: [el('p', {}, `${fmtBytes(bytes)} replaces ${fmtBytes(d.payload_size)}. Reason: “${why.value.trim()}”.`)],
        confirmLabel: 'Redrive with this payload',
        onConfirm: async () => {
          // The payload goes as the operator wrote it: its bytes are what the worker gets.
          const reqBody = `{"payload":${text},"reason":${JSON.stringify(why.value.trim())}}`;
          const done = await api('POST', `/v1/dead-letters/${encodeURIComponent(d.id)}/redrive`, reqBody);
          result.replaceChildren(el('div', { class: 'result', role: 'status' },
            el('p', {}, done.job_id ? ['Redriven with the corrected payload: ', el('a', { href: `#/job/${done.job_id}` }, `job ${done.job_id}`)] : `Republished with the corrected body to source ${done.source}.`),
            done.warning ? el('p', { class: 'warn' }, done.warning) : ''));
          flash(done.job_id ? `Redriven with the corrected payload as job ${done.job_id}.` : 'Republished with the corrected body.');
        },
      });
    });
    return form;
  }

  function prettyIfJson(text) {
    try {
      return JSON.stringify(JSON.parse(text), null, 2);
    } catch (_) {
      return text;
    }
  }

  // ---------------------------------------------------------------- jobs

  const LIVE = ['queued', 'scheduled', 'leased'];

  async function cancelJob(id, container, after) {
    confirmPanel(container, {
      title: `Cancel job ${id}?`,
      danger: true,
      body: [el('p', {}, 'A queued or scheduled job is never leased again; a leased one is asked to stop and ends cancelled at its outcome. The cancel is audited.')],
      confirmLabel: `Cancel job ${id}`,
      onConfirm: async () => {
        const r = await api('POST', `/v1/jobs/${encodeURIComponent(id)}/cancel`, {});
        container.replaceChildren(el('p', { class: 'result', role: 'status' }, r.cancel_requested ? `Job ${id} is leased: cancel requested.` : `Job ${id}: ${r.state}.`));
        // Kept through the refresh that follows, which would clear it.
        flash(`Job ${id}: ${r.state}${r.cancel_requested ? ', cancel requested' : ''}.`, true);
        if (after) await after();
      },
    });
  }

  async function jobs(params, cursor) {
    showView('jobs');
    const form = $('jobs-form');
    const filters = {};
    for (const k of ['state', 'type', 'tenant', 'lane']) {
      if (params && params.has(k)) form.elements[k].value = params.get(k);
      filters[k] = form.elements[k].value;
    }
    const list = $('jobs-list');
    let page;
    try {
      // Previews only: a page of large payloads is never loaded whole.
      page = await api('GET', `/v1/jobs${query({ ...filters, limit: 50, cursor, payload: 'preview' })}`);
    } catch (e) {
      if (e.status === 404 || e.status === 405) {
        list.replaceChildren(el('p', { class: 'warn' }, `This server cannot list live jobs (GET /v1/jobs answered ${e.status} ${e.code}): it is older than the dashboard. One job can still be opened by id from a dead letter.`));
        return;
      }
      throw e;
    }
    if (!cursor) list.replaceChildren();
    const confirmBox = el('div');
    list.append(confirmBox, table('Jobs, newest first', [
      ['Job', (j) => el('a', { href: `#/job/${encodeURIComponent(j.id)}` }, `job ${j.id}`)],
      ['Type', (j) => el('code', {}, j.type)],
      ['Tenant', (j) => j.tenant],
      ['Lane', (j) => j.lane],
      ['State', (j) => badge(j.state, j.state)],
      ['Attempt', (j) => String(j.attempt)],
      ['Created', (j) => fmtTime(j.created_at)],
      ['Runs at', (j) => fmtTime(j.run_at)],
      ['', (j) => (may('cancel') && LIVE.includes(j.state)
        ? el('button', { type: 'button', onclick: () => cancelJob(j.id, confirmBox, () => jobs(null)) }, `Cancel job ${j.id}`)
        : '')],
    ], page.items || [], 'No job matches.'));
    if (page.next_cursor) {
      const more = el('button', { type: 'button' }, 'Load more');
      more.addEventListener('click', () => { more.remove(); jobs(null, page.next_cursor).catch(showError); });
      list.append(el('p', {}, more));
    }
  }

  async function job(id) {
    // The job view reuses the dead-letter section's layout.
    showView('dead-letter', 'jobs');
    const body = $('dle-body');
    // The payload's first 4 KiB, never all of it; the rest is a download.
    const j = await api('GET', `/v1/jobs/${encodeURIComponent(id)}${query({ payload: 'preview' })}`);
    $('dle-h').textContent = `Job ${j.id}: ${j.state}`;
    // A worker reads one job but may not list them.
    $('dle-back').href = may('list_jobs') ? '#/jobs' : '#/overview';
    $('dle-back').textContent = may('list_jobs') ? '← Live jobs' : '← Overview';
    // A server without `?payload=preview` sends the whole payload: cut it here.
    const preview = j.payload_preview !== undefined ? j.payload_preview : cut(JSON.stringify(j.payload), previewBytesMax());
    const previewBytes = new TextEncoder().encode(preview).length;
    const binary = j.payload_binary === true;
    const whole = !binary && previewBytes >= j.payload_size;
    const confirmBox = el('div');
    const parts = [
      el('p', { id: 'job-state' }, 'State: ', badge(j.state, j.state)),
      facts([
        ['Type', el('code', {}, j.type)],
        ['Tenant', j.tenant],
        ['Lane', j.lane],
        ['Attempt', String(j.attempt)],
        ['Redrives', String(j.redrive_count ?? 0)],
        ['Idempotency key', dash(j.idempotency_key)],
        ['Created', fmtTime(j.created_at)],
        ['Runs at', fmtTime(j.run_at)],
        ['Dead letter', j.dead_letter_id ? el('a', { href: `#/dead-letter/${encodeURIComponent(j.dead_letter_id)}` }, `dead letter ${j.dead_letter_id}`) : '—'],
      ]),
      may('cancel') && LIVE.includes(j.state) ? el('p', {}, el('button', { type: 'button', onclick: () => cancelJob(j.id, confirmBox, () => job(id)) }, 'Cancel…')) : '',
      confirmBox,
      el('h3', {}, 'Attempts'), historyTable(j.history),
      el('h3', {}, 'Payload'),
      el('p', { class: 'muted' }, binaryNote(binary, j.payload_size) || (whole
        ? `The whole payload (${fmtBytes(j.payload_size)}).`
        : `The first ${fmtBytes(previewBytes)} of ${fmtBytes(j.payload_size)}; the rest is not loaded.`)),
      el('pre', { class: 'payload', id: 'job-payload-preview', tabindex: '0', 'aria-label': 'Payload preview' }, whole ? prettyIfJson(preview) : preview),
      el('p', {}, el('button', {
        type: 'button',
        onclick: () => download(`/v1/jobs/${encodeURIComponent(j.id)}/payload`, `job-${j.id}.payload`).catch(showError),
      }, `Download the whole payload (${fmtBytes(j.payload_size)})`)),
    ];
    const edits = j.payload_edits || [];
    if (edits.length) {
      parts.push(el('h3', {}, 'Payload edits'), el('ol', { class: 'edits' }, edits.map((e) => el('li', {},
        el('p', {}, fmtTime(e.at), ` by ${e.actor} (redrive ${e.redrive}): “${e.reason}”`),
        el('details', {}, el('summary', {}, `The payload it replaced (${fmtBytes(e.previous_payload_size)}${e.previous_payload_size > previewBytesMax() ? `; its first ${fmtBytes(previewBytesMax())}` : ''})`),
          el('pre', { class: 'payload' }, e.previous_payload_preview !== undefined
            ? e.previous_payload_preview
            : cut(JSON.stringify(e.previous_payload), previewBytesMax())))))));
    }
    $('dle-body').replaceChildren(...parts);
    if (LIVE.includes(j.state) && !state.timer) {
      state.timer = setInterval(() => {
        if (!document.hidden && location.hash === `#/job/${id}`) {
          clearInterval(state.timer);
          state.timer = null;
          job(id).catch(showError);
        }
      }, 1000);
    }
    body.setAttribute('data-state', j.state);
  }

  // ---------------------------------------------------------------- breakers

  /** The breakers that are not closed, all or of `?type=` (where the breaker alerts link). */
  async function breakersView(params) {
    showView('breakers');
    const only = params.get('type');
    const all = (await api('GET', '/v1/breakers')).breakers || [];
    const rows = all.filter((b) => !only || b.type === only);
    $('breakers-filter').replaceChildren(only
      ? el('p', {}, `Showing type ${only} only. `, el('a', { href: '#/breakers' }, 'Show every type'))
      : '');
    $('breakers-list').replaceChildren(
      table(
        only ? `Breakers of ${only} that are not closed` : 'Breakers that are not closed',
        [
          ['Type', (b) => el('code', {}, b.type)],
          ['Error kind', (b) => el('code', {}, b.kind)],
          ['State', (b) => badge(b.state, b.state === 'open' ? 'bad' : 'warn')],
          ['Until', (b) => fmtTime(b.until)],
          ['', (b) => (may('read_dead_letters')
            ? el('a', { href: `#/dead-letters${query({ type: b.type })}` }, `Dead letters of ${b.type}`)
            : '')],
        ],
        rows,
        only
          ? `No breaker of ${only} is open or half-open: it is closed (a probe succeeded, or it never opened).`
          : 'Every breaker is closed.',
      ),
      el('p', { class: 'muted' }, 'An open breaker parks its type\'s jobs (no attempts spent) until it half-opens; then one probe decides whether it closes.'),
    );
  }

  // ---------------------------------------------------------------- audit

  async function audit(params, cursor) {
    showView('audit');
    const form = $('audit-form');
    if (params) {
      for (const k of ['action', 'actor']) if (params.has(k)) form.elements[k].value = params.get(k);
    }
    const page = await api('GET', `/v1/audit${query({ action: form.elements.action.value, actor: form.elements.actor.value, limit: 50, cursor })}`);
    const list = $('audit-list');
    if (!cursor) list.replaceChildren();
    list.append(table('Audit log, newest first', [
      ['At', (a) => fmtTime(a.at)],
      ['Actor', (a) => a.actor],
      ['Action', (a) => [badge(a.action, a.action === 'denied' ? 'bad' : ''),
        a.redrive_id ? [' ', el('a', { href: `#/redrive/${encodeURIComponent(a.redrive_id)}` }, 'report')] : '']],
      ['Count', (a) => String(a.count)],
      ['Request', (a) => {
        const text = JSON.stringify(a.request);
        return text.length > CELL_CHARS_MAX
          ? el('details', {}, el('summary', {}, cut(text, CELL_CHARS_MAX)), el('pre', {}, JSON.stringify(a.request, null, 2)))
          : el('code', {}, text);
      }],
    ], page.items || [], 'The audit log is empty.'));
    if (page.next_cursor) {
      const more = el('button', { type: 'button' }, 'Load more');
      more.addEventListener('click', () => { more.remove(); audit(null, page.next_cursor).catch(showError); });
      list.append(el('p', {}, more));
    }
  }

  // ---------------------------------------------------------------- wiring

  document.addEventListener('DOMContentLoaded', async () => {
    $('login-form').addEventListener('submit', async (ev) => {
      ev.preventDefault();
      clearError();
      sessionStorage.setItem(TOKEN_KEY, $('token').value.trim());
      $('token').value = '';
      if (await signIn()) {
        if (!location.hash || location.hash === '#/login') location.hash = '#/overview';
        else await route();
      }
    });
    $('logout').addEventListener('click', () => {
      sessionStorage.removeItem(TOKEN_KEY);
      state.who = null;
      $('who').hidden = true;
      $('nav').hidden = true;
      flash('Signed out.', true);
      route();
    });
    $('overview-refresh').addEventListener('click', () => overview().catch(showError));
    for (const id of ['charts-1h', 'charts-24h']) {
      $(id).addEventListener('click', (ev) => {
        state.chartWindow = ev.currentTarget.dataset.window;
        overview().catch(showError);
      });
    }
    $('pause-form').addEventListener('submit', (ev) => {
      ev.preventDefault();
      const f = ev.target.elements;
      pauseResume(true, f.kind.value, f.name.value.trim()).then(() => { f.name.value = ''; }, showError);
    });
    $('groups-form').addEventListener('submit', (ev) => {
      ev.preventDefault();
      // The filters go into the hash: a filtered view can be linked to.
      const f = ev.target.elements;
      const filters = { archived: f.archived.checked ? 'true' : '' };
      for (const k of ['type', 'reason', 'source', 'tenant', 'since']) filters[k] = f[k].value.trim();
      const hash = `#/dead-letters${query(filters)}`;
      if (location.hash === hash) route(); else location.hash = hash;
    });
    $('jobs-form').addEventListener('submit', (ev) => {
      ev.preventDefault();
      jobs(null).catch(showError);
    });
    $('audit-form').addEventListener('submit', (ev) => {
      ev.preventDefault();
      audit(null).catch(showError);
    });
    window.addEventListener('hashchange', route);
    if (await signIn()) await route();
  });
})();
