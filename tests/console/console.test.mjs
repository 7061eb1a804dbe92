// Drives the agentd web console in headless Chromium (Debian's `chromium`, through
// playwright-core) against a running built-in demo daemon:
//   AGENTD_URL=http://127.0.0.1:7700 AGENTD_TOKEN=… node tests/console/console.test.mjs
// It signs in, starts a demo_approval run and approves it from the run page (it succeeds),
// cancels another, answers a demo_input run, rejects a call from the approvals inbox, takes a
// screenshot of a run page (SCREENSHOT=path) and prints one JSON line of facts. Any failed
// expectation throws (exit 1). Every wait has a timeout.

import { chromium } from 'playwright-core';
import { mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';

const url = process.env.AGENTD_URL;
const token = process.env.AGENTD_TOKEN;
const chromiumPath = process.env.CHROMIUM ?? '/usr/bin/chromium';
if (!url || !token) throw new Error('set AGENTD_URL and AGENTD_TOKEN');
const WAIT = { timeout: 20000 };

const profile = mkdtempSync(join(tmpdir(), 'agentd-console-'));
// A new, empty profile directory (Chromium's --user-data-dir) for every run.
const browser = await chromium.launchPersistentContext(profile, {
  executablePath: chromiumPath,
  headless: true,
  viewport: { width: 1280, height: 900 },
  args: ['--headless', '--no-sandbox', '--disable-gpu', '--disable-quic', '--no-first-run',
    '--disable-background-networking', '--disable-component-update', '--disable-sync'],
});
const facts = {};
try {
  const page = browser.pages()[0] ?? await browser.newPage();
  const errors = [];
  page.on('pageerror', (e) => errors.push(String(e)));
  const foreign = [];
  page.on('request', (r) => { if (!r.url().startsWith(url)) foreign.push(r.url()); });

  // First visit: what the console costs.
  await page.goto(url + '/', { waitUntil: 'load' });
  facts.transferred_bytes = await page.evaluate(() => {
    const nav = performance.getEntriesByType('navigation')[0];
    const res = performance.getEntriesByType('resource').filter((r) => r.name.includes('/console/'));
    return nav.transferSize + res.reduce((n, r) => n + r.transferSize, 0);
  });
  facts.body_bytes = await page.evaluate(() => {
    const nav = performance.getEntriesByType('navigation')[0];
    const res = performance.getEntriesByType('resource').filter((r) => r.name.includes('/console/'));
    return nav.encodedBodySize + res.reduce((n, r) => n + r.encodedBodySize, 0);
  });

  // A wrong token is refused; the right one signs in.
  await page.fill('#token', 'not-a-token');
  await page.click('#sign-in');
  await page.getByRole('alert').filter({ hasText: 'not known' }).waitFor(WAIT);
  await page.fill('#token', token);
  await page.click('#sign-in');
  await page.locator('#runs').waitFor(WAIT);

  const startRun = async (agent, input) => {
    await page.goto(url + '/#/new');
    await page.locator('#new-agent option', { hasText: agent }).first().waitFor({ state: 'attached', ...WAIT });
    await page.selectOption('#new-agent', agent);
    await page.fill('#new-input', input);
    await page.click('#start');
    await page.waitForURL(/#\/runs\/run_/, WAIT);
    return page.url().split('#/runs/')[1];
  };
  const statusIs = (s) => page.locator(`#run-status [data-status="${s}"]`).waitFor(WAIT);

  // 1. demo_approval: approve from the run page, with edited arguments; it succeeds.
  const approved = await startRun('demo_approval', 'restart deploy 7');
  await statusIs('waiting_approval');
  const card = page.locator('.approval[data-call="call_1_0"]');
  await card.waitFor(WAIT);
  await card.locator('textarea').fill('{"item": "restart deploy 7 (edited)"}');
  await card.locator('button.approve').click();
  await statusIs('succeeded');
  await page.locator('#run-output', { hasText: 'Done: recorded "restart deploy 7 (edited)" once.' }).waitFor(WAIT);
  await page.locator('#timeline li[data-type="call_approved"]', { hasText: 'with edited arguments' }).waitFor(WAIT);
  await page.locator('#timeline li[data-type="run_succeeded"]').waitFor(WAIT);
  facts.approved = approved;
  if (process.env.SCREENSHOT) await page.screenshot({ path: process.env.SCREENSHOT, fullPage: true });

  // 2. cancel another.
  const cancelled = await startRun('demo_approval', 'restart deploy 8');
  await statusIs('waiting_approval');
  await page.click('#cancel');
  await statusIs('cancelled');
  await page.locator('#timeline li[data-type="run_cancelled"]').waitFor(WAIT);
  if (await page.locator('.approval').count() !== 0) throw new Error('a cancelled run still offers approval');
  facts.cancelled = cancelled;

  // 3. answer a demo_input run.
  const answered = await startRun('demo_input', 'ship v2');
  await statusIs('waiting_input');
  await page.locator('#question', { hasText: 'Where should "ship v2" go' }).waitFor(WAIT);
  await page.fill('#input-text', 'staging');
  await page.click('#send-input');
  await statusIs('succeeded');
  await page.locator('#run-output', { hasText: 'Going ahead with "ship v2" on staging.' }).waitFor(WAIT);
  facts.answered = answered;

  // 4. the approvals inbox: a new waiting call shows up, and is rejected from there.
  const waiting = await startRun('demo_approval', 'restart deploy 9');
  await statusIs('waiting_approval');
  await page.goto(url + '/#/approvals');
  const row = page.locator(`#approvals tr[data-run="${waiting}"]`);
  await row.waitFor(WAIT);
  await row.locator('button.reject').click();
  await row.waitFor({ state: 'detached', ...WAIT });
  await page.goto(url + `/#/runs/${waiting}`);
  await statusIs('succeeded');
  await page.locator('#run-output', { hasText: 'Not done: an operator rejected' }).waitFor(WAIT);
  await page.locator('#transcript', { hasText: 'rejected call_1_0' }).waitFor(WAIT);
  facts.rejected = waiting;

  // 5. the runs list: filters, and every run above is listed.
  await page.goto(url + '/#/runs?status=cancelled');
  await page.locator(`#runs tr[data-run="${cancelled}"]`).waitFor(WAIT);
  if (await page.locator(`#runs tr[data-run="${approved}"]`).count() !== 0) throw new Error('the status filter let a succeeded run through');

  if (errors.length) throw new Error(`page errors: ${errors.join('; ')}`);
  if (foreign.length) throw new Error(`requests to other origins: ${foreign.join(', ')}`);
  facts.ok = true;
  console.log(JSON.stringify(facts));
} finally {
  await browser.close();
  rmSync(profile, { recursive: true, force: true });
}
