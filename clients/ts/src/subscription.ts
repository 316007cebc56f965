// A subscription to one topic of the `/v1/ws` socket: its handlers, its
// state, and the last stream position seen (for recovery after a reconnect).

import { Emitter } from "./emitter.js";
import { MeshgateError } from "./errors.js";
import type { Data } from "./util.js";
import { utf8 } from "./util.js";
import type { Client, HistoryOptions, HistoryPage, PresenceMember, PublishResult } from "./client.js";

/** A position in a history topic's stream: offsets only mean something within their epoch. */
export interface StreamPosition {
  offset: number;
  epoch: string;
}

/** One message received on a topic. */
export interface Publication {
  topic: string;
  /** The raw payload. */
  data: Uint8Array;
  /** Unix milliseconds when the node accepted it. */
  timestamp: number;
  /** Its offset, on topics with a history rule. */
  offset?: number;
  /** The topic's epoch, when known (history topics). */
  epoch?: string;
  /** The payload as UTF-8 text. */
  text(): string;
  /** The payload parsed as JSON. */
  json<T = unknown>(): T;
}

/** A presence event: a member joined (its first connection) or left (its last one). */
export interface PresenceEvent {
  topic: string;
  event: "join" | "leave";
  memberId: string;
  meta: unknown;
  timestamp: number;
  offset?: number;
}

/** What `subscribed` tells, like centrifuge-js's SubscribedContext. */
export interface SubscribedContext {
  topic: string;
  /** This subscribe asked the server to recover from the last position seen. */
  wasRecovering: boolean;
  /** The server recovered every publication missed (they follow, in order, before live ones). */
  recovered: boolean;
  /** Recovered, and at least one publication was missed and follows. */
  hasRecoveredPublications: boolean;
  /** The topic keeps a history (the answer carried an epoch): recovery is possible. */
  recoverable: boolean;
  /** The client knows its position in the topic's stream. */
  positioned: boolean;
  /** The position after this subscribe (the top offset, or the recovery's starting point). */
  streamPosition?: StreamPosition;
}

/** What `recovered` tells: emitted once every missed publication has been delivered. */
export interface RecoveredContext {
  topic: string;
  /** The last offset seen before the reconnect. */
  fromOffset: number;
  /** The top offset when the server recovered; publications after it are live ones. */
  toOffset: number;
  epoch: string;
  /** How many publications were replayed. */
  publications: number;
}

/** Why a subscription went back to `subscribing` or `unsubscribed`. */
export interface StateContext {
  topic: string;
  code: string;
  reason: string;
}

export type SubscriptionState = "unsubscribed" | "subscribing" | "subscribed";

export interface SubscriptionEvents extends Record<string, unknown> {
  publication: Publication;
  subscribing: StateContext;
  subscribed: SubscribedContext;
  recovered: RecoveredContext;
  unsubscribed: StateContext;
  join: PresenceEvent;
  leave: PresenceEvent;
  error: { topic: string; error: MeshgateError };
}

export interface SubscriptionOptions {
  /** Join the topic's presence as this member (1-128 bytes); `meta` is any JSON (≤ 1 KiB). */
  presence?: { memberId: string; meta?: unknown };
  /** Recover missed publications when resubscribing (default true). */
  recover?: boolean;
  /** Start from this position: the first subscribe already asks to recover from it. */
  since?: StreamPosition;
  onPublication?: (p: Publication) => void;
  onSubscribed?: (ctx: SubscribedContext) => void;
  onRecovered?: (ctx: RecoveredContext) => void;
  onSubscribing?: (ctx: StateContext) => void;
  onUnsubscribed?: (ctx: StateContext) => void;
  onJoin?: (e: PresenceEvent) => void;
  onLeave?: (e: PresenceEvent) => void;
  onError?: (e: { topic: string; error: MeshgateError }) => void;
}

/** The client's side of a subscribe frame in flight. */
export interface PendingSubscribe {
  id: number;
  wasRecovering: boolean;
  from?: StreamPosition;
}

export class Subscription extends Emitter<SubscriptionEvents> {
  readonly topic: string;
  readonly options: SubscriptionOptions;
  private _state: SubscriptionState = "unsubscribed";
  /** @internal Whether the user wants it subscribed (kept across reconnects). */
  desired = false;
  /** @internal The last offset seen; `epoch` undefined until the subscribe's answer names it. */
  pos: { offset: number; epoch?: string } | null = null;
  /** @internal The subscribe frame in flight, if any. */
  pending: PendingSubscribe | null = null;
  /** @internal While replaying a recovery: the top offset to reach, and where it started. */
  catchUp: { from: number; to: number; epoch: string } | null = null;
  private waiters: { resolve: (c: SubscribedContext) => void; reject: (e: MeshgateError) => void }[] = [];

  /** @internal Made by `Client.newSubscription`. */
  constructor(
    private readonly client: Client,
    topic: string,
    options: SubscriptionOptions = {},
  ) {
    super();
    this.topic = topic;
    this.options = options;
    if (options.since) this.pos = { ...options.since };
    const o = options;
    if (o.onPublication) this.on("publication", o.onPublication);
    if (o.onSubscribed) this.on("subscribed", o.onSubscribed);
    if (o.onRecovered) this.on("recovered", o.onRecovered);
    if (o.onSubscribing) this.on("subscribing", o.onSubscribing);
    if (o.onUnsubscribed) this.on("unsubscribed", o.onUnsubscribed);
    if (o.onJoin) this.on("join", o.onJoin);
    if (o.onLeave) this.on("leave", o.onLeave);
    if (o.onError) this.on("error", o.onError);
  }

