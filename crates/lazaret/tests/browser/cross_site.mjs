// Pages of other origins against a server without tokens, in Debian's chromium driven by playwright-core.
//
// Run by crates/lazaret/tests/it/browser.rs, which starts the server (no
// tokens), seeds dead letters, serves empty "attacker" pages on other
// origins and afterwards checks over HTTP that the dead letters are all
// still there. Each attacker page sends what issue #32 found worked: a
// no-cors POST of a purge of everything, from another port of this host
// (same-site), from another host (cross-site) and from a sandboxed frame
// (Origin: null); browser.rs counts the refusals in /metrics. Then the
// dashboard, opened as localhost and as 127.0.0.1, must still work: a pause
// and a resume through its own form, a binary dead letter shown as binary
// and downloaded whole. Environment:
//   LAZARET_URL         the server, http://127.0.0.1:PORT
//   LAZARET_ATTACKERS   JSON list of attacker page URLs
//   LAZARET_SEED        {"binary": {dead_letter_id, payload_size}}
//   LAZARET_CHROMIUM    the browser (default /usr/bin/chromium); never downloaded
// Exits 0 after printing "cross-site browser test: passed", 1 with the failing step otherwise.
import assert from 'node:assert/strict';
import { mkdtempSync, rmSync, statSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';

import { chromium } from 'playwright-core';

const base = process.env.LAZARET_URL;
const attackers = JSON.parse(process.env.LAZARET_ATTACKERS || '[]');
const seed = JSON.parse(process.env.LAZARET_SEED || '{}');
const executablePath = process.env.LAZARET_CHROMIUM || '/usr/bin/chromium';
assert.ok(base && attackers.length && seed.binary, 'LAZARET_URL, LAZARET_ATTACKERS and LAZARET_SEED are set');
const purgeUrl = `${base}/v1/dead-letters/purge`;
const PURGE_ALL = '{"all":true,"confirm":true,"filter":{}}';

let step = 'start';
function say(what) {
  step = what;
  console.log(`step: ${what}`);
}

const profile = mkdtempSync(join(tmpdir(), 'lazaret-chromium-'));
const context = await chromium.launchPersistentContext(profile, {
  executablePath,
  headless: true,
  args: ['--headless', '--no-sandbox', '--disable-gpu', '--disable-dev-shm-usage', '--disable-quic', '--no-first-run',
    '--disable-background-networking', '--disable-component-update', '--disable-sync'],
  acceptDownloads: true,
});
context.setDefaultTimeout(20000);
const page = context.pages()[0] || (await context.newPage());
const pageErrors = [];
page.on('pageerror', (e) => pageErrors.push(e.message));

/** Waits for the answer to the purge a page sends; its status and the server's reason. */
async function purgeAnswer(send) {
  const [resp] = await Promise.all([
    page.waitForResponse((r) => r.url() === purgeUrl && r.request().method() === 'POST'),
    send(),
  ]);
  const text = await resp.text().catch(() => '');
  return { status: resp.status(), said: text.slice(0, 300) };
}

try {
  for (const attacker of attackers) {
    say(`a page at ${attacker} purges with a no-cors fetch`);
    await page.goto(attacker);
    const top = await purgeAnswer(() => page.evaluate(([url, body]) => fetch(url, { mode: 'no-cors', method: 'POST', body })
      .then(() => 'sent', (e) => `failed: ${e}`), [purgeUrl, PURGE_ALL]));
    console.log(`  answered ${top.status}${top.said ? `: ${top.said}` : ' (opaque to the page)'}`);
    assert.equal(top.status, 403, 'refused');

    // The browser reports no response event for a sandboxed frame's fetch:
    // the frame says when its fetch has been answered, and browser.rs
    // counts the refusals in /metrics and the dead letters left.
    say(`a sandboxed frame in ${attacker} (Origin: null) purges`);
    const framed = await page.evaluate(([url, body]) => new Promise((resolve) => {
      window.addEventListener('message', (ev) => resolve(ev.data), { once: true });
      const f = document.createElement('iframe');
      f.sandbox = 'allow-scripts';
      f.srcdoc = `<script>fetch(${JSON.stringify(url)}, { mode: 'no-cors', method: 'POST', body: ${JSON.stringify(body)} })
        .then(() => parent.postMessage('answered', '*'), (e) => parent.postMessage('failed: ' + e, '*'))<\/script>`;
      document.body.append(f);
    }), [purgeUrl, PURGE_ALL]);
    assert.equal(framed, 'answered', 'the frame\'s fetch reached the server');
  }

  const port = new URL(base).port;
  for (const host of ['localhost', '127.0.0.1']) {
    const here = `http://${host}:${port}`;
    say(`the dashboard opened as ${here} pauses and resumes a type`);
    await page.goto(`${here}/`);
    await page.getByRole('heading', { name: 'Overview' }).waitFor();
    await page.getByText('auth is off: loopback only').waitFor();
    await page.getByLabel('What').selectOption('type');
    await page.getByLabel('Name').fill('send_email');
    await page.getByRole('button', { name: 'Pause', exact: true }).click();
    await page.getByText('Paused type send_email.').waitFor();
    await page.getByRole('button', { name: 'Resume type send_email' }).click();
    await page.getByText('Resumed type send_email.').waitFor();

    say(`the dashboard opened as ${here} shows a binary payload as binary and downloads it`);
    await page.goto(`${here}/#/dead-letter/${seed.binary.dead_letter_id}`);
    await page.getByText(/^A binary payload of 14 B/).waitFor();
    const [download] = await Promise.all([
      page.waitForEvent('download'),
      page.getByRole('button', { name: /^Download the whole payload/ }).click(),
    ]);
    assert.equal(statSync(await download.path()).size, seed.binary.payload_size, 'the download is the whole payload');
  }
  assert.deepEqual(pageErrors, [], 'no script error on the page');
  console.log('cross-site browser test: passed');
} catch (e) {
  console.error(`cross-site browser test failed at step "${step}": ${e.stack || e}`);
  process.exitCode = 1;
} finally {
  await context.close();
  rmSync(profile, { recursive: true, force: true });
}
