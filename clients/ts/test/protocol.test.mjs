// Cases a real node does not produce on demand, against a scripted
// WebSocket server speaking the /v1/ws frames: a gap in a topic's offsets
// (frames lost) and the slow-consumer close 4008 (the server dropped frames),
// both answered by resubscribing with recovery; and the namespace-gone close.
import { after, test } from "node:test";
import assert from "node:assert/strict";
import { WebSocketServer } from "ws";
import { Client, CloseCode } from "../dist/index.js";
import { waitFor } from "./helpers.mjs";

const b64 = (s) => Buffer.from(s).toString("base64");
const msg = (topic, offset) => JSON.stringify({ type: "message", topic, data_base64: b64(`p${offset}`), timestamp: Date.now(), offset });

/** A server on a free port; `onFrame(ws, frame, conn#)` scripts it. */
async function fakeServer(onFrame) {
  const wss = new WebSocketServer({ host: "127.0.0.1", port: 0 });
  await new Promise((r) => wss.on("listening", r));
  const frames = [];
  let conns = 0;
  wss.on("connection", (ws, req) => {
    const n = ++conns;
    ws.auth = req.headers.authorization;
    ws.on("message", (d) => {
      const f = JSON.parse(String(d));
      frames.push({ conn: n, ...f });
      onFrame(ws, f, n);
    });
  });
  return { url: `http://127.0.0.1:${wss.address().port}`, frames, close: () => new Promise((r) => wss.close(r)), wss };
}

const servers = [];
after(async () => {
  for (const s of servers) {
    for (const c of s.wss.clients) c.terminate();
    await s.close();
  }
});

const opts = { token: "mg_sk_test", minReconnectDelayMs: 50, maxReconnectDelayMs: 100 };

test("a gap in offsets: unsubscribe, resubscribe recovering from the last one, deliver in order", async () => {
  const s = await fakeServer((ws, f) => {
    if (f.type === "subscribe" && !f.recover) {
      ws.send(JSON.stringify({ id: f.id, ok: true, epoch: "E", offset: 0 }));
      // 3 and 4 are lost on the way.
      for (const o of [1, 2, 5]) ws.send(msg(f.topic, o));
    } else if (f.type === "subscribe") {
      ws.send(JSON.stringify({ id: f.id, ok: true, recovered: true, epoch: "E", offset: 5 }));
      for (const o of [3, 4, 5]) ws.send(msg(f.topic, o));
    } else ws.send(JSON.stringify({ id: f.id, ok: true }));
  });
  servers.push(s);
  const c = new Client({ url: s.url, ...opts });
  const sub = c.newSubscription("t");
  const got = [];
  const recovered = [];
  sub.on("publication", (p) => got.push(p.offset));
  sub.on("recovered", (r) => recovered.push(r));
  await c.connect();
  await sub.subscribe();
  await waitFor(() => got.length === 5, "5 publications");
  assert.deepEqual(got, [1, 2, 3, 4, 5]);
  const types = s.frames.map((f) => f.type);
  assert.deepEqual(types, ["subscribe", "unsubscribe", "subscribe"]);
  assert.deepEqual(s.frames[2].recover, { offset: 2, epoch: "E" });
  assert.equal(recovered[0].publications, 3);
  assert.equal(s.wss.clients.values().next().value.auth, "Bearer mg_sk_test", "Node sends the credential as a header");
  c.disconnect();
});

test("close 4008 (slow consumer): reconnect at once and recover from the last offset", async () => {
  const s = await fakeServer((ws, f, n) => {
    if (f.type !== "subscribe") return;
    if (n === 1) {
      ws.send(JSON.stringify({ id: f.id, ok: true, epoch: "E", offset: 7 }));
      ws.send(msg(f.topic, 8));
      setTimeout(() => ws.close(CloseCode.SLOW_CONSUMER, "slow consumer"), 20);
    } else {
      ws.send(JSON.stringify({ id: f.id, ok: true, recovered: true, epoch: "E", offset: 10 }));
      for (const o of [9, 10]) ws.send(msg(f.topic, o));
    }
  });
  servers.push(s);
  const c = new Client({ url: s.url, ...opts, minReconnectDelayMs: 5000, maxReconnectDelayMs: 5000 });
  const sub = c.newSubscription("t");
  const got = [];
  sub.on("publication", (p) => got.push(p.offset));
  const connecting = [];
  c.on("connecting", (e) => connecting.push(e));
  await c.connect();
  await sub.subscribe();
  await waitFor(() => got.length === 3, "8, 9, 10", 3000);
  assert.deepEqual(got, [8, 9, 10]);
  assert.equal(connecting.at(-1).code, 4008);
  assert.equal(connecting.at(-1).delayMs, 0, "no backoff after a slow-consumer close");
  assert.deepEqual(s.frames.at(-1).recover, { offset: 8, epoch: "E" });
  c.disconnect();
});

test("close 4004 (namespace deleted): the client stops with an error", async () => {
  const s = await fakeServer((ws, f) => {
    ws.send(JSON.stringify({ id: f.id, ok: true }));
    ws.close(CloseCode.NAMESPACE_GONE, "namespace deleted");
  });
  servers.push(s);
  const c = new Client({ url: s.url, ...opts });
  await c.connect();
  const disc = new Promise((r) => c.on("disconnected", r));
  await c.newSubscription("t").subscribe().catch(() => {});
  const d = await disc;
  assert.equal(d.code, 4004);
  assert.equal(d.error.code, "NAMESPACE_GONE");
  assert.equal(c.state, "disconnected");
});

test("backoff grows with jitter between attempts while the server is away", async () => {
  const s = await fakeServer(() => {});
  const url = s.url;
  await s.close();
  const c = new Client({ url, ...opts, minReconnectDelayMs: 40, maxReconnectDelayMs: 300 });
  const delays = [];
  c.on("connecting", (e) => e.attempt > 0 && delays.push(e.delayMs));
  c.connect().catch(() => {});
  await waitFor(() => delays.length >= 6, "6 attempts", 5000);
  c.disconnect();
  assert.ok(delays[0] >= 20 && delays[0] <= 40, `first ${delays[0]}`);
  assert.ok(delays[2] >= 80 && delays[2] <= 160, `third ${delays[2]}`);
  assert.ok(delays.slice(4).every((d) => d >= 150 && d <= 300), `capped ${delays}`);
});

test("a refused subscribe nobody awaits is an error event, not an unhandled rejection", async () => {
  const s = await fakeServer((ws, f) =>
    ws.send(JSON.stringify({ id: f.id, ok: false, error: { code: "MISSING_GRANT", message: "no" } })),
  );
  servers.push(s);
  const c = new Client({ url: s.url, ...opts });
  const sub = c.newSubscription("secret");
  const errors = [];
  sub.on("error", (e) => errors.push(e.error));
  c.connect();
  sub.subscribe(); // not awaited
  await waitFor(() => errors.length === 1, "the error event");
  assert.equal(errors[0].name, "ForbiddenError");
  assert.equal(errors[0].code, "MISSING_GRANT");
  assert.equal(sub.state, "unsubscribed");
  await new Promise((r) => setTimeout(r, 50));
  c.disconnect();
});
