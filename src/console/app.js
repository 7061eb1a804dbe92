// The agentd web console: one ES module, no dependencies, served from the binary.
// Sign in with a tenant token (kept in sessionStorage); runs list, run page (live timeline
// over SSE with resume, transcript, approvals, cancel, input), the approvals inbox.
// Every value from the API is inserted as text (never as HTML).

const TOKEN_KEY = 'agentd.token';
const TERMINAL = new Set(['succeeded', 'failed', 'cancelled']);
const TERMINAL_EVENTS = new Set(['run_succeeded', 'run_failed', 'run_cancelled']);
const STATUSES = ['created', 'running', 'waiting_approval', 'waiting_input', 'succeeded', 'failed', 'cancelled'];
const POLL_MS = 2000;

const main = document.getElementById('main');
let view = new AbortController(); // aborted when the page changes: stops polls and streams

// ---- small helpers ----------------------------------------------------------------------

function h(tag, attrs = {}, ...children) {
  const el = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (v === undefined || v === null || v === false) continue;
    if (k.startsWith('on')) el.addEventListener(k.slice(2), v);
    else if (k === 'class') el.className = v;
    else el.setAttribute(k, v === true ? '' : v);
  }
  for (const c of children.flat()) {
    if (c === undefined || c === null || c === false) continue;
    el.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return el;
}

const token = () => sessionStorage.getItem(TOKEN_KEY);
const sleep = (ms, signal) => new Promise((resolve) => {
  const t = setTimeout(resolve, ms);
  signal?.addEventListener('abort', () => { clearTimeout(t); resolve(); }, { once: true });
});
const short = (v, n = 120) => {
  const s = typeof v === 'string' ? v : JSON.stringify(v);
  return s && s.length > n ? s.slice(0, n - 1) + '…' : (s ?? '');
};
const status = (s) => h('span', { class: `status ${s}`, 'data-status': s }, s.replace('_', ' '));
const when = (t) => (t ? new Date(t).toLocaleTimeString() : '');

class ApiError extends Error {
  constructor(httpStatus, code, message) { super(`${code}: ${message}`); this.httpStatus = httpStatus; this.code = code; }
}

async function api(method, path, body, signal) {
  const headers = { Authorization: `Bearer ${token()}` };
  if (body !== undefined) headers['Content-Type'] = 'application/json';
  const res = await fetch(path, { method, headers, body: body === undefined ? undefined : JSON.stringify(body), signal });
  const data = await res.json().catch(() => null);
  if (!res.ok) {
    if (res.status === 401) signOut();
    throw new ApiError(res.status, data?.error?.code ?? 'http_error', data?.error?.message ?? res.statusText);
  }
  return data;
}

function flash(el, err) {
  el.replaceChildren(h('span', { class: 'error', role: 'alert' }, err.message ?? String(err)));
}

/// Calls `fn` now and every POLL_MS until the view changes.
async function poll(fn) {
  const { signal } = view;
  while (!signal.aborted) {
    try { await fn(signal); } catch (e) { if (signal.aborted) return; console.warn(e); }
    await sleep(POLL_MS, signal);
  }
}

// ---- SSE over fetch (EventSource cannot send the Authorization header) --------------------

/// Follows a run's events from `after`, calling `onEvent` once per event in order; on a
/// dropped connection it resumes with Last-Event-ID. Ends after the terminal event.
async function follow(id, after, onEvent, signal, onState) {
  let last = after;
  for (let attempt = 0; !signal.aborted; attempt++) {
    try {
      const headers = { Authorization: `Bearer ${token()}`, Accept: 'text/event-stream' };
      if (last > 0) headers['Last-Event-ID'] = String(last);
      const res = await fetch(`/v1/runs/${encodeURIComponent(id)}/events`, { headers, signal });
      if (!res.ok) throw new ApiError(res.status, 'stream', res.statusText);
      onState?.(true);
      attempt = 0;
      const reader = res.body.pipeThrough(new TextDecoderStream()).getReader();
      let buf = '';
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buf += value.replace(/\r\n/g, '\n');
        let cut;
        while ((cut = buf.indexOf('\n\n')) >= 0) {
          const frame = buf.slice(0, cut);
          buf = buf.slice(cut + 2);
          const data = frame.split('\n').filter((l) => l.startsWith('data:')).map((l) => l.slice(5).replace(/^ /, '')).join('\n');
          if (!data) continue;
          const e = JSON.parse(data);
          if (e.seq <= last) continue;
          last = e.seq;
          onEvent(e);
          if (TERMINAL_EVENTS.has(e.type)) { onState?.(false); return; }
        }
      }
    } catch (err) {
      if (signal.aborted) return;
      if (err instanceof ApiError && err.httpStatus === 404) return;
    }
    onState?.(false);
    await sleep(Math.min(500 * (attempt + 1), 3000), signal);
  }
}

