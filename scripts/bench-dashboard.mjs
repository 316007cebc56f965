// Dashboard cost: KV-write throughput of a node with the dashboard stream closed
// vs open (50 namespaces, many concurrent clients). Prints a table.
//
//   node scripts/bench-dashboard.mjs [--bin target/debug/meshgate] [--seconds 8]
//        [--rounds 3] [--clients 64] [--viewers 1,25]
//
// Publish throughput replaces KV writes once pub/sub lands; until then every KV
// write goes through its namespace's supervisor actor, which the sampler reads.
import { spawn } from "node:child_process";
import fs from "node:fs";
import os from "node:os";
import path from "node:path";
import { createInterface } from "node:readline";

const arg = (n, d) => { const i = process.argv.indexOf(`--${n}`); return i > 0 ? process.argv[i + 1] : d; };
const BIN = arg("bin", `${process.env.CARGO_TARGET_DIR || "target"}/debug/meshgate`);
const SECONDS = Number(arg("seconds", 8));
const ROUNDS = Number(arg("rounds", 3));
const CLIENTS = Number(arg("clients", 64));
const VIEWERS = arg("viewers", "1,25").split(",").map(Number);
const NAMESPACES = 50;
// `get` (default): KV reads, each handled by the namespace's supervisor actor.
// `put`: KV writes; see BENCHMARKS.md for why writes are not the default yet.
const OP = arg("op", "get");
const KEY = "mgop_bench_operator_key";
const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

const dir = fs.mkdtempSync(path.join(os.tmpdir(), "meshgate-bench-"));
const cfg = path.join(dir, "config.toml");
fs.writeFileSync(cfg, "[rate_limit]\ngeneral_per_minute = 100000000\ngeneral_burst = 10000000\n" +
  "namespace_per_minute = 100000000\nnamespace_burst = 10000000\n");
const child = spawn(BIN, ["serve", "--config", cfg, "--listen", "127.0.0.1:0", "--data-dir", path.join(dir, "data")], {
  env: { ...process.env, MESHGATE_OPERATOR_KEY: KEY, RUST_LOG: "error" }, stdio: ["ignore", "pipe", "inherit"],
});
const addr = await new Promise((res) => createInterface({ input: child.stdout }).on("line", (l) => {
  const m = l.match(/^meshgate listening on http:\/\/(\S+)/); if (m) res(m[1]);
}));
const base = `http://${addr}`;
for (let i = 0; i < 300 && (await fetch(`${base}/readyz`).then((r) => r.status, () => 0)) !== 200; i++) await sleep(50);

const keys = [];
for (let i = 0; i < NAMESPACES; i++) {
  const r = await fetch(`${base}/v1/namespaces`, { method: "POST", headers: { authorization: `Bearer ${KEY}`, "content-type": "application/json" }, body: JSON.stringify({ name: `bench-${i}` }) });
  keys.push((await r.json()).api_key);
}

async function load(seconds) {
  let ok = 0, failed = 0;
  const end = Date.now() + seconds * 1000;
  await Promise.all(Array.from({ length: CLIENTS }, async (_, c) => {
    const key = keys[c % NAMESPACES];
    let i = 0;
    while (Date.now() < end) {
      const url = `${base}/v1/kv/c${c}/${i++ % 10}`;
      const r = OP === "put"
        ? await fetch(url, { method: "PUT", headers: { authorization: `Bearer ${key}` }, body: "x".repeat(64) })
        : await fetch(url, { headers: { authorization: `Bearer ${key}` } });
      await r.arrayBuffer();
      if (r.status === 200) ok++; else failed++;
    }
  }));
  return { rps: ok / seconds, failed };
}

// Viewers read the stream to the end of the round, as a browser tab would.
function openViewers(n) {
  const ctl = new AbortController();
  let bytes = 0, events = 0;
  const done = Promise.all(Array.from({ length: n }, async () => {
    try {
      const r = await fetch(`${base}/__admin/api/stream`, { signal: ctl.signal });
      for await (const chunk of r.body) { bytes += chunk.length; events += (Buffer.from(chunk).toString().match(/event: snapshot/g) || []).length; }
    } catch { /* aborted */ }
  }));
  return { close: async () => { ctl.abort(); await done; return { bytes, events }; } };
}

// Seed the keys the readers read, one client at a time (sequential writes).
for (let c = 0; c < CLIENTS; c++) {
  for (let i = 0; i < 10; i++) {
    await fetch(`${base}/v1/kv/c${c}/${i}`, { method: "PUT", headers: { authorization: `Bearer ${keys[c % NAMESPACES]}` }, body: "x".repeat(64) }).then((r) => r.arrayBuffer());
  }
}
await load(3); // warm-up: every namespace supervisor started, sled warmed
const rows = [];
for (let round = 1; round <= ROUNDS; round++) {
  const closed = await load(SECONDS);
  rows.push({ round, viewers: 0, ...closed });
  for (const v of VIEWERS) {
    const vs = openViewers(v);
    await sleep(1500);
    const open = await load(SECONDS);
    const seen = await vs.close();
    rows.push({ round, viewers: v, ...open, events: seen.events, kb: Math.round(seen.bytes / 1024) });
  }
}
child.kill("SIGKILL");
fs.rmSync(dir, { recursive: true, force: true });

console.log(`\nKV ${OP}s, ${NAMESPACES} namespaces, ${CLIENTS} clients, ${SECONDS} s per run, ${ROUNDS} rounds, binary ${BIN}\n`);
console.log("| round | stream viewers | KV ops/s | failed | snapshots received | stream KiB |");
console.log("|---|---|---|---|---|---|");
for (const r of rows) console.log(`| ${r.round} | ${r.viewers} | ${r.rps.toFixed(0)} | ${r.failed} | ${r.events ?? "-"} | ${r.kb ?? "-"} |`);
const mean = (v) => { const xs = rows.filter((r) => r.viewers === v).map((r) => r.rps); return xs.reduce((a, b) => a + b, 0) / xs.length; };
console.log("\n| stream viewers | mean KV ops/s | ratio open/closed |");
console.log("|---|---|---|");
console.log(`| 0 (closed) | ${mean(0).toFixed(0)} | 1.000 |`);
for (const v of VIEWERS) console.log(`| ${v} | ${mean(v).toFixed(0)} | ${(mean(v) / mean(0)).toFixed(3)} |`);
