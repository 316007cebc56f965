// The client on a three-node cluster (one etcd, started here): given the
// three nodes' URLs, it moves to another node when its node is killed and
// recovers there what it missed, told `recovered: true`, with the offsets
// of the one cluster-wide sequence (docs/pubsub.md, "In a cluster"); and
// when its node is drained (close code 4012, docs/cluster.md) it moves the
// same way at once, missing nothing that was published meanwhile.
import { after, before, test } from "node:test";
import assert from "node:assert/strict";
import { spawn } from "node:child_process";
import path from "node:path";
import { Client } from "../dist/index.js";
import {
  api,
  createNamespace,
  freePort,
  httpPublish,
  next,
  OP,
  setHistory,
  sleep,
  startNode,
  tempDir,
  waitFor,
} from "./helpers.mjs";

const ETCD = process.env.ETCD_BIN || "etcd";
let etcd;
const nodes = [];
let key;

before(async () => {
  const dir = tempDir();
  const [client, peer] = [await freePort(), await freePort()];
  const url = `http://127.0.0.1:${client}`;
  etcd = spawn(
    ETCD,
    [
      "--name", "ts", "--data-dir", path.join(dir, "etcd"),
      "--listen-client-urls", url, "--advertise-client-urls", url,
      "--listen-peer-urls", `http://127.0.0.1:${peer}`,
      "--initial-advertise-peer-urls", `http://127.0.0.1:${peer}`,
      "--initial-cluster", `ts=http://127.0.0.1:${peer}`,
      "--listen-metrics-urls", `http://127.0.0.1:${await freePort()}`,
    ],
    { stdio: "ignore" },
  );
  const spawned = await new Promise((resolve) => {
    etcd.on("error", (e) => resolve(e));
    etcd.on("spawn", () => resolve(null));
  });
  if (spawned) throw new Error(`etcd could not start (${spawned.message}): INSTALL STEP: apt-get install -y etcd-server`);
  await waitFor(async () => {
    try {
      return (await fetch(`${url}/health`)).status === 200;
    } catch {
      return false;
    }
  }, "etcd", 30_000);
  for (const id of ["a", "b", "c"]) {
    nodes.push(
      await startNode({
        dataDir: path.join(dir, id),
        env: {
          MESHGATE_CLUSTER_ETCD: `["${url}"]`,
          MESHGATE_CLUSTER_NODE_ID: id,
          MESHGATE_CLUSTER_REGISTER_SECONDS: "1",
          MESHGATE_CLUSTER_SECRET: "ts-client-cluster-secret",
        },
      }),
    );
  }
  // Every node meshed with the two others.
  await waitFor(async () => {
    for (const n of nodes) {
      const r = await api(n.base, "GET", "/metrics", OP);
      const line = r.text.split("\n").find((l) => l.startsWith("meshgate_mesh_peers"));
      if (!line || Number(line.split(" ").pop()) < 2) return false;
    }
    return true;
  }, "the mesh", 30_000);
  key = await createNamespace(nodes[0].base, "tscl");
  await setHistory(nodes[0].base, "tscl", key, [["h.*", 1000]]);
  // The rule is on every node once a publication through each has an offset.
  for (const n of nodes) {
    await waitFor(async () => (await httpPublish(n.base, key, "h.warm", "w")).offset !== undefined, "the rule", 10_000);
  }
});

after(async () => {
  for (const n of nodes) await n.stop();
  etcd?.kill("SIGKILL");
});