// ---- pages ------------------------------------------------------------------------------

function signIn() {
  document.getElementById('nav').hidden = true;
  const input = h('input', { id: 'token', type: 'password', placeholder: 'tenant token', size: 48, autocomplete: 'off', required: true });
  const msg = h('p');
  const form = h('form', {
    class: 'card',
    onsubmit: async (ev) => {
      ev.preventDefault();
      const candidate = input.value.trim();
      try {
        const res = await fetch('/v1/agents', { headers: { Authorization: `Bearer ${candidate}` } });
        if (res.status === 401) throw new Error('That token is not known.');
        if (!res.ok) throw new Error(`The daemon answered ${res.status}.`);
        sessionStorage.setItem(TOKEN_KEY, candidate);
        route();
      } catch (e) {
        flash(msg, e);
      }
    },
  },
  h('h1', {}, 'Sign in'),
  h('p', { class: 'muted' }, 'Paste your tenant token (the demo prints it as AGENTD_TOKEN). It stays in this tab only.'),
  h('div', { class: 'row' }, input, h('button', { class: 'primary', type: 'submit', id: 'sign-in' }, 'Sign in')),
  msg);
  main.replaceChildren(form);
  input.focus();
}

function signOut() {
  sessionStorage.removeItem(TOKEN_KEY);
  location.hash = '#/runs';
  route();
}

async function runsPage(params) {
  const statusSel = h('select', { id: 'filter-status' }, h('option', { value: '' }, 'any status'), STATUSES.map((s) => h('option', { value: s }, s)));
  const agentSel = h('select', { id: 'filter-agent' }, h('option', { value: '' }, 'any agent'));
  statusSel.value = params.get('status') ?? '';
  const body = h('tbody');
  const msg = h('p');
  const apply = () => {
    const q = new URLSearchParams();
    if (statusSel.value) q.set('status', statusSel.value);
    if (agentSel.value) q.set('agent', agentSel.value);
    location.hash = `#/runs${q.size ? '?' + q : ''}`;
  };
  statusSel.onchange = apply;
  agentSel.onchange = apply;
  main.replaceChildren(
    h('h1', {}, 'Runs ', h('span', { class: 'muted live' }, 'live')),
    h('div', { class: 'filters' }, statusSel, agentSel),
    h('table', { id: 'runs' }, h('thead', {}, h('tr', {}, ['Run', 'Agent', 'Status', 'Turn', 'Input', 'Updated'].map((t) => h('th', {}, t)))), body),
    msg,
  );
  api('GET', '/v1/agents', undefined, view.signal).then(({ agents }) => {
    for (const a of agents) agentSel.append(h('option', { value: a.name }, a.name));
    agentSel.value = params.get('agent') ?? '';
  }).catch(() => {});
  const q = new URLSearchParams({ limit: '50' });
  for (const k of ['status', 'agent']) if (params.get(k)) q.set(k, params.get(k));
  poll(async (signal) => {
    const { runs } = await api('GET', `/v1/runs?${q}`, undefined, signal);
    body.replaceChildren(...runs.map((r) => h('tr', { 'data-run': r.id },
      h('td', {}, h('a', { href: `#/runs/${r.id}`, class: 'mono' }, r.id)),
      h('td', {}, r.agent), h('td', {}, status(r.status)), h('td', {}, r.turn),
      h('td', {}, short(r.input, 60)), h('td', { class: 'muted' }, when(r.updated_at)))));
    msg.replaceChildren(runs.length ? '' : h('span', { class: 'muted' }, 'No runs yet.'));
  });
}

async function newRunPage() {
  const agentSel = h('select', { id: 'new-agent', required: true });
  const input = h('textarea', { id: 'new-input', placeholder: 'the goal, e.g. what is 20 + 22?', required: true });
  const msg = h('p');
  main.replaceChildren(h('form', {
    class: 'card',
    onsubmit: async (ev) => {
      ev.preventDefault();
      try {
        const run = await api('POST', '/v1/runs', { agent: agentSel.value, input: input.value });
        location.hash = `#/runs/${run.id}`;
      } catch (e) { flash(msg, e); }
    },
  }, h('h1', {}, 'New run'), h('div', { class: 'row' }, h('label', {}, 'Agent ', agentSel)), input,
  h('div', { class: 'row' }, h('button', { class: 'primary', type: 'submit', id: 'start' }, 'Start')), msg));
  const { agents } = await api('GET', '/v1/agents');
  for (const a of agents) agentSel.append(h('option', { value: a.name }, `${a.name} (${a.tools.map((t) => t.name).join(', ') || 'no tools'})`));
}

