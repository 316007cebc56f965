// Dashboard cost: pub/sub throughput of a node with the dashboard stream closed
// vs open. 50 namespaces, 1,000 WebSocket subscribers spread over them (20 per
// namespace, 5 per topic), publishers over HTTP (`POST /v1/pubsub/publish`).
// Each round runs closed, 1 viewer and 25 viewers, in alternating order
// (closed→25 then 25→closed) so drift cancels; prints a table and the ratios.
//
//   node scripts/bench-dashboard.mjs [--bin PATH] [--seconds 8] [--rounds 4]
//        [--clients 32] [--subscribers 1000] [--viewers 1,25]
//
// The binary defaults to $CARGO_TARGET_DIR/release/meshgate when it exists,
// else the debug one (the table says which). Needs `ws` from tests/e2e
// (`cd tests/e2e && npm install`). Raises its own `ulimit -n` when too low
// (1,000 sockets each side) by re-running itself under bash.
import { spawn, spawnSync } from "node:child_process";
import fs from "node:fs";
import os from "node:os";
import path from "node:path";
import { createRequire } from "node:module";
import { createInterface } from "node:readline";
import { fileURLToPath } from "node:url";

const ROOT = path.resolve(path.dirname(fileURLToPath(import.meta.url)), "..");
const arg = (n, d) => { const i = process.argv.indexOf(`--${n}`); return i > 0 ? process.argv[i + 1] : d; };
const SUBSCRIBERS = Number(arg("subscribers", 1000));
const NAMESPACES = 50;
const TOPICS_PER_NS = 4;

// The wrapper: each subscriber is a socket here and one in the node.
const NEED_FDS = 2 * SUBSCRIBERS + 1024;
if (!process.env.MG_BENCH_ULIMIT) {
  const soft = Number(spawnSync("bash", ["-c", "ulimit -n"]).stdout.toString().trim());
  if (soft < NEED_FDS) {
    const hard = spawnSync("bash", ["-c", "ulimit -Hn"]).stdout.toString().trim();
    const want = hard === "unlimited" ? NEED_FDS : Math.min(Number(hard), NEED_FDS);
    console.error(`bench: ulimit -n ${soft} is below ${NEED_FDS}; re-running under ulimit -n ${want}`);
    const r = spawnSync("bash", ["-c", `ulimit -n ${want} && exec "$0" "$@"`, process.execPath, ...process.argv.slice(1)],
      { stdio: "inherit", env: { ...process.env, MG_BENCH_ULIMIT: "1" } });
    process.exit(r.status ?? 1);
  }
}

const require = createRequire(path.join(ROOT, "tests/e2e/package.json"));
let WebSocket;
try { WebSocket = require("ws"); } catch {
  console.error("bench: the ws package is missing: (cd tests/e2e && npm install)");
  process.exit(2);
}

const TARGET = process.env.CARGO_TARGET_DIR || path.join(ROOT, "target");
const BIN = arg("bin", fs.existsSync(`${TARGET}/release/meshgate`) ? `${TARGET}/release/meshgate` : `${TARGET}/debug/meshgate`);
const PROFILE = /\/release\//.test(BIN) ? "release" : /\/debug\//.test(BIN) ? "debug" : "given";
if (!fs.existsSync(BIN)) {
  console.error(`bench: no binary at ${BIN}: cargo build [--release] --bin meshgate, or pass --bin`);
  process.exit(2);
}
const SECONDS = Number(arg("seconds", 8));
const ROUNDS = Number(arg("rounds", 4));
const CLIENTS = Number(arg("clients", 32));
const VIEWERS = arg("viewers", "1,25").split(",").map(Number);
const KEY = "mgop_bench_operator_key";
const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

const dir = fs.mkdtempSync(path.join(os.tmpdir(), "meshgate-bench-"));
const cfg = path.join(dir, "config.toml");
fs.writeFileSync(cfg, "[rate_limit]\ngeneral_per_minute = 100000000\ngeneral_burst = 10000000\n" +
  "namespace_per_minute = 100000000\nnamespace_burst = 10000000\n");
