// Test helpers: a real meshgate node started by the test (its own data dir
// and a free 127.0.0.1 port), a TCP proxy between client and node to cut or
// stall connections on demand, and the HTTP calls the tests make.
import { spawn } from "node:child_process";
import fs from "node:fs";
import net from "node:net";
import os from "node:os";
import path from "node:path";
import { createInterface } from "node:readline";
import { fileURLToPath } from "node:url";

const HERE = path.dirname(fileURLToPath(import.meta.url));
export const BIN = process.env.MESHGATE_BIN || path.resolve(HERE, "../../../target/debug/meshgate");
export const OP = `mgop_tsclient_${Math.random().toString(36).slice(2)}${Math.random().toString(36).slice(2)}`;
export const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

/** Resolves when `cond()` is truthy (polled), rejects after `ms`. */
export async function waitFor(cond, what, ms = 15_000) {
  const t0 = Date.now();
  for (;;) {
    const v = await cond();
    if (v) return v;
    if (Date.now() - t0 > ms) throw new Error(`timed out waiting for ${what}`);
    await sleep(25);
  }
}

/** A free TCP port on 127.0.0.1. */
export function freePort() {
  return new Promise((resolve, reject) => {
    const s = net.createServer();
    s.on("error", reject);
    s.listen(0, "127.0.0.1", () => {
      const { port } = s.address();
      s.close(() => resolve(port));
    });
  });
}

const temps = [];
/** A fresh folder under the system's temp dir, removed when the test process exits. */
export function tempDir() {
  const d = fs.mkdtempSync(path.join(os.tmpdir(), "meshgate-tsclient-"));
  temps.push(d);
  return d;
}
process.on("exit", () => {
  for (const d of temps) fs.rmSync(d, { recursive: true, force: true });
});

/**
 * Starts `meshgate serve` on 127.0.0.1:`port` with `dataDir`; resolves once
 * /readyz answers 200. `env` adds variables (MESHGATE_<SECTION>_<KEY>).
 */
export async function startNode({ dataDir, port, env = {} }) {
  if (!fs.existsSync(BIN)) throw new Error(`no meshgate binary at ${BIN} (set MESHGATE_BIN)`);
  port ??= await freePort();
  const child = spawn(BIN, ["serve", "--listen", `127.0.0.1:${port}`, "--data-dir", dataDir], {
    env: { ...process.env, MESHGATE_OPERATOR_KEY: OP, RUST_LOG: "warn", ...env },
    stdio: ["ignore", "pipe", "pipe"],
  });
  let stderr = "";
  child.stderr.on("data", (d) => (stderr = (stderr + d).slice(-4000)));
  const exited = new Promise((r) => child.on("exit", r));
  await new Promise((resolve, reject) => {
    const t = setTimeout(() => reject(new Error(`meshgate did not start within 60 s: ${stderr}`)), 60_000);
    child.on("exit", (code) => {
      clearTimeout(t);
      reject(new Error(`meshgate exited early (${code}): ${stderr}`));
    });
    createInterface({ input: child.stdout }).on("line", (line) => {
      if (/^meshgate listening on http:\/\//.test(line)) {
        clearTimeout(t);
        resolve();
      }
    });
  });
  const base = `http://127.0.0.1:${port}`;
  await waitFor(async () => {
    try {
      return (await fetch(`${base}/readyz`)).status === 200;
    } catch {
      return false;
    }
  }, "/readyz", 30_000);
  return {
    child,
    base,
    port,
    dataDir,
    /** Stops the node (SIGKILL by default: a crash) and waits for the exit. */
    async stop(signal = "SIGKILL") {
      if (child.exitCode === null && child.signalCode === null) child.kill(signal);
      await exited;
    },
  };
}

/**
 * A TCP proxy on a free port in front of `target()` (a port). `cut()` resets
 * every connection, `stall()` stops forwarding bytes without closing (a dead
 * peer), `block()` refuses new connections, `open()` lifts both.
 */
