// Compiled with --noEmit by test.sh: the published .d.ts serve a TypeScript
// consumer (the names, option and event types the README documents).
import {
  Client,
  CloseCode,
  ForbiddenError,
  MeshgateError,
  type Publication,
  type PublishResult,
  type RecoveredContext,
  type StreamPosition,
  type SubscribedContext,
} from "../dist/index.js";

const client = new Client({ url: "http://127.0.0.1:8080", token: "k", getToken: async () => "t", pingIntervalMs: 1000 });
const sub = client.newSubscription("chat.1", {
  presence: { memberId: "ann", meta: { name: "Ann" } },
  since: { offset: 1, epoch: "e" },
  onPublication: (p: Publication) => console.log(p.offset, p.epoch, p.text(), p.json<{ a: number }>().a),
  onSubscribed: (c: SubscribedContext) => console.log(c.wasRecovering, c.recovered, c.hasRecoveredPublications),
  onRecovered: (r: RecoveredContext) => console.log(r.publications),
  onJoin: (e) => console.log(e.memberId, e.meta),
});
const off: () => void = client.on("connecting", (e) => console.log(e.code === CloseCode.SLOW_CONSUMER, e.delayMs, e.error?.code));
off();
sub.on("error", ({ error }) => error instanceof ForbiddenError && console.log(error.code));

export async function use(): Promise<void> {
  await client.connect();
  const ctx: SubscribedContext = await sub.subscribe();
  const pos: StreamPosition | undefined = ctx.streamPosition ?? sub.streamPosition;
  const ack: PublishResult = await client.publish("chat.1", new Uint8Array([1, 2]));
  const n: number | undefined = ack.offset;
  const members = await client.presence("chat.1");
  const page = await client.history("chat.1", { sinceOffset: pos?.offset, limit: 10 });
  console.log(n, members[0]?.memberId, page.publications.length, client.state, sub.state);
  try {
    await client.publish("x", "y");
  } catch (e) {
    if (e instanceof MeshgateError) console.log(e.code, e.retryable, e.status);
  }
  await sub.unsubscribe();
  client.disconnect();
}