function describe(e) {
  const d = e.data ?? {};
  switch (e.type) {
    case 'run_created': return `created (agent ${d.agent})`;
    case 'run_started': return `started · turn ${d.turn}`;
    case 'model_replied':
      if (d.decision === 'tool_calls') return `model calls ${(d.calls ?? []).map((c) => `${c.tool}(${short(c.arguments, 80)}) [${c.call_id}]`).join(', ')}`;
      if (d.decision === 'final') return 'model proposed a final answer; verifying';
      return `model replied (${d.decision ?? '?'})`;
    case 'tool_call_finished': return d.ok ? `tool ${d.tool} [${d.call_id}] ok` : `tool ${d.tool} [${d.call_id}] error ${d.error?.code}: ${d.error?.message}`;
    case 'call_approved': return `call ${d.call_id} approved${d.edited ? ' with edited arguments' : ''}`;
    case 'call_rejected': return `call ${d.call_id} rejected`;
    case 'input_requested': return `model asks: ${d.question}`;
    case 'input_received': return 'input received';
    case 'run_succeeded': return `succeeded: ${short(d.output, 200)}`;
    case 'run_failed': return `failed: ${d.error?.code}: ${d.error?.message}`;
    case 'run_cancelled': return d.reason ? `cancelled (${d.reason})` : 'cancelled';
    default: return e.type.replace(/_/g, ' ');
  }
}

/// The conversation as the events tell it: the goal, the model's calls and answers, the tool
/// results, questions and answers.
function transcriptEntries(run, events) {
  const out = [['user', short(run.input, 2000)]];
  for (const e of events) {
    const d = e.data ?? {};
    if (e.type === 'model_replied' && d.decision === 'tool_calls') out.push(['assistant', (d.calls ?? []).map((c) => `→ ${c.tool}(${JSON.stringify(c.arguments)})`).join('\n')]);
    else if (e.type === 'tool_call_finished') out.push([`tool ${d.tool}`, d.ok ? short(d.data ?? d.result ?? 'ok', 2000) : `error ${d.error?.code}: ${d.error?.message}`]);
    else if (e.type === 'call_rejected') out.push(['operator', `rejected ${d.call_id}${d.reason ? ': ' + d.reason : ''}`]);
    else if (e.type === 'input_requested') out.push(['assistant', `asks: ${d.question}`]);
    else if (e.type === 'input_received') out.push(['user', short(d.text ?? 'input received', 2000)]);
    else if (e.type === 'run_succeeded') out.push(['assistant', short(d.output, 4000)]);
  }
  return out;
}