  get state(): SubscriptionState {
    return this._state;
  }

  /** The last position seen on a history topic (what a resubscribe recovers from). */
  get streamPosition(): StreamPosition | undefined {
    return this.pos && this.pos.epoch !== undefined ? { offset: this.pos.offset, epoch: this.pos.epoch } : undefined;
  }

  /**
   * Subscribes (now if connected, else once connected). Resolves with the
   * first `subscribed` context; rejects with the server's error
   * (`ForbiddenError` for `MISSING_GRANT`, ...). It stays subscribed across
   * reconnects until `unsubscribe()`.
   */
  subscribe(): Promise<SubscribedContext> {
    const p = new Promise<SubscribedContext>((resolve, reject) => this.waiters.push({ resolve, reject }));
    // Refusals are also `error` events: a caller that does not await must not crash Node.
    p.catch(() => {});
    if (this._state === "subscribed") {
      this.settle(null, this.lastCtx!);
      return p;
    }
    if (!this.desired) {
      this.desired = true;
      this.setState("subscribing", { topic: this.topic, code: "SUBSCRIBE", reason: "subscribe called" });
      this.client._sendSubscribe(this);
    }
    return p;
  }

  /** Leaves the topic (and its presence). Resolves once the server answered, or at once when offline. */
  async unsubscribe(): Promise<void> {
    if (!this.desired && this._state === "unsubscribed") return;
    this.desired = false;
    this.pending = null;
    this.catchUp = null;
    // A later subscribe starts live again: only a reconnect recovers.
    this.pos = null;
    this.setState("unsubscribed", { topic: this.topic, code: "UNSUBSCRIBE", reason: "unsubscribe called" });
    this.settle(new MeshgateError("UNSUBSCRIBED", "unsubscribed before the server answered"));
    await this.client._sendUnsubscribe(this);
  }

  /** Publishes to this topic (see `Client.publish`). */
  publish(data: Data): Promise<PublishResult> {
    return this.client.publish(this.topic, data);
  }

  /** The topic's present members, over HTTP (`GET /v1/pubsub/presence`). */
  presence(): Promise<PresenceMember[]> {
    return this.client.presence(this.topic);
  }

  /** A page of the topic's history, over HTTP (`GET /v1/pubsub/history`). */
  history(opts: HistoryOptions = {}): Promise<HistoryPage> {
    return this.client.history(this.topic, opts);
  }

  private lastCtx?: SubscribedContext;

  /** @internal */
  _setState(s: SubscriptionState, ctx: StateContext): void {
    this.setState(s, ctx);
  }

  private setState(s: SubscriptionState, ctx: StateContext): void {
    if (this._state === s) return;
    this._state = s;
    if (s === "subscribing") this.emit("subscribing", ctx);
    if (s === "unsubscribed") this.emit("unsubscribed", ctx);
  }

  /** @internal The server answered the subscribe. */
  _subscribed(ctx: SubscribedContext): void {
    this._state = "subscribed";
    this.lastCtx = ctx;
    this.emit("subscribed", ctx);
    this.settle(null, ctx);
  }

  /** @internal The server refused the subscribe for good. */
  _failed(err: MeshgateError): void {
    this.desired = false;
    this.pending = null;
    this.setState("unsubscribed", { topic: this.topic, code: err.code, reason: err.message });
    this.emit("error", { topic: this.topic, error: err });
    this.settle(err);
  }

  /** @internal A publication (or presence event) for this topic, already ordered and deduplicated. */
  _deliver(p: Publication): void {
    const presence = parsePresence(p);
    if (presence) this.emit(presence.event, presence);
    else this.emit("publication", p);
    const c = this.catchUp;
    if (c && p.offset !== undefined && p.offset >= c.to) {
      this.catchUp = null;
      this._recovered(c);
    }
  }

  /** @internal Every missed publication was delivered. */
  _recovered(c: { from: number; to: number; epoch: string }): void {
    this.emit("recovered", { topic: this.topic, fromOffset: c.from, toOffset: c.to, epoch: c.epoch, publications: c.to - c.from });
  }

  /** @internal */
  _error(err: MeshgateError): void {
    this.emit("error", { topic: this.topic, error: err });
  }

  private settle(err: MeshgateError | null, ctx?: SubscribedContext): void {
    const w = this.waiters;
    this.waiters = [];
    for (const x of w) err ? x.reject(err) : x.resolve(ctx!);
  }
}

/** The node publishes join and leave on the topic itself as this JSON (docs/pubsub.md, "Presence"). */
function parsePresence(p: Publication): PresenceEvent | null {
  // Cheap test before parsing: presence payloads start with `{"type":"presence"`.
  if (p.data.length < 20 || p.data[0] !== 0x7b) return null;
  let v: any;
  try {
    v = JSON.parse(utf8(p.data));
  } catch {
    return null;
  }
  if (!v || v.type !== "presence" || (v.event !== "join" && v.event !== "leave") || v.topic !== p.topic) return null;
  if (typeof v.member_id !== "string") return null;
  return {
    topic: p.topic,
    event: v.event,
    memberId: v.member_id,
    meta: v.meta ?? null,
    timestamp: typeof v.timestamp === "number" ? v.timestamp : p.timestamp,
    offset: p.offset,
  };
}
