// The client's session methods against a real node: `sessions` lists the
// token's own sessions, `endSession`/`endDeviceSessions` end them and the
// ended token is refused; an unknown sid rejects with SESSION_NOT_FOUND.
import { after, before, test } from "node:test";
import assert from "node:assert/strict";
import { Client, MeshgateError } from "../dist/index.js";
import { api, createNamespace, startNode, tempDir } from "./helpers.mjs";

let node;
let key;

before(async () => {
  node = await startNode({ dataDir: tempDir() });
  key = await createNamespace(node.base, "tssess");
});

after(async () => {
  await node?.stop("SIGTERM");
});

async function signIn(device) {
  const r = await fetch(node.base + "/v1/auth/token", {
    method: "POST",
    headers: { "content-type": "application/json" },
    body: JSON.stringify({ api_key: key, device_id: device }),
  });
  assert.equal(r.status, 200);
  return r.json();
}

test("sessions lists both devices; endDeviceSessions and endSession end them", async () => {
  const phone = await signIn("ts-phone");
  const laptop = await signIn("ts-laptop");
  const c = new Client({ url: node.base, token: laptop.access_token });
  const listed = await c.sessions();
  assert.deepEqual(listed.map((s) => s.device_id).sort(), ["ts-laptop", "ts-phone"]);
  assert.equal(listed.find((s) => s.sid === laptop.session_id).current, true);
  assert.deepEqual(await c.endDeviceSessions("ts-phone"), [phone.session_id]);
  const who = await api(node.base, "GET", "/v1/auth/whoami", phone.access_token);
  assert.equal(who.status, 401, who.text);
  assert.match(who.text, /SESSION_REVOKED/);
  assert.deepEqual((await c.sessions()).map((s) => s.sid), [laptop.session_id]);
  await assert.rejects(c.endSession(phone.session_id), (e) => e instanceof MeshgateError && e.code === "SESSION_NOT_FOUND");
  assert.deepEqual(await c.endSession(laptop.session_id), [laptop.session_id]);
});
