// The dashboard in a real browser: start a node, create two namespaces, drive
// traffic through their actors (KV requests, WebSocket subscribers, publishes
// over HTTP), open /__admin in headless Chromium and check that both namespaces
// show non-zero live counters (handled, subscribers, topics, publishes/s) that
// change between reads; with `[dashboard] top_namespaces = 2` a third, idle
// namespace is left out of the tables and found with the search. A deployment
// in alpha proxies to an upstream on 127.0.0.1 (a quarter of its answers 500):
// the Deployments panel shows its route with a non-zero rate and 5xx share,
// and its certificate: the node's pair, then (one uploaded while the page is
// open, made with openssl) `uploaded` with the leaf's expiry.
// Run by scripts/e2e-dashboard.sh (which installs chromium, playwright-core and ws).
import { execFileSync, spawn } from "node:child_process";
import fs from "node:fs";
import http from "node:http";
import os from "node:os";
import path from "node:path";
import { createInterface } from "node:readline";
import { chromium } from "playwright-core";
import WebSocket from "ws";

const arg = (name, dflt) => {
  const i = process.argv.indexOf(`--${name}`);
  return i > 0 ? process.argv[i + 1] : dflt;
};
const BIN = arg("bin", "target/debug/meshgate");
const OUT = arg("out", "target/e2e");
const CHROMIUM = arg("chromium", "/usr/bin/chromium");
const KEY = process.env.MESHGATE_OPERATOR_KEY || `mgop_e2e_${Math.random().toString(36).slice(2)}`;
const NAMESPACES = ["alpha", "beta"];
// WebSocket subscribers per namespace, as topic names: alpha 3 on 2 topics, beta 2 on 1.
const SUBSCRIBERS = { alpha: ["room.1", "room.1", "room.2"], beta: ["room.1", "room.1"] };
const DEPLOY_HOST = "web.e2e.test";
const sleep = (ms) => new Promise((r) => setTimeout(r, ms));
// Polls `cond` (every 50 ms) until it holds; throws naming `what` past `ms`.
async function until(cond, ms, what) {
  const deadline = Date.now() + ms;
  while (!(await cond())) {
    if (Date.now() > deadline) throw new Error(`${what}: not within ${ms} ms`);
    await sleep(50);
  }
}

let passed = 0;
function check(cond, what) {
  if (!cond) throw new Error(`check failed: ${what}`);
  passed++;
  console.log(`ok - ${what}`);
}

// Nothing here may hang a CI run.
const watchdog = setTimeout(() => {
  console.error("e2e: timed out after 180 s");
  process.exit(1);
}, 180_000);

async function startNode() {
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), "meshgate-e2e-"));
  const child = spawn(BIN, ["serve", "--listen", "127.0.0.1:0", "--data-dir", path.join(dir, "data")], {
    env: {
      ...process.env, MESHGATE_OPERATOR_KEY: KEY, MESHGATE_DASHBOARD_TOP_NAMESPACES: "2", RUST_LOG: "warn",
      // The deployment's upstream below listens on loopback.
      MESHGATE_DEPLOY_UPSTREAM_ALLOW: "127.0.0.0/8",
    },
    stdio: ["ignore", "pipe", "inherit"],
  });
  const addr = await new Promise((resolve, reject) => {
    const t = setTimeout(() => reject(new Error("no 'meshgate listening on' line within 60 s")), 60_000);
    child.on("exit", (code) => reject(new Error(`meshgate exited early with ${code}`)));
    createInterface({ input: child.stdout }).on("line", (line) => {
      const m = line.match(/^meshgate listening on http:\/\/(\S+)/);
      if (m) { clearTimeout(t); resolve(m[1]); }
    });
  });
  const base = `http://${addr}`;
  await until(async () => {
    try { return (await fetch(`${base}/readyz`)).status === 200; } catch { return false; }
  }, 30_000, "the node ready");
  return { child, base, dir };
}

async function api(base, method, p, key, body) {
  const r = await fetch(base + p, {
    method,
    headers: { authorization: `Bearer ${key}`, "content-type": "application/json" },
    body,
  });
  const text = await r.text();
  return { status: r.status, text };
}