export async function startProxy(target) {
  const conns = new Set();
  let stalled = false;
  let blocked = false;
  const server = net.createServer((client) => {
    if (blocked) return client.destroy();
    const upstream = net.connect(target(), "127.0.0.1");
    const c = { client, upstream };
    conns.add(c);
    const end = () => {
      conns.delete(c);
      client.destroy();
      upstream.destroy();
    };
    client.on("data", (d) => stalled || upstream.write(d));
    upstream.on("data", (d) => stalled || client.write(d));
    client.on("close", end);
    upstream.on("close", end);
    client.on("error", end);
    upstream.on("error", end);
  });
  await new Promise((r) => server.listen(0, "127.0.0.1", r));
  return {
    port: server.address().port,
    url: `http://127.0.0.1:${server.address().port}`,
    get connections() {
      return conns.size;
    },
    cut() {
      for (const c of [...conns]) {
        c.client.resetAndDestroy?.() ?? c.client.destroy();
        c.upstream.destroy();
      }
    },
    stall() {
      stalled = true;
    },
    block() {
      blocked = true;
    },
    open() {
      stalled = false;
      blocked = false;
    },
    close() {
      this.cut();
      return new Promise((r) => server.close(r));
    },
  };
}

export async function api(base, method, p, key, body, headers = {}) {
  const r = await fetch(base + p, {
    method,
    headers: { authorization: `Bearer ${key}`, "content-type": "application/json", ...headers },
    body: body === undefined ? undefined : typeof body === "string" ? body : JSON.stringify(body),
  });
  const text = await r.text();
  let json;
  try {
    json = JSON.parse(text);
  } catch {
    json = undefined;
  }
  return { status: r.status, text, json };
}

/** A fresh namespace; resolves with its owner API key. */
export async function createNamespace(base, name) {
  const r = await api(base, "POST", "/v1/namespaces", OP, { name });
  if (!r.json?.api_key) throw new Error(`create namespace ${name}: ${r.status} ${r.text}`);
  return r.json.api_key;
}

/** The namespace's history rules: `[[glob, size], ...]` (the first match applies). */
export async function setHistory(base, ns, key, rules) {
  const r = await api(base, "PUT", `/v1/namespaces/${ns}/pubsub`, key, {
    history: rules.map(([topics, size]) => ({ topics, size, ttl_seconds: 3600 })),
  });
  if (r.status !== 200) throw new Error(`history: ${r.status} ${r.text}`);
}

/** An API key of the namespace with only `grants`. */
export async function limitedKey(base, key, grants) {
  const r = await api(base, "POST", "/v1/auth/api-keys", key, { grants, name: `lim-${Date.now()}` });
  if (!r.json?.api_key) throw new Error(`api key: ${r.status} ${r.text}`);
  return r.json.api_key;
}

/** The repository's example function that writes its input back (examples/functions). */
export const ECHO_WASM = path.resolve(HERE, "../../../examples/functions/echo.wasm");

/** Deploys the module at `wasmPath` as function `name` (multipart `POST /v1/functions`); resolves with its version. */
export async function deployFunction(base, key, name, wasmPath) {
  const form = new FormData();
  form.append("name", name);
  form.append("wasm", new Blob([fs.readFileSync(wasmPath)], { type: "application/wasm" }), `${name}.wasm`);
  const r = await fetch(`${base}/v1/functions`, {
    method: "POST",
    headers: { authorization: `Bearer ${key}` },
    body: form,
  });
  const text = await r.text();
  if (r.status !== 201) throw new Error(`deploy ${name}: ${r.status} ${text}`);
  return JSON.parse(text).function.version;
}

/** A JWT for an API key (`POST /v1/auth/token`). */
export async function jwt(base, key) {
  const r = await api(base, "POST", "/v1/auth/token", key, { api_key: key });
  if (!r.json?.access_token) throw new Error(`token: ${r.status} ${r.text}`);
  return r.json.access_token;
}

/** Publishes over HTTP; resolves with the ack (`{ok, offset?, epoch?}`). */
export async function httpPublish(base, key, topic, text) {
  const r = await api(base, "POST", "/v1/pubsub/publish", key, {
    topic,
    data_base64: Buffer.from(text).toString("base64"),
  });
  if (r.status !== 200) throw new Error(`publish: ${r.status} ${r.text}`);
  return r.json;
}

/** Resolves with the next event `name` of `emitter` (a Client or Subscription). */
export function next(emitter, name, ms = 15_000) {
  return new Promise((resolve, reject) => {
    const t = setTimeout(() => {
      off();
      reject(new Error(`no ${name} event within ${ms} ms`));
    }, ms);
    const off = emitter.on(name, (v) => {
      clearTimeout(t);
      off();
      resolve(v);
    });
  });
}
