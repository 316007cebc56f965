// The client's paged listings against a real node: `page` returns one page
// and its cursor, `items`/`all` follow the cursor to every item once.
import { after, before, test } from "node:test";
import assert from "node:assert/strict";
import { Client, MeshgateError } from "../dist/index.js";
import { OP, api, createNamespace, startNode, tempDir } from "./helpers.mjs";

let node;
let key;
const KEYS = ["p/0", "p/1", "p/2", "p/3", "p/4", "p/5", "p/6"];

before(async () => {
  node = await startNode({ dataDir: tempDir() });
  key = await createNamespace(node.base, "tspage");
  for (const k of [...KEYS, "q/0"]) {
    const r = await api(node.base, "PUT", `/v1/kv/${k}`, key, "v");
    assert.equal(r.status, 200, r.text);
  }
  for (const n of ["tspage0", "tspage1", "tspage2"]) await createNamespace(node.base, n);
});

after(async () => {
  await node?.stop("SIGTERM");
});

test("page returns at most limit items and a cursor that resumes after them; the last page has none", async () => {
  const c = new Client({ url: node.base, token: key });
  const seen = [];
  let cursor;
  let pages = 0;
  for (;;) {
    const p = await c.page("kv", { prefix: "p/", limit: 3, cursor });
    assert.ok(p.items.length <= 3);
    seen.push(...p.items);
    pages++;
    if (p.nextCursor === null) break;
    assert.equal(typeof p.nextCursor, "string");
    cursor = p.nextCursor;
  }
  assert.equal(pages, 3);
  assert.deepEqual(seen, KEYS);
});

test("items and all follow the cursor to every item exactly once", async () => {
  const c = new Client({ url: node.base, token: key });
  const it = [];
  for await (const k of c.items("kv", { prefix: "p/", limit: 2 })) it.push(k);
  assert.deepEqual(it, KEYS);
  assert.deepEqual(await c.all("kv", { prefix: "p/", limit: 3 }), KEYS);
  const op = new Client({ url: node.base, token: OP });
  const names = (await op.all("namespaces", { limit: 2 })).map((n) => n.name).filter((n) => n.startsWith("tspage"));
  assert.deepEqual(names, ["tspage", "tspage0", "tspage1", "tspage2"]);
  const keys = await c.all("apiKeys", { limit: 1 });
  assert.equal(keys.length, 1);
});

test("a garbled cursor and a bad limit are refused with the server's codes", async () => {
  const c = new Client({ url: node.base, token: key });
  await assert.rejects(c.page("kv", { cursor: "AAAA" }), (e) => e instanceof MeshgateError && e.code === "INVALID_CURSOR");
  await assert.rejects(c.page("functions", { limit: 0 }), (e) => e instanceof MeshgateError && e.code === "INVALID_LIMIT");
});
