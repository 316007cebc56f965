// A node with many namespaces (issue #42): for each count, a fresh node gets N
// namespaces with one KV write each; then, with nobody watching the
// dashboard, the node's CPU over 10 s (from /proc/<pid>/stat) and the
// dashboard snapshots taken; then the size of `/metrics`, of one dashboard
// event (one tick's payload) and of the snapshot JSON, and the CPU over 10 s
// with one event stream open. Prints a table.
//
//   node scripts/bench-scale.mjs [--bin PATH] [--namespaces 1000,10000] [--idle-seconds 10]
//        [--clients 32]
//
// The binary defaults to $CARGO_TARGET_DIR/release/meshgate when it exists,
// else the debug one (the table says which). Needs nothing from npm.
import { spawn, spawnSync } from "node:child_process";
import fs from "node:fs";
import os from "node:os";
import path from "node:path";
import { createInterface } from "node:readline";
import { fileURLToPath } from "node:url";

const ROOT = path.resolve(path.dirname(fileURLToPath(import.meta.url)), "..");
const arg = (n, d) => { const i = process.argv.indexOf(`--${n}`); return i > 0 ? process.argv[i + 1] : d; };
const TARGET = process.env.CARGO_TARGET_DIR || path.join(ROOT, "target");
const BIN = arg("bin", fs.existsSync(`${TARGET}/release/meshgate`) ? `${TARGET}/release/meshgate` : `${TARGET}/debug/meshgate`);
const PROFILE = /\/release\//.test(BIN) ? "release" : /\/debug\//.test(BIN) ? "debug" : "given";
if (!fs.existsSync(BIN)) {
  console.error(`bench: no binary at ${BIN}: cargo build [--release] --bin meshgate, or pass --bin`);
  process.exit(2);
}
const COUNTS = arg("namespaces", "1000,10000").split(",").map(Number);
const IDLE = Number(arg("idle-seconds", 10));
const CLIENTS = Number(arg("clients", 32));
const KEY = "mgop_bench_operator_key";
const TICKS = Number(spawnSync("getconf", ["CLK_TCK"]).stdout.toString().trim()) || 100;
const sleep = (ms) => new Promise((r) => setTimeout(r, ms));
const kb = (n) => `${(n / 1024).toFixed(1)} KB`;

async function startNode() {
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), "meshgate-scale-"));
  const cfg = path.join(dir, "config.toml");
  fs.writeFileSync(cfg, "[rate_limit]\ngeneral_per_minute = 100000000\ngeneral_burst = 10000000\n" +
    "namespace_per_minute = 100000000\nnamespace_burst = 10000000\n");
  const child = spawn(BIN, ["serve", "--config", cfg, "--listen", "127.0.0.1:0", "--data-dir", path.join(dir, "data")], {
    env: { ...process.env, MESHGATE_OPERATOR_KEY: KEY, RUST_LOG: "error" }, stdio: ["ignore", "pipe", "inherit"],
  });
  const addr = await new Promise((res, rej) => {
    child.on("exit", (c) => rej(new Error(`meshgate exited with ${c}`)));
    createInterface({ input: child.stdout }).on("line", (l) => {
      const m = l.match(/^meshgate listening on http:\/\/(\S+)/); if (m) res(m[1]);
    });
  });
  const base = `http://${addr}`;
  for (let i = 0; i < 300 && (await fetch(`${base}/readyz`).then((r) => r.status, () => 0)) !== 200; i++) await sleep(50);
  const stop = () => { child.kill("SIGKILL"); fs.rmSync(dir, { recursive: true, force: true }); };
  return { child, base, stop };
}

const cpuSeconds = (pid) => {
  const f = fs.readFileSync(`/proc/${pid}/stat`, "utf8").split(") ")[1].split(" ");
  return (Number(f[11]) + Number(f[12])) / TICKS;
};
const rssBytes = (pid) => {
  const m = fs.readFileSync(`/proc/${pid}/status`, "utf8").match(/VmRSS:\s+(\d+) kB/);
  return m ? Number(m[1]) * 1024 : 0;
};
const op = (base, method, p, body) => fetch(base + p, {
  method, headers: { authorization: `Bearer ${KEY}`, "content-type": "application/json" }, body,
});

async function cpuOver(pid, seconds) {
  const c0 = cpuSeconds(pid), t0 = Date.now();
  await sleep(seconds * 1000);
  return (cpuSeconds(pid) - c0) / ((Date.now() - t0) / 1000);
}

