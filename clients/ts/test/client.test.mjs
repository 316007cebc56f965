// The client against a real node (started here, its own data dir and port),
// reached through a TCP proxy the tests cut, stall or block.
import { after, before, describe, test } from "node:test";
import assert from "node:assert/strict";
import {
  Client,
  ForbiddenError,
  ServerError,
  UnauthorizedError,
} from "../dist/index.js";
import {
  ECHO_WASM,
  api,
  createNamespace,
  deployFunction,
  httpPublish,
  limitedKey,
  next,
  setHistory,
  sleep,
  startNode,
  startProxy,
  tempDir,
  waitFor,
} from "./helpers.mjs";

const NS = "tsc";
let node;
let proxy;
let key;
const clients = [];

/** A client through the proxy with short timers; closed after the file. */
function client(opts = {}) {
  const c = new Client({
    url: proxy.url,
    token: key,
    minReconnectDelayMs: 100,
    maxReconnectDelayMs: 400,
    // Short enough for the dead-connection test, long enough for a loaded CI machine.
    pingIntervalMs: 500,
    pongTimeoutMs: 1500,
    timeoutMs: 5000,
    ...opts,
  });
  clients.push(c);
  return c;
}

/** Collects a subscription's publications. */
function collect(sub) {
  const got = [];
  sub.on("publication", (p) => got.push({ text: p.text(), offset: p.offset, epoch: p.epoch }));
  return got;
}

before(async () => {
  const dataDir = tempDir();
  node = await startNode({ dataDir });
  proxy = await startProxy(() => node.port);
  key = await createNamespace(node.base, NS);
  await setHistory(node.base, NS, key, [["g.*", 3], ["h.*", 1000]]);
});

after(async () => {
  for (const c of clients) c.disconnect();
  await proxy?.close();
  await node?.stop("SIGTERM");
});

describe("publish", () => {
  test("acks resolve in call order, with consecutive offsets on a history topic", async () => {
    const c = client();
    const watcher = client();
    const sub = watcher.newSubscription("h.acks");
    const got = collect(sub);
    await watcher.connect();
    const ctx = await sub.subscribe();
    assert.equal(ctx.recoverable, true);
    assert.equal(ctx.streamPosition.offset, 0);
    await c.connect();
    const order = [];
    const acks = await Promise.all(
      Array.from({ length: 60 }, (_, i) =>
        c.publish("h.acks", `m${i}`).then((a) => {
          order.push(i);
          return a;
        }),
      ),
    );
    assert.deepEqual(order, Array.from({ length: 60 }, (_, i) => i), "acks resolved in call order");
    assert.deepEqual(acks.map((a) => a.offset), Array.from({ length: 60 }, (_, i) => i + 1));
    assert.equal(new Set(acks.map((a) => a.epoch)).size, 1);
    assert.equal(acks[0].epoch, ctx.streamPosition.epoch);
    await waitFor(() => got.length === 60, "60 publications");
    assert.deepEqual(got.map((g) => g.text), Array.from({ length: 60 }, (_, i) => `m${i}`));
    assert.deepEqual(got.map((g) => g.offset), acks.map((a) => a.offset));
    assert.deepEqual(sub.streamPosition, { offset: 60, epoch: acks[0].epoch });
  });

  test("a topic without history acks without offset", async () => {
    const c = client();
    await c.connect();
    assert.deepEqual(await c.publish("plain.1", "x"), {});
    assert.ok((await c.ping()) >= 0);
  });
});

describe("invoke", () => {
  test("a function of the namespace runs over the socket: JSON output parsed, other bytes as output_base64", async () => {
    assert.equal(await deployFunction(node.base, key, "echo", ECHO_WASM), 1);
    const c = client();
    await c.connect();
    assert.deepEqual(await c.invoke("echo", JSON.stringify({ hello: "ts" })), { hello: "ts" });
    assert.deepEqual(await c.invoke("echo@1", "plain bytes"), {
      output_base64: Buffer.from("plain bytes").toString("base64"),
    });
    // A function the namespace does not have is the node's error, typed.
    await assert.rejects(c.invoke("nope"), (e) => e.code === "FUNCTION_NOT_FOUND");
  });
});