test("a drain: the client on the drained node is closed with 4012, moves to the next and recovers every publication once", async () => {
  const c = new Client({
    url: nodes.map((n) => n.base),
    token: key,
    minReconnectDelayMs: 50,
    maxReconnectDelayMs: 200,
    pingIntervalMs: 500,
    pongTimeoutMs: 1500,
  });
  await httpPublish(nodes[1].base, key, "h.drain", "d0");
  const sub = c.newSubscription("h.drain");
  const got = [];
  sub.on("publication", (p) => got.push({ text: p.text(), offset: p.offset }));
  const connected = next(c, "connected");
  await c.connect();
  assert.equal((await connected).url, nodes[0].base);
  await sub.subscribe();
  // Publishes through c go on while a is drained (through b) and after.
  const acked = [];
  let stop = false;
  const publisher = (async () => {
    for (let i = 1; !stop || i <= 40; i++) {
      const ack = await httpPublish(nodes[2].base, key, "h.drain", `d${i}`);
      acked.push({ text: `d${i}`, offset: ack.offset });
      await sleep(15);
    }
  })();
  await waitFor(() => got.length >= 5, "live publications on a");
  const closed = next(c, "connecting", 20_000);
  const moved = next(c, "connected", 20_000);
  const resubscribed = next(sub, "subscribed", 20_000);
  const drained = await api(nodes[1].base, "POST", "/v1/cluster/nodes/a/drain", OP);
  assert.equal(drained.status, 200, drained.text);
  const why = await closed;
  assert.equal(why.code, 4012, "closed with 4012 (node drained)");
  assert.notEqual((await moved).url, nodes[0].base, "another node");
  const ctx = await resubscribed;
  assert.equal(ctx.wasRecovering, true);
  assert.equal(ctx.recovered, true, "nothing was lost");
  stop = true;
  await publisher;
  await waitFor(() => got.length >= acked.length, `${acked.length} publications`, 20_000);
  await sleep(200); // a duplicate would arrive meanwhile
  assert.deepEqual(got, acked, "every acknowledged publication exactly once, in order");
  // The namespace left a: its members are the two others now.
  const ns = await api(nodes[1].base, "GET", "/v1/namespaces/tscl", OP);
  const members = (ns.json.record ?? ns.json.namespace).members;
  assert.ok(!members.includes("a") && members.length > 0, JSON.stringify(members));
  await c.disconnect();
  await sleep(10);
});

test("a cluster failover: the node dies, the client moves to the next and recovers what it missed", async () => {
  const c = new Client({
    url: nodes.map((n) => n.base),
    token: key,
    minReconnectDelayMs: 50,
    maxReconnectDelayMs: 200,
    pingIntervalMs: 500,
    pongTimeoutMs: 1500,
  });
  // The topic made through a first, so a knows its epoch before the client
  // subscribes there (a subscribe racing a topic's creation on another node
  // is closed with 4011 to recover: docs/pubsub.md).
  const first = await httpPublish(nodes[0].base, key, "h.fail", "p0");
  const sub = c.newSubscription("h.fail");
  const got = [];
  sub.on("publication", (p) => got.push({ text: p.text(), offset: p.offset, epoch: p.epoch }));
  const connected = next(c, "connected");
  await c.connect();
  assert.equal((await connected).url, nodes[0].base);
  await sub.subscribe();
  // Published through b and c: one sequence, delivered on a through the mesh.
  for (let i = 1; i <= 4; i++) await httpPublish(nodes[1 + (i % 2)].base, key, "h.fail", `p${i}`);
  await waitFor(() => got.length === 4, "4 live publications on a");
  const moved = next(c, "connected", 20_000);
  const resubscribed = next(sub, "subscribed", 20_000);
  await nodes[0].stop("SIGKILL");
  // Missed while the client moves.
  for (let i = 5; i <= 7; i++) await httpPublish(nodes[1].base, key, "h.fail", `p${i}`);
  const where = await moved;
  assert.notEqual(where.url, nodes[0].base, "another node");
  const ctx = await resubscribed;
  assert.equal(ctx.wasRecovering, true);
  assert.equal(ctx.recovered, true, "told the truth: nothing was lost");
  await httpPublish(nodes[2].base, key, "h.fail", "p8");
  await waitFor(() => got.length === 8, "8 publications");
  assert.deepEqual(got.map((g) => g.text), ["p1", "p2", "p3", "p4", "p5", "p6", "p7", "p8"]);
  assert.deepEqual(got.map((g) => g.offset), [2, 3, 4, 5, 6, 7, 8, 9]);
  assert.deepEqual([...new Set(got.map((g) => g.epoch))], [first.epoch], "one epoch across the failover");
  await c.disconnect();
  await sleep(10);
});