async function snapshotsTaken(base) {
  const text = await (await op(base, "GET", "/metrics")).text();
  const m = text.match(/^meshgate_dashboard_snapshots_total (\S+)$/m);
  return m ? Number(m[1]) : NaN;
}

// Opens the event stream and resolves with the sizes of the events once
// `count` have arrived; `close()` ends it.
async function openStream(base, count) {
  const ctl = new AbortController();
  const r = await fetch(`${base}/__admin/api/stream`, { headers: { authorization: `Bearer ${KEY}` }, signal: ctl.signal });
  const reader = r.body.getReader();
  const sizes = [];
  let buf = "";
  const dec = new TextDecoder();
  const done = (async () => {
    for (;;) {
      const { value, done: end } = await reader.read().catch(() => ({ done: true }));
      if (end) return;
      buf += dec.decode(value, { stream: true });
      let i;
      while ((i = buf.indexOf("\n\n")) >= 0) {
        const block = buf.slice(0, i + 2);
        buf = buf.slice(i + 2);
        if (block.includes("event: snapshot")) sizes.push(Buffer.byteLength(block));
        if (sizes.length === count) return;
      }
    }
  })();
  return { sizes, first: done, close: () => ctl.abort() };
}

async function run(n) {
  const node = await startNode();
  const pid = node.child.pid;
  try {
    const t0 = Date.now();
    let next = 0;
    await Promise.all(Array.from({ length: CLIENTS }, async () => {
      for (let i = next++; i < n; i = next++) {
        const name = `ns-${String(i).padStart(6, "0")}`;
        const r = await op(node.base, "POST", "/v1/namespaces", JSON.stringify({ name }));
        if (r.status !== 201) throw new Error(`create ${name}: ${r.status} ${await r.text()}`);
        const key = (await r.json()).api_key;
        const w = await fetch(`${node.base}/v1/kv/k`, { method: "PUT", headers: { authorization: `Bearer ${key}` }, body: "v" });
        if (w.status !== 200) throw new Error(`kv ${name}: ${w.status} ${await w.text()}`);
      }
    }));
    const setup = (Date.now() - t0) / 1000;
    await sleep(3000); // let the writes' follow-up work settle
    const idleCpu = await cpuOver(pid, IDLE);
    const snapsIdle = await snapshotsTaken(node.base);
    const m0 = Date.now();
    const metrics = Buffer.byteLength(await (await op(node.base, "GET", "/metrics")).text());
    const metricsMs = Date.now() - m0;
    const stream = await openStream(node.base, 4);
    await stream.first;
    // The first event is the frame from before the stream (none: an empty one).
    const tick = Math.max(...stream.sizes.slice(1));
    const snap = Buffer.byteLength(await (await op(node.base, "GET", "/__admin/api/snapshot")).text());
    const watchedCpu = await cpuOver(pid, IDLE);
    stream.close();
    const snapsAfter = await snapshotsTaken(node.base);
    const rss = rssBytes(pid);
    return { n, setup, idleCpu, snapsIdle, metrics, metricsMs, tick, snap, watchedCpu, snapsAfter, rss };
  } finally {
    node.stop();
  }
}

const rows = [];
for (const n of COUNTS) {
  console.error(`bench: ${n} namespaces…`);
  rows.push(await run(n));
}
const rev = spawnSync("git", ["-C", ROOT, "rev-parse", "--short", "HEAD"]).stdout.toString().trim();
console.log(`meshgate ${PROFILE} build (${BIN}), commit ${rev}, ${os.cpus().length} cores; idle and watched CPU over ${IDLE} s each`);
console.log("| namespaces | setup | idle CPU (no viewer) | snapshots with no viewer | /metrics | /metrics render | dashboard event per tick | /__admin/api/snapshot | CPU, one stream open | RSS |");
console.log("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
for (const r of rows) {
  console.log(`| ${r.n.toLocaleString("en-US")} | ${r.setup.toFixed(0)} s | ${(100 * r.idleCpu).toFixed(2)} % | ${r.snapsIdle} | ${kb(r.metrics)} | ${r.metricsMs} ms | ${kb(r.tick)} | ${kb(r.snap)} | ${(100 * r.watchedCpu).toFixed(2)} % | ${(r.rss / 1048576).toFixed(0)} MB |`);
}