const child = spawn(BIN, ["serve", "--config", cfg, "--listen", "127.0.0.1:0", "--data-dir", path.join(dir, "data")], {
  env: { ...process.env, MESHGATE_OPERATOR_KEY: KEY, RUST_LOG: "error" }, stdio: ["ignore", "pipe", "inherit"],
});
const cleanup = () => { child.kill("SIGKILL"); fs.rmSync(dir, { recursive: true, force: true }); };
// Bounded: whatever happens, the bench ends.
const watchdog = setTimeout(() => { console.error("bench: timed out"); cleanup(); process.exit(1); },
  (60 + ROUNDS * (1 + VIEWERS.length) * (SECONDS + 4)) * 1000 + 120_000);
const addr = await new Promise((res, rej) => {
  child.on("exit", (c) => rej(new Error(`meshgate exited with ${c}`)));
  createInterface({ input: child.stdout }).on("line", (l) => {
    const m = l.match(/^meshgate listening on http:\/\/(\S+)/); if (m) res(m[1]);
  });
});
const base = `http://${addr}`;
for (let i = 0; i < 300 && (await fetch(`${base}/readyz`).then((r) => r.status, () => 0)) !== 200; i++) await sleep(50);

const keys = [];
for (let i = 0; i < NAMESPACES; i++) {
  const r = await fetch(`${base}/v1/namespaces`, { method: "POST", headers: { authorization: `Bearer ${KEY}`, "content-type": "application/json" }, body: JSON.stringify({ name: `bench-${i}` }) });
  if (r.status !== 201) throw new Error(`create namespace: ${r.status} ${await r.text()}`);
  keys.push((await r.json()).api_key);
}

// Subscribers: subscriber s is in namespace s % 50, on topic t(s / 50 % 4);
// binary framing (the raw payload), so the client side stays cheap.
let delivered = 0, closedEarly = 0;
const sockets = [];
async function openSubscriber(s) {
  const ns = s % NAMESPACES, topic = `t${Math.floor(s / NAMESPACES) % TOPICS_PER_NS}`;
  const ws = new WebSocket(`ws://${addr}/v1/pubsub/ws?topic=${topic}&token=${keys[ns]}&format=binary`);
  ws.on("message", () => { delivered++; });
  await new Promise((res, rej) => { ws.once("open", res); ws.once("error", rej); });
  ws.on("close", () => { if (!ws.benchClosing) closedEarly++; });
  sockets.push(ws);
}
for (let s = 0; s < SUBSCRIBERS; s += 50) {
  await Promise.all(Array.from({ length: Math.min(50, SUBSCRIBERS - s) }, (_, i) => openSubscriber(s + i)));
}

// The node's CPU seconds (utime + stime) from /proc.
const TICKS = Number(spawnSync("getconf", ["CLK_TCK"]).stdout.toString().trim()) || 100;
const cpuSeconds = () => {
  const f = fs.readFileSync(`/proc/${child.pid}/stat`, "utf8").split(") ")[1].split(" ");
  return (Number(f[11]) + Number(f[12])) / TICKS;
};

// Publishers: CLIENTS loops, each on its own namespace and topic in turn.
const payload = Buffer.from("x".repeat(64)).toString("base64");
async function load(seconds) {
  let ok = 0, failed = 0;
  const d0 = delivered, c0 = cpuSeconds(), t0 = Date.now();
  const end = t0 + seconds * 1000;
  await Promise.all(Array.from({ length: CLIENTS }, async (_, c) => {
    let i = 0;
    while (Date.now() < end) {
      const ns = (c + i * CLIENTS) % NAMESPACES, topic = `t${i++ % TOPICS_PER_NS}`;
      const r = await fetch(`${base}/v1/pubsub/publish`, {
        method: "POST",
        headers: { authorization: `Bearer ${keys[ns]}`, "content-type": "application/json" },
        body: `{"topic":"${topic}","data_base64":"${payload}"}`,
      });
      await r.arrayBuffer();
      if (r.status === 200) ok++; else failed++;
    }
  }));
  await sleep(200); // the last deliveries land
  const secs = (Date.now() - t0) / 1000;
  return { pps: ok / seconds, dps: (delivered - d0) / secs, failed, cpu: (cpuSeconds() - c0) / secs };
}