// One subscriber on `GET /v1/pubsub/ws?topic=T` (the key as `?token=`, as a
// browser would send it); resolves once the socket is open, i.e. the
// subscription is live. Counts the messages it receives.
function subscribe(base, key, topic, format) {
  const url = `${base.replace(/^http/, "ws")}/v1/pubsub/ws?topic=${encodeURIComponent(topic)}&token=${key}` +
    (format ? `&format=${format}` : "");
  const ws = new WebSocket(url);
  const sub = { ws, received: 0 };
  ws.on("message", () => { sub.received++; });
  return new Promise((resolve, reject) => {
    const t = setTimeout(() => reject(new Error(`subscribe ${topic}: no open within 10 s`)), 10_000);
    ws.once("open", () => { clearTimeout(t); resolve(sub); });
    ws.once("error", (e) => { clearTimeout(t); reject(e); });
    ws.once("unexpected-response", (_req, res) => { clearTimeout(t); reject(new Error(`subscribe ${topic}: ${res.statusCode}`)); });
  });
}

// The deployment's upstream: 500 for a path under /api/fail, 200 otherwise.
async function startUpstream() {
  const srv = http.createServer((req, res) => {
    const fail = req.url.startsWith("/api/fail");
    res.writeHead(fail ? 500 : 200, { "content-type": "text/plain" });
    res.end(fail ? "fail" : "ok");
  });
  await new Promise((r) => srv.listen(0, "127.0.0.1", r));
  return { srv, url: `http://127.0.0.1:${srv.address().port}` };
}

// One GET through the node to the deployment on `host` (fetch cannot set Host).
function viaHost(base, host, p) {
  const u = new URL(base);
  return new Promise((resolve, reject) => {
    const req = http.request({ host: u.hostname, port: u.port, path: p, headers: { host } }, (res) => {
      res.resume();
      res.on("end", () => resolve(res.statusCode));
    });
    req.on("error", reject);
    req.end();
  });
}

// Traffic: each namespace gets a steady stream of KV writes and reads and of
// publishes over HTTP to its subscribed topics, all handled by its supervisor
// actor (so its handled counters and rates move). alpha gets twice beta's.
function traffic(base, keys) {
  let running = true;
  let sent = 0, published = 0, routed = 0;
  const loops = [];
  for (const [ns, key] of Object.entries(keys)) {
    const pause = ns === "alpha" ? 40 : 80;
    loops.push((async () => {
      let i = 0;
      while (running) {
        const k = `e2e/${i++ % 50}`;
        const put = await api(base, "PUT", `/v1/kv/${k}`, key, `value ${i}`);
        if (put.status !== 200) throw new Error(`PUT in ${ns}: ${put.status} ${put.text}`);
        await api(base, "GET", `/v1/kv/${k}`, key);
        sent += 2;
        await sleep(pause);
      }
    })());
    const topics = [...new Set(SUBSCRIBERS[ns])];
    loops.push((async () => {
      let i = 0;
      while (running) {
        const topic = topics[i % topics.length];
        const data = Buffer.from(`message ${i++} to ${ns}/${topic}`).toString("base64");
        const r = await api(base, "POST", "/v1/pubsub/publish", key, JSON.stringify({ topic, data_base64: data }));
        if (r.status !== 200) throw new Error(`publish in ${ns}: ${r.status} ${r.text}`);
        published++;
        await sleep(pause);
      }
    })());
  }
  // Requests to alpha's deployment: one in four answered 500 by its upstream.
  loops.push((async () => {
    let i = 0;
    while (running) {
      const p = i++ % 4 === 0 ? `/api/fail/${i}` : `/api/ok/${i}`;
      const st = await viaHost(base, DEPLOY_HOST, p);
      if (st !== (p.startsWith("/api/fail") ? 500 : 200)) throw new Error(`GET ${p} via ${DEPLOY_HOST}: ${st}`);
      routed++;
      await sleep(40);
    }
  })());
  const all = Promise.all(loops);
  const state = { error: null };
  all.catch((e) => { running = false; state.error = e; });
  return {
    state,
    counts: () => ({ sent, published, routed }),
    stop: async () => { running = false; await all; return { sent, published, routed }; },
  };
}

async function readRow(page, ns) {
  return page.$eval(`#ns-table tr[data-ns="${ns}"]`, (tr) => {
    const cell = (c) => tr.querySelector(`[data-col="${c}"]`).textContent.trim();
    const num = (s) => Number(s.replace(/,/g, "").replace(/k$/, "e3"));
    const pub = tr.querySelector('[data-col="publishes_per_sec"]');
    return {
      handled: num(cell("handled")), rate: num(cell("handled_per_sec")), actors: num(cell("actors")),
      subscribers: num(cell("subscribers")), topics: num(cell("topics")),
      pubRate: num(cell("publishes_per_sec")),
      // The cell's tooltip holds the total ("1,234 published since the node started").
      published: num((pub.getAttribute("title") || "").split(" ")[0]),
    };
  });
}