describe("presence", () => {
  test("join, leave and the member list", async () => {
    const a = client();
    const b = client();
    const joins = [];
    const leaves = [];
    const subA = a.newSubscription("room.1", {
      presence: { memberId: "ann", meta: { name: "Ann" } },
      onJoin: (e) => joins.push(e),
      onLeave: (e) => leaves.push(e),
    });
    const plain = collect(subA);
    await a.connect();
    await subA.subscribe();
    await waitFor(() => joins.some((j) => j.memberId === "ann"), "ann's own join");
    const subB = b.newSubscription("room.1", { presence: { memberId: "bob", meta: "Bob" } });
    await b.connect();
    await subB.subscribe();
    await waitFor(() => joins.some((j) => j.memberId === "bob"), "bob's join");
    const bob = joins.find((j) => j.memberId === "bob");
    assert.equal(bob.event, "join");
    assert.equal(bob.topic, "room.1");
    assert.equal(bob.meta, "Bob");
    const members = await a.presence("room.1");
    assert.deepEqual(members.map((m) => m.memberId).sort(), ["ann", "bob"]);
    assert.deepEqual(members.find((m) => m.memberId === "ann").meta, { name: "Ann" });
    await subB.unsubscribe();
    await waitFor(() => leaves.some((l) => l.memberId === "bob"), "bob's leave");
    assert.equal(plain.length, 0, "presence events are not publications");
    assert.deepEqual((await subA.presence()).map((m) => m.memberId), ["ann"]);
  });
});

describe("typed errors", () => {
  test("a bad key: connect rejects with UnauthorizedError, no reconnect", async () => {
    const c = client({ token: "mg_sk_" + "A".repeat(40) });
    const err = await c.connect().then(() => null, (e) => e);
    assert.ok(err instanceof UnauthorizedError, `got ${err}`);
    assert.equal(err.status, 401);
    assert.match(err.code, /^[A-Z_]+$/);
    assert.equal(c.state, "disconnected");
    const bad = client({ token: "not-a-key" });
    const e2 = await bad.connect().then(() => null, (e) => e);
    assert.ok(e2 instanceof UnauthorizedError);
    assert.equal(e2.code, "MALFORMED_TOKEN");
  });

  test("a forbidden topic: subscribe and publish reject with ForbiddenError; the socket stays", async () => {
    const lim = await limitedKey(node.base, key, ["pubsub:subscribe:pub.*", "pubsub:publish:pub.*"]);
    const c = client({ token: lim });
    await c.connect();
    const secret = c.newSubscription("secret.1");
    const errors = [];
    secret.on("error", (e) => errors.push(e.error));
    const e1 = await secret.subscribe().then(() => null, (e) => e);
    assert.ok(e1 instanceof ForbiddenError, `got ${e1}`);
    assert.equal(e1.code, "MISSING_GRANT");
    assert.equal(secret.state, "unsubscribed");
    assert.equal(errors[0], e1);
    const e2 = await c.publish("secret.1", "x").then(() => null, (e) => e);
    assert.ok(e2 instanceof ForbiddenError);
    assert.equal(e2.code, "MISSING_GRANT");
    const e3 = await c.newSubscription("_mg/x").subscribe().then(() => null, (e) => e);
    assert.ok(e3 instanceof ForbiddenError);
    assert.equal(e3.code, "RESERVED_TOPIC");
    const e4 = await c.publish("pub.a b", "x").then(() => null, (e) => e);
    assert.ok(e4 instanceof ServerError);
    assert.equal(e4.code, "BAD_TOPIC");
    // The same socket still works.
    const ok = c.newSubscription("pub.ok");
    const got = collect(ok);
    await ok.subscribe();
    await c.publish("pub.ok", "fine");
    await waitFor(() => got.length === 1, "pub.ok message");
    assert.equal(c.state, "connected");
  });
});