async function runPage(id) {
  const { signal } = view;
  const head = h('div', { class: 'card', id: 'run-head' });
  const actions = h('div', { id: 'run-actions' });
  const timeline = h('ol', { class: 'timeline', id: 'timeline' });
  const transcript = h('div', { id: 'transcript' });
  const live = h('span', { class: 'muted' });
  main.replaceChildren(h('h1', {}, 'Run ', h('span', { class: 'mono' }, id)), head, actions,
    h('div', { class: 'grid' },
      h('section', { class: 'card' }, h('h2', {}, 'Timeline ', live), timeline),
      h('section', { class: 'card' }, h('h2', {}, 'Transcript'), transcript)));
  const events = [];
  let run = null;
  let refreshing = null;
  const render = () => {
    if (!run) return;
    head.replaceChildren(h('dl', {},
      h('dt', {}, 'status'), h('dd', { id: 'run-status' }, status(run.status), run.phase ? h('span', { class: 'muted' }, ` ${run.phase}`) : ''),
      h('dt', {}, 'agent'), h('dd', {}, run.agent),
      h('dt', {}, 'input'), h('dd', {}, h('pre', {}, short(run.input, 2000))),
      h('dt', {}, 'usage'), h('dd', {}, `${run.usage.turns} turns · ${run.usage.tool_calls} tool calls · ${run.usage.input_tokens} in / ${run.usage.output_tokens} out tokens`),
      run.output !== null && run.output !== undefined ? [h('dt', {}, 'output'), h('dd', { id: 'run-output' }, h('pre', {}, short(run.output, 4000)))] : [],
      run.error ? [h('dt', {}, 'error'), h('dd', { class: 'error' }, `${run.error.code}: ${run.error.message}`)] : [],
      run.ending ? [h('dt', {}, 'ending'), h('dd', { id: 'run-ending' }, `${run.ending.status} once its compensations are over`)] : [],
      (run.compensations || []).length ? [h('dt', {}, 'compensations'), h('dd', { id: 'run-compensations' }, h('ul', {}, ...run.compensations.map((k) => h('li', { 'data-status': k.status },
        `${k.tool} [${k.call_id}] undoes ${k.for_tool} [${k.for_call}]: ${k.status}`,
        k.error ? h('span', { class: 'error' }, ` ${k.error.code}: ${k.error.message}`) : '',
        k.reason ? h('span', { class: 'muted' }, ` (${k.reason})`) : ''))))] : [],
      h('dt', {}, 'updated'), h('dd', { class: 'muted' }, run.updated_at)));
    actions.replaceChildren(...controls(run, refresh));
    transcript.replaceChildren(...transcriptEntries(run, events).map(([who, text]) => h('div', { class: 'msg' }, h('div', { class: 'who' }, who), h('pre', {}, text))));
  };
  // One read at a time; an event that arrives during a read asks for one more read after it,
  // so the page always ends on the run's latest state.
  let again = false;
  const refresh = async () => {
    if (refreshing) { again = true; return refreshing; }
    refreshing = (async () => {
      do {
        again = false;
        try { run = await api('GET', `/v1/runs/${encodeURIComponent(id)}`, undefined, signal); render(); }
        catch (e) { if (!signal.aborted) flash(head, e); return; }
      } while (again && !signal.aborted);
    })().finally(() => { refreshing = null; });
    return refreshing;
  };
  await refresh();
  if (!run) return;
  follow(id, 0, (e) => {
    events.push(e);
    timeline.append(h('li', { 'data-type': e.type }, h('span', { class: 'muted' }, e.seq), h('span', { class: 'muted' }, when(e.at)), describe(e)));
    timeline.scrollTop = timeline.scrollHeight;
    refresh();
  }, signal, (on) => { live.className = on ? 'muted live' : 'muted'; live.textContent = on ? 'live' : ''; });
}

/// The note shown with a waiting call, by why it waits.
const WAIT_NOTES = {
  outcome_unknown: ' — outcome unknown after a crash',
  tool_failing: ' — its tool keeps failing (approve: retry, reject: skip)',
  permission_error: ' — its tool refused it (401/403)',
};

/// Buttons for what the run allows now: approve/reject/fail (with editable arguments), input, cancel.
function controls(run, refresh) {
  const out = [];
  const path = `/v1/runs/${encodeURIComponent(run.id)}`;
  if (run.status === 'waiting_approval') {
    for (const p of run.pending_approvals) {
      const args = h('textarea', { class: 'approval-arguments', 'aria-label': `arguments of ${p.call_id}` }, JSON.stringify(p.arguments, null, 2));
      const reason = h('input', { class: 'approval-reason', placeholder: 'reason (optional)', size: 30 });
      const msg = h('span');
      const decide = async (decision) => {
        const body = { decision };
        if (reason.value) body.reason = reason.value;
        if (decision === 'approve') {
          try {
            const edited = JSON.parse(args.value);
            if (JSON.stringify(edited) !== JSON.stringify(p.arguments)) body.arguments = edited;
          } catch { flash(msg, new Error('The arguments are not valid JSON.')); return; }
        }
        try { await api('POST', `${path}/approvals/${encodeURIComponent(p.call_id)}`, body); await refresh(); } catch (e) { flash(msg, e); }
      };
      out.push(h('div', { class: 'card approval', 'data-call': p.call_id },
        h('h2', {}, `Waiting for approval: ${p.tool} [${p.call_id}]`, WAIT_NOTES[p.reason] ? h('span', { class: 'error' }, WAIT_NOTES[p.reason]) : ''),
        args,
        h('div', { class: 'row' },
          h('button', { class: 'primary approve', onclick: () => decide('approve') }, 'Approve'),
          h('button', { class: 'danger reject', onclick: () => decide('reject') }, 'Reject'),
          h('button', { class: 'danger fail', onclick: () => decide('fail') }, 'Fail run'),
          reason, msg)));
    }
  }
  if (run.status === 'waiting_input' || (!TERMINAL.has(run.status) && run.status !== 'waiting_approval')) {
    const text = h('input', { id: 'input-text', placeholder: run.awaiting_input ? 'your answer' : 'input for the next turn', size: 40 });
    const msg = h('span');
    out.push(h('form', {
      class: 'card',
      onsubmit: async (ev) => {
        ev.preventDefault();
        try { await api('POST', `${path}/input`, { text: text.value }); text.value = ''; await refresh(); } catch (e) { flash(msg, e); }
      },
    }, run.awaiting_input ? h('h2', { id: 'question' }, `The model asks: ${run.awaiting_input}`) : h('h2', {}, 'Input'),
    h('div', { class: 'row' }, text, h('button', { class: 'primary', type: 'submit', id: 'send-input' }, 'Send'), msg)));
  }
  if (!TERMINAL.has(run.status)) {
    const msg = h('span');
    out.push(h('div', { class: 'row' }, h('button', {
      class: 'danger', id: 'cancel',
      onclick: async () => {
        try { await api('POST', `${path}/cancel`, { reason: 'cancelled from the console' }); await refresh(); } catch (e) { flash(msg, e); }
      },
    }, 'Cancel run'), msg));
  }
  return out;
}