// Viewers read the stream to the end of the run, as a browser tab would.
function openViewers(n) {
  const ctl = new AbortController();
  let bytes = 0, events = 0;
  const done = Promise.all(Array.from({ length: n }, async () => {
    try {
      const r = await fetch(`${base}/__admin/api/stream`, { signal: ctl.signal, headers: { authorization: `Bearer ${KEY}` } });
      for await (const chunk of r.body) { bytes += chunk.length; events += (Buffer.from(chunk).toString().match(/event: snapshot/g) || []).length; }
    } catch { /* aborted */ }
  }));
  return { close: async () => { ctl.abort(); await done; return { bytes, events }; } };
}

await load(3); // warm-up
const rows = [];
const order = [0, ...VIEWERS];
for (let round = 1; round <= ROUNDS; round++) {
  for (const v of round % 2 ? order : [...order].reverse()) {
    const vs = v ? openViewers(v) : null;
    await sleep(1500);
    const r = await load(SECONDS);
    const seen = vs ? await vs.close() : null;
    rows.push({ round, viewers: v, ...r, events: seen?.events, kb: seen ? Math.round(seen.bytes / 1024) : undefined });
    console.error(`round ${round}, ${v} viewers: ${r.pps.toFixed(0)} publishes/s, ${r.dps.toFixed(0)} delivered/s`);
  }
}
// A snapshot of the 50 namespaces as the stream sends it (its size per tick).
const frame = await fetch(`${base}/__admin/api/snapshot`, { headers: { authorization: `Bearer ${KEY}` } }).then((r) => r.text());
const subsShown = JSON.parse(frame).node.ws_subscribers;
for (const ws of sockets) { ws.benchClosing = true; ws.terminate(); }
cleanup();
clearTimeout(watchdog);

console.log(`\npub/sub publishes over HTTP, ${NAMESPACES} namespaces, ${SUBSCRIBERS} WebSocket subscribers ` +
  `(${TOPICS_PER_NS} topics x ${SUBSCRIBERS / NAMESPACES / TOPICS_PER_NS} per namespace, binary), ${CLIENTS} publishers, ` +
  `${SECONDS} s per run, ${ROUNDS} rounds, ${PROFILE} binary ${BIN}, ${os.cpus().length} cores`);
console.log(`subscribers shown by the dashboard at the end: ${subsShown}; closed early: ${closedEarly}; snapshot ${Math.round(frame.length / 1024)} KiB\n`);
console.log("| round | stream viewers | publishes/s accepted | deliveries/s | failed | node CPU (cores) | snapshots received | stream KiB |");
console.log("|---|---|---|---|---|---|---|---|");
for (const r of rows) {
  console.log(`| ${r.round} | ${r.viewers} | ${r.pps.toFixed(0)} | ${r.dps.toFixed(0)} | ${r.failed} | ${r.cpu.toFixed(2)} | ${r.events ?? "-"} | ${r.kb ?? "-"} |`);
}
const mean = (v, k) => { const xs = rows.filter((r) => r.viewers === v).map((r) => r[k]); return xs.reduce((a, b) => a + b, 0) / xs.length; };
console.log("\n| stream viewers | mean publishes/s | ratio open/closed | mean deliveries/s | ratio open/closed |");
console.log("|---|---|---|---|---|");
console.log(`| 0 (closed) | ${mean(0, "pps").toFixed(0)} | 1.000 | ${mean(0, "dps").toFixed(0)} | 1.000 |`);
for (const v of VIEWERS) {
  console.log(`| ${v} | ${mean(v, "pps").toFixed(0)} | ${(mean(v, "pps") / mean(0, "pps")).toFixed(3)} | ` +
    `${mean(v, "dps").toFixed(0)} | ${(mean(v, "dps") / mean(0, "dps")).toFixed(3)} |`);
}
process.exit(0);