async function main() {
  fs.mkdirSync(OUT, { recursive: true });
  const node = await startNode();
  let browser;
  let page;
  let load;
  let upstream;
  const subs = {};
  try {
    const keys = {};
    for (const ns of NAMESPACES) {
      const r = await api(node.base, "POST", "/v1/namespaces", KEY, JSON.stringify({ name: ns }));
      check(r.status === 201, `namespace ${ns} created (${r.status})`);
      keys[ns] = JSON.parse(r.text).api_key;
    }
    for (const ns of NAMESPACES) {
      subs[ns] = await Promise.all(SUBSCRIBERS[ns].map((t, i) => subscribe(node.base, keys[ns], t, i % 2 ? "binary" : "")));
      check(subs[ns].length > 0, `${ns}: ${subs[ns].length} WebSocket subscribers open`);
    }
    upstream = await startUpstream();
    const dep = await api(node.base, "POST", "/v1/deployments", keys.alpha, JSON.stringify({
      name: "web", hosts: [DEPLOY_HOST], upstream: { instances: [upstream.url] }, routes: [{ path_prefix: "/api" }],
    }));
    check(dep.status === 201, `alpha: deployment web created (${dep.status} ${dep.status === 201 ? "" : dep.text})`);
    // An idle third namespace: outside the top two, found by the search.
    const idle = await api(node.base, "POST", "/v1/namespaces", KEY, JSON.stringify({ name: "gamma-idle" }));
    check(idle.status === 201, `namespace gamma-idle created (${idle.status})`);
    load = traffic(node.base, keys);
    // Traffic under way in both namespaces before the page opens.
    await until(() => {
      if (load.state.error) throw load.state.error;
      const c = load.counts();
      return c.sent >= 40 && c.published >= 20 && c.routed >= 8;
    }, 30_000, "traffic under way");

    browser = await chromium.launch({
      executablePath: CHROMIUM,
      headless: true,
      args: ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-quic",
        "--no-first-run", "--disable-component-update", "--disable-sync"],
    });
    page = await browser.newPage({ viewport: { width: 1400, height: 1000 } });
    const offsite = [];
    page.on("request", (req) => { if (!req.url().startsWith(node.base)) offsite.push(req.url()); });
    // Loopback is no credential: the browser is sent to the sign-in form first.
    const unsigned = await page.goto(`${node.base}/__admin`);
    check(new URL(unsigned.url()).pathname === "/__admin/login", `an unsigned browser lands on the sign-in form (${unsigned.url()})`);
    await page.fill('input[name="key"]', KEY);
    const [resp] = await Promise.all([
      page.waitForNavigation(),
      page.click('button[type="submit"], input[type="submit"]'),
    ]);
    check(new URL(resp.url()).pathname === "/__admin" && resp.status() === 200, "signing in with the operator key opens /__admin");
    await page.waitForSelector("#conn.on", { timeout: 15_000 });
    check(true, "the event stream is live");
    for (const ns of NAMESPACES) {
      await page.waitForSelector(`#ns-table tr[data-ns="${ns}"]`, { timeout: 15_000 });
    }
    check(true, "both namespaces are listed");

    // Two reads of the live counters, a few ticks apart.
    await page.waitForFunction(() => {
      const rows = [...document.querySelectorAll("#ns-table tbody tr")];
      const n = (r, c) => Number(r.querySelector(`[data-col="${c}"]`).textContent.replace(/,/g, "").replace(/k$/, "e3"));
      return rows.length >= 2 && rows.every((r) => n(r, "handled_per_sec") > 0 && n(r, "publishes_per_sec") > 0 && n(r, "subscribers") > 0);
    }, null, { timeout: 15_000 });
    const first = {};
    for (const ns of NAMESPACES) first[ns] = await readRow(page, ns);
    const tick1 = Number(await page.textContent("#tick"));
    // A few ticks later (the counters move with every tick under traffic).
    await page.waitForFunction((t) => Number(document.querySelector("#tick").textContent) >= t + 3,
      tick1, { timeout: 15_000 });
    const second = {};
    for (const ns of NAMESPACES) second[ns] = await readRow(page, ns);
    const tick2 = Number(await page.textContent("#tick"));
    for (const ns of NAMESPACES) {
      check(first[ns].handled > 0 && first[ns].rate > 0, `${ns}: non-zero handled (${first[ns].handled}) and handled/s (${first[ns].rate})`);
      check(second[ns].handled > first[ns].handled, `${ns}: handled grew between reads (${first[ns].handled} -> ${second[ns].handled})`);
      check(second[ns].actors >= 1, `${ns}: its supervisor actor is shown`);
      const want = SUBSCRIBERS[ns];
      check(first[ns].subscribers === want.length && second[ns].subscribers === want.length,
        `${ns}: ${want.length} subscribers shown (${first[ns].subscribers}, then ${second[ns].subscribers})`);
      check(second[ns].topics === new Set(want).size, `${ns}: topics shown: ${second[ns].topics}`);
      check(first[ns].pubRate > 0 && second[ns].pubRate > 0,
        `${ns}: non-zero publishes/s at both reads (${first[ns].pubRate}, ${second[ns].pubRate})`);
      check(second[ns].published > first[ns].published && first[ns].published > 0,
        `${ns}: publishes total grew between reads (${first[ns].published} -> ${second[ns].published})`);
      const got = subs[ns].map((x) => x.received);
      check(got.every((n) => n > 0), `${ns}: every subscriber received messages (${got.join(", ")})`);
    }
    const nodeSubs = Number((await page.textContent("#n-subs")).replace(/,/g, ""));
    const nodeConns = Number((await page.textContent("#n-conn")).replace(/,/g, ""));
    const allSubs = NAMESPACES.reduce((a, ns) => a + SUBSCRIBERS[ns].length, 0);
    check(nodeSubs === allSubs && nodeConns >= allSubs, `the node shows ${nodeSubs} subscribers on ${nodeConns} WebSocket connections`);
    check(tick2 > tick1, `the page moved on by ${tick2 - tick1} ticks`);
    const actorRows = await page.$$eval("#actor-table tbody tr", (rs) => rs.length);
    check(actorRows >= 3, `the actor table lists ${actorRows} actors (node + two namespaces)`);
    const rss = await page.textContent("#n-rss");
    check(/[KMG]iB/.test(rss), `memory RSS is shown (${rss})`);

    // The Deployments panel: alpha's route with live numbers.
    await page.waitForFunction(() => {
      const tr = document.querySelector('#dep-table tr[data-route="/api"]');
      const n = (c) => parseFloat(tr.querySelector(`[data-col="${c}"]`).textContent);
      return tr && n("requests_per_sec") > 0 && n("error_share") > 0;
    }, null, { timeout: 15_000 });
    const depRow = await page.$eval('#dep-table tr[data-route="/api"]', (tr) => {
      const cell = (c) => tr.querySelector(`[data-col="${c}"]`).textContent.trim();
      return { dep: tr.dataset.dep, rate: cell("requests_per_sec"), p50: cell("p50_seconds"), p99: cell("p99_seconds"),
        share: cell("error_share"), instances: cell("instances") };
    });
    check(depRow.dep === "alpha/web", `the Deployments panel has a row for alpha/web /api (${JSON.stringify(depRow)})`);
    check(parseFloat(depRow.rate) > 0, `its req/s is non-zero (${depRow.rate})`);
    check(/s$/.test(depRow.p50) && /s$/.test(depRow.p99), `its p50 and p99 are shown (${depRow.p50}, ${depRow.p99})`);
    const share = parseFloat(depRow.share);
    check(share >= 10 && share <= 40, `its 5xx share is about a quarter (${depRow.share})`);
    check(depRow.instances === "1 / 1", `its one instance is healthy (${depRow.instances})`);

    // Its certificate column: no certificate of its own, the node's pair.
    const tlsCell = () => page.$eval('#dep-table tr[data-route="/api"] [data-col="tls"]',
      (td) => ({ mode: td.dataset.mode, text: td.textContent.replace(/\s+/g, " ").trim() }));
    const before = await tlsCell();
    check(before.mode === "node_pair" && before.text === "node pair", `its certificate column says node pair (${JSON.stringify(before)})`);
    // A certificate for its host, uploaded while the page is open.
    const certDir = fs.mkdtempSync(path.join(os.tmpdir(), "meshgate-e2e-cert-"));
    const [certPath, keyPath] = [path.join(certDir, "cert.pem"), path.join(certDir, "key.pem")];
    execFileSync("openssl", ["req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
      "-keyout", keyPath, "-out", certPath, "-days", "400", "-subj", `/CN=${DEPLOY_HOST}`,
      "-addext", `subjectAltName=DNS:${DEPLOY_HOST}`], { stdio: "ignore" });
    const up = await api(node.base, "PUT", "/v1/deployments/web/certificate", keys.alpha, JSON.stringify({
      cert_pem: fs.readFileSync(certPath, "utf8"), key_pem: fs.readFileSync(keyPath, "utf8"),
    }));
    fs.rmSync(certDir, { recursive: true, force: true });
    check(up.status === 200, `alpha: certificate for web uploaded (${up.status} ${up.status === 200 ? "" : up.text})`);
    const notAfter = JSON.parse(up.text).certificate.not_after;
    await page.waitForFunction(() =>
      document.querySelector('#dep-table tr[data-route="/api"] [data-col="tls"]')?.dataset.mode === "uploaded",
    null, { timeout: 15_000 });
    const after = await tlsCell();
    check(after.text === `uploaded until ${notAfter.slice(0, 10)}`,
      `its certificate column says uploaded with the leaf's expiry ${notAfter} (${JSON.stringify(after)})`);

    // Screenshot with everything on.
    const shot = path.join(OUT, "dashboard.png");
    await page.screenshot({ path: shot, fullPage: true });
    console.log(`screenshot: ${shot}`);
    if (process.env.DOCS_SCREENSHOT) fs.copyFileSync(shot, process.env.DOCS_SCREENSHOT);

    // The namespace filter narrows both tables.
    await page.selectOption("#ns-filter", "beta");
    await page.waitForFunction(() => document.querySelectorAll("#ns-table tbody tr").length === 1);
    const filtered = await page.$$eval("#actor-table tbody tr td:nth-child(3)", (tds) => tds.map((t) => t.textContent.trim()));
    check(filtered.length >= 1 && filtered.every((n) => n === "beta"), "the namespace filter shows only beta");
    await page.selectOption("#ns-filter", "");

    // Sorting by a column: handled/s descending puts alpha (twice the traffic) first.
    // Each click re-sorts the table: wait for the order it promises (bounded).
    const firstRow = (ns) => page.waitForFunction((want) =>
      document.querySelector("#ns-table tbody tr")?.dataset.ns === want, ns, { timeout: 5_000 }).catch(() => {});
    await page.click('#ns-table th[data-key="handled"]');
    await firstRow("alpha");
    const order = await page.$$eval("#ns-table tbody tr", (rs) => rs.map((r) => r.dataset.ns));
    check(order[0] === "alpha", `sorting by handled puts the busiest first (${order.join(", ")})`);
    await page.click('#ns-table th[data-key="handled"]');
    await firstRow("beta");
    const reversed = await page.$$eval("#ns-table tbody tr", (rs) => rs.map((r) => r.dataset.ns));
    check(reversed[0] === "beta", "a second click reverses the order");

    // Only the top two are in the tables; the search finds the idle third.
    const listed = await page.$$eval("#ns-table tbody tr", (rs) => rs.map((r) => r.dataset.ns));
    check(!listed.includes("gamma-idle") && listed.length === 2, `the table holds the top 2 (${listed.join(", ")})`);
    const count = await page.textContent("#ns-count");
    check(/top 2 of 3/.test(count), `the page says how many namespaces there are (${count})`);
    await page.fill("#ns-search", "gamma");
    await page.waitForSelector('#search-table tr[data-ns="gamma-idle"]', { timeout: 10_000 });
    check(true, "the search finds a namespace outside the top N");

    check(offsite.length === 0, `the page fetched nothing off the node (${offsite.join(", ") || "none"})`);
    const totals = await load.stop();
    console.log(`traffic: ${totals.sent} KV requests, ${totals.published} publishes, ${totals.routed} routed requests`);
    // Closing the sockets takes the subscribers off the page.
    for (const ns of NAMESPACES) for (const x of subs[ns]) x.ws.close();
    await page.waitForFunction(() => [...document.querySelectorAll('#ns-table tbody [data-col="subscribers"]')]
      .every((td) => td.textContent.trim() === "0"), null, { timeout: 15_000 });
    check(true, "subscribers fall to 0 once the sockets close");
  } catch (e) {
    if (load && load.state.error) console.error(`traffic failed first: ${load.state.error.stack || load.state.error}`);
    if (page) await page.screenshot({ path: path.join(OUT, "failure.png"), fullPage: true }).catch(() => {});
    throw e;
  } finally {
    for (const list of Object.values(subs)) for (const x of list) x.ws.terminate();
    if (browser) await browser.close();
    if (upstream) upstream.srv.close();
    node.child.kill("SIGKILL");
    fs.rmSync(node.dir, { recursive: true, force: true });
  }
}

main().then(
  () => { clearTimeout(watchdog); console.log(`e2e dashboard: ${passed} passed, 0 failed`); process.exit(0); },
  (e) => { console.error(e.stack || String(e)); console.log(`e2e dashboard: ${passed} passed, 1 failed`); process.exit(1); },
);