async function approvalsPage() {
  const body = h('tbody');
  const msg = h('p');
  main.replaceChildren(h('h1', {}, 'Approvals ', h('span', { class: 'muted live' }, 'live')),
    h('p', { class: 'muted' }, 'Every call waiting for an operator, oldest first.'),
    h('table', { id: 'approvals' }, h('thead', {}, h('tr', {}, ['Run', 'Call', 'Agent', 'Tool', 'Arguments', 'Reason', 'Waiting since', 'Expires', ''].map((t) => h('th', {}, t)))), body), msg);
  const decide = async (a, decision) => {
    try {
      await api('POST', `/v1/runs/${encodeURIComponent(a.run_id)}/approvals/${encodeURIComponent(a.call_id)}`, { decision });
      body.querySelector(`[data-run="${a.run_id}"][data-call="${a.call_id}"]`)?.remove();
    } catch (e) { flash(msg, e); }
  };
  poll(async (signal) => {
    const { approvals } = await api('GET', '/v1/approvals?limit=100', undefined, signal);
    body.replaceChildren(...approvals.map((a) => h('tr', { 'data-run': a.run_id, 'data-call': a.call_id },
      h('td', {}, h('a', { href: `#/runs/${a.run_id}`, class: 'mono' }, a.run_id)), h('td', { class: 'mono' }, a.call_id),
      h('td', {}, a.agent), h('td', {}, a.tool), h('td', {}, h('code', {}, short(a.arguments, 80))), h('td', {}, a.reason),
      h('td', { class: 'muted' }, when(a.requested_at)), h('td', { class: 'muted' }, a.expires_at ? when(a.expires_at) : 'never'),
      h('td', {}, h('button', { class: 'primary approve', onclick: () => decide(a, 'approve') }, 'Approve'), ' ',
        h('button', { class: 'danger reject', onclick: () => decide(a, 'reject') }, 'Reject')))));
    msg.replaceChildren(approvals.length ? '' : h('span', { class: 'muted', id: 'no-approvals' }, 'Nothing waits for an operator.'));
  });
}

async function approvalCount() {
  for (;;) {
    if (token()) {
      try {
        const { approvals, next_cursor } = await api('GET', '/v1/approvals?limit=100');
        document.getElementById('approval-count').textContent = approvals.length ? `${approvals.length}${next_cursor ? '+' : ''}` : '';
      } catch { /* shown on the next page load */ }
    }
    await sleep(POLL_MS * 2);
  }
}

// ---- router -----------------------------------------------------------------------------

function route() {
  view.abort();
  view = new AbortController();
  if (!token()) return signIn();
  document.getElementById('nav').hidden = false;
  const [path, query] = (location.hash.slice(1) || '/runs').split('?');
  const params = new URLSearchParams(query ?? '');
  for (const a of document.querySelectorAll('nav a')) a.classList.toggle('active', path.startsWith(a.getAttribute('href').slice(1)));
  const run = path.match(/^\/runs\/(run_[A-Za-z0-9_-]+)$/);
  if (run) return runPage(run[1]);
  if (path === '/approvals') return approvalsPage();
  if (path === '/new') return newRunPage();
  return runsPage(params);
}

document.getElementById('sign-out').addEventListener('click', signOut);
window.addEventListener('hashchange', route);
route();
approvalCount();