describe("reconnect and recovery", () => {
  test("a dead connection (no pong) is dropped; the resubscribe recovers what was missed", async () => {
    const c = client();
    const sub = c.newSubscription("h.dead");
    const got = collect(sub);
    const recovered = [];
    sub.on("recovered", (r) => recovered.push(r));
    await c.connect();
    await sub.subscribe();
    for (let i = 1; i <= 3; i++) await httpPublish(node.base, key, "h.dead", `d${i}`);
    await waitFor(() => got.length === 3, "3 live publications");
    proxy.stall();
    proxy.block();
    const connecting = await next(c, "connecting", 5000);
    assert.equal(connecting.reason, "no pong");
    assert.equal(sub.state, "subscribing");
    for (let i = 4; i <= 8; i++) await httpPublish(node.base, key, "h.dead", `d${i}`);
    const subscribed = next(sub, "subscribed", 15_000);
    proxy.open();
    const ctx = await subscribed;
    assert.equal(ctx.wasRecovering, true);
    assert.equal(ctx.recovered, true);
    assert.equal(ctx.hasRecoveredPublications, true);
    await waitFor(() => recovered.length === 1, "the recovered event");
    assert.equal(recovered[0].fromOffset, 3);
    assert.equal(recovered[0].toOffset, 8);
    assert.equal(recovered[0].publications, 5);
    await httpPublish(node.base, key, "h.dead", "d9");
    await waitFor(() => got.length === 9, "9 publications");
    assert.deepEqual(got.map((g) => g.text), Array.from({ length: 9 }, (_, i) => `d${i + 1}`));
    assert.deepEqual(got.map((g) => g.offset), [1, 2, 3, 4, 5, 6, 7, 8, 9]);
  });

  test("a cut socket: reconnect, recover, and a publish made while offline is sent after", async () => {
    const c = client();
    const sub = c.newSubscription("h.cut");
    const got = collect(sub);
    await c.connect();
    await sub.subscribe();
    await c.publish("h.cut", "before");
    await waitFor(() => got.length === 1, "first");
    proxy.block();
    proxy.cut();
    await waitFor(() => c.state === "connecting", "connecting");
    const offline = c.publish("h.cut", "offline");
    await httpPublish(node.base, key, "h.cut", "missed");
    const subscribed = next(sub, "subscribed");
    proxy.open();
    const ctx = await subscribed;
    assert.equal(ctx.recovered, true);
    const ack = await offline;
    assert.equal(ack.offset, 3);
    await waitFor(() => got.length === 3, "3 publications");
    assert.deepEqual(got.map((g) => g.text), ["before", "missed", "offline"]);
  });

  test("in-flight publishes reject with a retryable DisconnectedError when the socket drops", async () => {
    const c = client();
    await c.connect();
    proxy.stall();
    const p = c.publish("h.inflight", "lost?");
    const err = await p.then(() => null, (e) => e);
    proxy.open();
    assert.ok(err, "rejected");
    assert.equal(err.code, "DISCONNECTED");
    assert.equal(err.retryable, true);
    await waitFor(() => c.state === "connected", "reconnected");
  });

  test("the node restarts on the same data dir: offsets and epoch survive, the client recovers", async () => {
    const c = client();
    const sub = c.newSubscription("h.restart");
    const got = collect(sub);
    await c.connect();
    await sub.subscribe();
    const first = [];
    for (let i = 1; i <= 3; i++) first.push(await c.publish("h.restart", `r${i}`));
    await waitFor(() => got.length === 3, "3 before restart");
    const epoch = first[0].epoch;
    proxy.block();
    await node.stop("SIGKILL");
    await waitFor(() => c.state === "connecting", "the client notices");
    node = await startNode({ dataDir: node.dataDir });
    const a4 = await httpPublish(node.base, key, "h.restart", "r4");
    const a5 = await httpPublish(node.base, key, "h.restart", "r5");
    assert.equal(a4.epoch, epoch, "the epoch survived the restart");
    assert.deepEqual([a4.offset, a5.offset], [4, 5]);
    const subscribed = next(sub, "subscribed", 20_000);
    proxy.open();
    const ctx = await subscribed;
    assert.equal(ctx.wasRecovering, true);
    assert.equal(ctx.recovered, true);
    assert.equal(ctx.hasRecoveredPublications, true);
    await waitFor(() => got.length === 5, "5 after restart");
    assert.deepEqual(got.map((g) => g.offset), [1, 2, 3, 4, 5]);
    assert.deepEqual(got.map((g) => g.text), ["r1", "r2", "r3", "r4", "r5"]);
    assert.ok(got.every((g) => g.epoch === epoch));
  });

  test("too much missed (trimmed history): recovered is false and the stream goes on from the top", async () => {
    const c = client();
    const sub = c.newSubscription("g.small");
    const got = collect(sub);
    await c.connect();
    await sub.subscribe();
    await httpPublish(node.base, key, "g.small", "s1");
    await waitFor(() => got.length === 1, "first");
    proxy.block();
    proxy.cut();
    await waitFor(() => c.state === "connecting", "connecting");
    for (let i = 2; i <= 10; i++) await httpPublish(node.base, key, "g.small", `s${i}`);
    const subscribed = next(sub, "subscribed");
    proxy.open();
    const ctx = await subscribed;
    assert.equal(ctx.wasRecovering, true);
    assert.equal(ctx.recovered, false);
    assert.equal(ctx.hasRecoveredPublications, false);
    assert.equal(ctx.streamPosition.offset, 10);
    await httpPublish(node.base, key, "g.small", "s11");
    await waitFor(() => got.length === 2, "the live one");
    assert.deepEqual(got.map((g) => g.offset), [1, 11]);
    // What was missed can still be read, as far as it is kept.
    const page = await c.history("g.small", { sinceOffset: 8 });
    assert.deepEqual(page.publications.map((p) => p.text()), ["s9", "s10", "s11"]);
    assert.equal(page.more, false);
    const cut = await c.history("g.small", { sinceOffset: 8, limit: 2 });
    assert.deepEqual(cut.publications.map((p) => p.offset), [9, 10]);
    assert.equal(cut.more, true, "cut by its limit: more follow");
  });
});

test("the operator key with a namespace", async () => {
  const c = client({ token: (await import("./helpers.mjs")).OP, namespace: NS });
  await c.connect();
  const r = await c.publish("h.op", "op");
  assert.equal(r.offset, 1);
  const h = await api(node.base, "GET", "/v1/pubsub/history?topic=h.op", key);
  assert.equal(h.json.publications.length, 1);
  await sleep(10);
});
