// The built ESM client in headless Chromium: a page served here imports
// dist/index.js (the browser's own WebSocket, the credential as ?token=),
// subscribes, gets a publication the test makes over HTTP, publishes one
// back, sees a bad key refused with a typed error, and reports each step to
// this server.
import { after, before, test } from "node:test";
import assert from "node:assert/strict";
import { spawn } from "node:child_process";
import fs from "node:fs";
import http from "node:http";
import path from "node:path";
import { fileURLToPath } from "node:url";
import { api, createNamespace, httpPublish, setHistory, startNode, tempDir, waitFor } from "./helpers.mjs";

const DIST = path.resolve(path.dirname(fileURLToPath(import.meta.url)), "../dist");
const CHROMIUM = process.env.CHROMIUM || "/usr/bin/chromium";

const PAGE = `<!doctype html><meta charset="utf-8"><title>meshgate-client</title>
<script type="module">
import { Client } from "/dist/index.js";
const q = new URLSearchParams(location.search);
const report = (o) => fetch("/report", { method: "POST", body: JSON.stringify(o) });
try {
  const client = new Client({ url: q.get("node"), token: q.get("token") });
  const sub = client.newSubscription(q.get("topic"));
  sub.on("publication", async (p) => {
    await report({ step: "publication", text: p.text(), offset: p.offset, epoch: p.epoch });
    const ack = await client.publish(q.get("topic") + ".back", "from the browser");
    await report({ step: "published", ack });
  });
  await client.connect();
  const ctx = await sub.subscribe();
  await report({ step: "subscribed", ctx, ws: typeof WebSocket });
  // A refused upgrade is opaque to a page: the client asks /v1/auth/whoami
  // (CORS lets this page's origin) and rejects with the typed error.
  const bad = new Client({ url: q.get("node"), token: "mg_sk_" + "A".repeat(40) });
  const e = await bad.connect().then(() => null, (e) => e);
  await report({ step: "badkey", name: e && e.name, code: e && e.code, status: e && e.status, state: bad.state });
} catch (e) {
  await report({ step: "error", error: String(e), code: e.code });
}
</script>`;

let node;
let server;
let browser;
let key;
const reports = [];

before(async () => {
  if (!fs.existsSync(CHROMIUM)) throw new Error(`no chromium at ${CHROMIUM}: apt-get install -y chromium`);
  server = http.createServer((req, res) => {
    const url = new URL(req.url, "http://x");
    if (req.method === "POST" && url.pathname === "/report") {
      let body = "";
      req.on("data", (c) => (body += c));
      req.on("end", () => {
        reports.push(JSON.parse(body));
        res.end("ok");
      });
      return;
    }
    if (url.pathname === "/") {
      res.setHeader("content-type", "text/html");
      return res.end(PAGE);
    }
    const file = path.join(DIST, path.normalize(url.pathname.replace(/^\/dist\//, "")));
    if (url.pathname.startsWith("/dist/") && file.startsWith(DIST) && fs.existsSync(file)) {
      res.setHeader("content-type", file.endsWith(".js") ? "text/javascript" : "application/octet-stream");
      return res.end(fs.readFileSync(file));
    }
    res.statusCode = 404;
    res.end();
  });
  await new Promise((r) => server.listen(0, "127.0.0.1", r));
  node = await startNode({
    dataDir: tempDir(),
    env: { MESHGATE_CORS_ALLOWED_ORIGINS: `http://127.0.0.1:${server.address().port}` },
  });
  key = await createNamespace(node.base, "web");
  await setHistory(node.base, "web", key, [["*", 100]]);
});

after(async () => {
  if (browser && browser.exitCode === null) {
    try {
      process.kill(-browser.pid, "SIGKILL"); // its own process group: the wrapper and its children
    } catch {
      /* gone */
    }
  }
  await new Promise((r) => server?.close(r));
  await node?.stop("SIGTERM");
});

test("headless Chromium: the ESM client subscribes and gets a publication made over HTTP", async () => {
  const page = new URL(`http://127.0.0.1:${server.address().port}/`);
  page.searchParams.set("node", node.base);
  page.searchParams.set("token", key);
  page.searchParams.set("topic", "browser.news");
  const profile = tempDir();
  browser = spawn(
    CHROMIUM,
    [
      "--headless",
      "--no-sandbox",
      "--disable-gpu",
      "--disable-background-networking",
      "--no-first-run",
      `--user-data-dir=${profile}`,
      page.toString(),
    ],
    { stdio: "ignore", detached: true },
  );
  const step = (name) => waitFor(() => reports.find((r) => r.step === name || r.step === "error"), name, 60_000);
  const sub = await step("subscribed");
  assert.equal(sub.step, "subscribed", JSON.stringify(sub));
  assert.equal(sub.ws, "function");
  assert.equal(sub.ctx.recoverable, true);
  const ack = await httpPublish(node.base, key, "browser.news", "hello browser");
  const got = await step("publication");
  assert.equal(got.text, "hello browser");
  assert.equal(got.offset, ack.offset);
  assert.equal(got.epoch, ack.epoch);
  const back = await step("published");
  assert.equal(back.ack.offset, 1);
  const h = await api(node.base, "GET", "/v1/pubsub/history?topic=browser.news.back", key);
  assert.equal(Buffer.from(h.json.publications[0].data_base64, "base64").toString(), "from the browser");
  const bad = await step("badkey");
  assert.deepEqual(
    { name: bad.name, status: bad.status, state: bad.state },
    { name: "UnauthorizedError", status: 401, state: "disconnected" },
    JSON.stringify(bad),
  );
  assert.match(bad.code, /API_KEY|CHECKSUM/);
  assert.ok(!reports.some((r) => r.step === "error"), JSON.stringify(reports));
});
