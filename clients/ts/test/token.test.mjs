// Token refresh against a real node issuing 1-second JWTs
// (MESHGATE_AUTH_ACCESS_TOKEN_SECONDS=1). The node refuses a JWT with
// TOKEN_EXPIRED only 60 s past its `exp` (JWT_LEEWAY, docs/auth.md), so one
// test waits for that; the file runs beside the others.
import { after, before, test } from "node:test";
import assert from "node:assert/strict";
import { Client, UnauthorizedError } from "../dist/index.js";
import { createNamespace, jwt, next, sleep, startNode, startProxy, tempDir, waitFor } from "./helpers.mjs";

let node;
let proxy;
let key;
let early; // a JWT made first, expired for the node by the last test
const clients = [];

const claims = (t) => JSON.parse(Buffer.from(t.split(".")[1], "base64url").toString());

before(async () => {
  node = await startNode({ dataDir: tempDir(), env: { MESHGATE_AUTH_ACCESS_TOKEN_SECONDS: "1" } });
  proxy = await startProxy(() => node.port);
  key = await createNamespace(node.base, "tok");
  early = await jwt(node.base, key);
});

after(async () => {
  for (const c of clients) c.disconnect();
  await proxy?.close();
  await node?.stop("SIGTERM");
});

function client(opts) {
  const c = new Client({ url: proxy.url, minReconnectDelayMs: 100, maxReconnectDelayMs: 400, ...opts });
  clients.push(c);
  return c;
}

test("getToken gives the first token when none is set", async () => {
  let calls = 0;
  const c = client({ getToken: async () => (calls++, jwt(node.base, key)) });
  await c.connect();
  assert.equal(calls, 1);
  assert.equal(c.state, "connected");
});

test("a reconnect with an expired JWT asks getToken for a fresh one", async () => {
  const tokens = [];
  const first = await jwt(node.base, key);
  const c = client({
    token: first,
    // Refresh only once the JWT's exp has passed (the default margin is 30 s).
    tokenRefreshMarginMs: 0,
    getToken: async () => {
      const t = await jwt(node.base, key);
      tokens.push(t);
      return t;
    },
  });
  const sub = c.newSubscription("news");
  const got = [];
  sub.on("publication", (p) => got.push(p.text()));
  await c.connect();
  await sub.subscribe();
  assert.equal(tokens.length, 0, "the given token is used first");
  await waitFor(() => Date.now() / 1000 > claims(first).exp, "the JWT's exp");
  const resubscribed = next(sub, "subscribed");
  proxy.cut();
  await resubscribed;
  assert.equal(tokens.length, 1, "one refresh on reconnect");
  await c.publish("news", "after refresh");
  await waitFor(() => got.length === 1, "the publication");
});

test("the node says TOKEN_EXPIRED: the client refreshes and connects; without getToken it fails typed", async () => {
  // Past exp + 60 s the node refuses the JWT.
  const wait = (claims(early).exp + 61) * 1000 + 300 - Date.now();
  if (wait > 0) await sleep(wait);
  const bare = client({ token: early });
  const err = await bare.connect().then(() => null, (e) => e);
  assert.ok(err instanceof UnauthorizedError, `got ${err}`);
  assert.equal(err.code, "TOKEN_EXPIRED");
  assert.equal(err.status, 401);

  let calls = 0;
  const c = client({
    token: early,
    // Trust the token locally for longer than the node does, so the node is the one to say it.
    tokenRefreshMarginMs: -300_000,
    getToken: async () => (calls++, jwt(node.base, key)),
  });
  const connecting = [];
  c.on("connecting", (e) => connecting.push(e));
  await c.connect();
  assert.equal(calls, 1);
  assert.equal(connecting.at(-1).error?.code, "TOKEN_EXPIRED");
  assert.equal(connecting.at(-1).delayMs, 0, "retried at once with the new token");
  assert.ok((await c.ping()) >= 0);
});
