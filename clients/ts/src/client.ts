// The client of meshgate's full socket `GET /v1/ws` (docs/pubsub.md): one
// connection, many topics; reconnects with jittered exponential backoff and
// resubscribes each topic recovering from the last position it saw.

import { Emitter } from "./emitter.js";
import {
  DisconnectedError,
  ForbiddenError,
  MeshgateError,
  ServerError,
  TimeoutError,
  UnauthorizedError,
  errorFromHttp,
  errorFromServer,
} from "./errors.js";
import { Subscription, type Publication, type SubscriptionOptions } from "./subscription.js";
import { type Data, b64decode, b64encode, backoff, isNode, jwtExpiry, toBytes, utf8 } from "./util.js";

/** Close codes the server sends (docs/pubsub.md, "Liveness and close codes"). */
export const CloseCode = {
  NORMAL: 1000,
  GOING_AWAY: 1001,
  PROTOCOL_ERROR: 1002,
  ABNORMAL: 1006,
  TOO_BIG: 1009,
  READ_TIMEOUT: 4000,
  NAMESPACE_GONE: 4004,
  /** The socket's outbound queue overflowed: frames were dropped. Reconnect and recover. */
  SLOW_CONSUMER: 4008,
  /**
   * What the socket held of a history topic cannot be continued on that
   * node (the topic's epoch changed, or a gap the store no longer fills).
   * Reconnect at once and recover: the server then says whether it could.
   */
  INSUFFICIENT_STATE: 4011,
  /**
   * The operator drained the node: its namespaces moved to other nodes.
   * Reconnect at once (to the next URL when several are given) and recover.
   */
  NODE_DRAINED: 4012,
} as const;

export interface ClientOptions {
  /**
   * The node: `http(s)://host:port` or `ws(s)://host:port` (the path `/v1/ws`
   * is added). Or the nodes of one cluster: the client stays on one while it
   * works and moves to the next when a connection cannot be opened or ends
   * abnormally (1006, 1001 draining), recovering its subscriptions there.
   */
  url: string | string[];
  /** An API key or a JWT (`POST /v1/auth/token`). */
  token?: string;
  /**
   * Gives a fresh token. Called when there is no `token`, before a reconnect
   * when the JWT is expired or expires within `tokenRefreshMarginMs`, and
   * when the server refuses the token (401, e.g. `TOKEN_EXPIRED`).
   */
  getToken?: () => Promise<string>;
  /** The namespace, for the operator key (`?namespace=`). */
  namespace?: string;
  /** First reconnect delay (default 500 ms); doubles per failed attempt, with jitter. */
  minReconnectDelayMs?: number;
  /** Largest reconnect delay (default 20 s). */
  maxReconnectDelayMs?: number;
  /** Client pings every this often (default 25 s, below the server's 75 s read timeout). */
  pingIntervalMs?: number;
  /** No frame at all this long after a ping: the connection is dead (default 10 s). */
  pongTimeoutMs?: number;
  /** Longest wait for an answer to a request (publish, ping, invoke; default 10 s). */
  timeoutMs?: number;
  /** Longest wait for the socket to open (default 10 s). */
  connectTimeoutMs?: number;
  /** Refresh a JWT this long before its `exp` on reconnect (default 30 s). */
  tokenRefreshMarginMs?: number;
  /** A WebSocket constructor to use instead of `ws` (Node) or the browser's. */
  WebSocket?: unknown;
}

export type ClientState = "disconnected" | "connecting" | "connected";

export interface ConnectingContext {
  /** Why: the close code of the connection that ended (0 for the first connect). */
  code: number;
  reason: string;
  /** Reconnect attempts since the last successful connection. */
  attempt: number;
  /** Wait before this attempt. */
  delayMs: number;
  error?: MeshgateError;
}

export interface ConnectedContext {
  url: string;
  /** Not the first connection of this client. */
  reconnected: boolean;
}

export interface DisconnectedContext {
  code: number;
  reason: string;
  /** The error that stopped the client (a refused credential, a deleted namespace). */
  error?: MeshgateError;
}

export interface ClientEvents extends Record<string, unknown> {
  state: ClientState;
  connecting: ConnectingContext;
  connected: ConnectedContext;
  disconnected: DisconnectedContext;
  error: { error: MeshgateError };
  token: { token: string };
}

/** A publish's ack: the offset and epoch on history topics. */
export interface PublishResult {
  offset?: number;
  epoch?: string;
}

export interface PresenceMember {
  memberId: string;
  meta: unknown;
  joinedAt: number;
  connections: number;
}

export interface HistoryOptions {
  sinceOffset?: number;
  epoch?: string;
  limit?: number;
  reverse?: boolean;
}

export interface HistoryPage {
  topic: string;
  epoch: string | null;
  offset: number;
  publications: Publication[];
  /** More kept publications follow in the page's direction (cut by `limit`
   *  or by the node's `max_history_page_bytes`): read on with
   *  `sinceOffset` = the last publication's offset. */
  more: boolean;
}

/**
 * The node's paged listings (README, "Listings are paged"): each answers at
 * most `limit` items (1 to 1000, default 100) and a `next_cursor`.
 * `namespaces` needs the operator key.
 */
export type Listing = "namespaces" | "apiKeys" | "sessions" | "functions" | "deployments" | "kv" | "topics";

/** Where each listing lives and the field its items are in. */
const LISTINGS: Record<Listing, { path: string; field: string }> = {
  namespaces: { path: "/v1/namespaces", field: "namespaces" },
  apiKeys: { path: "/v1/auth/api-keys", field: "keys" },
  sessions: { path: "/v1/auth/sessions", field: "sessions" },
  functions: { path: "/v1/functions", field: "functions" },
  deployments: { path: "/v1/deployments", field: "deployments" },
  kv: { path: "/v1/kv", field: "keys" },
  topics: { path: "/v1/pubsub/topics", field: "topics" },
};

/** One session of a subject, as `GET /v1/auth/sessions` lists it. */
export interface Session {
  sid: string;
  /** The device the sign-in named, or null. */
  device_id: string | null;
  created_at: number;
  last_refresh_at: number | null;
  expires_at: number;
  /** Whether it is the session of the token the client uses. */
  current: boolean;
}

export interface PageOptions {
  /** Items on a page, 1 to 1000 (default: the node's, 100). */
  limit?: number;
  /** Start after this `nextCursor` of an earlier page (default: the first page). */
  cursor?: string;
  /** `kv` only: list the keys starting with this. */
  prefix?: string;
}

/** One page of a listing, in key order. */
export interface Page<T> {
  items: T[];
  /** Pass as `cursor` for the next page; null on the last page. */
  nextCursor: string | null;
}

interface Pending {
  resolve: (v: any) => void;
  reject: (e: MeshgateError) => void;
  timer?: ReturnType<typeof setTimeout>;
  /** Subscribe frames are answered to their subscription. */
  sub?: Subscription;
  frame: Record<string, unknown>;
}

/** One socket: the client opens a new one per (re)connect. */
interface Conn {
  ws: any;
  opened: boolean;
  done: boolean;
  /** The upgrade was refused with this (Node: from the 401/403 body). */
  refusal?: MeshgateError;
  connectTimer?: ReturnType<typeof setTimeout>;
  pingTimer?: ReturnType<typeof setInterval>;
  lastHeard: number;
}

const WS_OPEN = 1;

export class Client extends Emitter<ClientEvents> {
  private readonly o: Required<Omit<ClientOptions, "token" | "getToken" | "namespace" | "WebSocket">> & ClientOptions;
  private token?: string;
  private _state: ClientState = "disconnected";
  private conn: Conn | null = null;
  private wsCtor: any = null;
  private nodeWs = false;
  private nextId = 1;
  /** Requests sent on the current socket, by id: answered in order. */
  private inflight = new Map<number, Pending>();
  /** Requests made while not connected; sent in order once connected. */
  private outbox: { id: number; p: Pending }[] = [];
  private subs = new Map<string, Subscription>();
  private attempt = 0;
  /** Index into `url` when it lists several nodes. */
  private urlAt = 0;
  private reconnectTimer?: ReturnType<typeof setTimeout>;
  private everConnected = false;
  /** The token was refused: get another before the next attempt. */
  private forceRefresh = false;
  /** The current token came from `getToken` and has not opened a socket yet. */
  private tokenFresh = false;
  private connectWaiters: { resolve: () => void; reject: (e: MeshgateError) => void }[] = [];

  constructor(options: ClientOptions) {
    super();
    this.o = {
      minReconnectDelayMs: 500,
      maxReconnectDelayMs: 20_000,
      pingIntervalMs: 25_000,
      pongTimeoutMs: 10_000,
      timeoutMs: 10_000,
      connectTimeoutMs: 10_000,
      tokenRefreshMarginMs: 30_000,
      ...options,
    };
    this.token = options.token;
  }

  get state(): ClientState {
    return this._state;
  }

  /** Connects; resolves once the socket is open, rejects when the credential is refused. */
  connect(): Promise<void> {
    const p = new Promise<void>((resolve, reject) => this.connectWaiters.push({ resolve, reject }));
    // A refusal is also an `error` event: a caller that does not await must not crash Node.
    p.catch(() => {});
    if (this._state === "connected") this.settleConnect(null);
    else if (this._state === "disconnected") {
      this.attempt = 0;
      this.emit("connecting", { code: 0, reason: "connect called", attempt: 0, delayMs: 0 });
      void this.open();
    }
    return p;
  }

  /** Closes the socket and stops reconnecting. Subscriptions are kept: `connect()` resubscribes (recovering). */
  disconnect(): void {
    clearTimeout(this.reconnectTimer);
    const conn = this.conn;
    this.conn = null;
    if (conn) {
      this.finish(conn);
      try {
        conn.ws.close(1000, "client disconnect");
      } catch {
        /* already closed */
      }
    }
    const err = new DisconnectedError("CLIENT_CLOSED", "the client was disconnected");
    this.failRequests(err);
    this.settleConnect(err);
    for (const s of this.subs.values()) {
      s.pending = null;
      s.catchUp = null;
      if (s.desired) s._setState("subscribing", { topic: s.topic, code: "DISCONNECTED", reason: "client disconnect" });
    }
    if (this._state !== "disconnected") {
      this.setState("disconnected");
      this.emit("disconnected", { code: 1000, reason: "client disconnect" });
    }
  }

  /** A subscription to `topic` (one per topic and client); call `subscribe()` on it. */
  newSubscription(topic: string, options: SubscriptionOptions = {}): Subscription {
    if (this.subs.has(topic)) throw new MeshgateError("DUPLICATE_SUBSCRIPTION", `already a subscription to ${topic}`);
    const s = new Subscription(this, topic, options);
    this.subs.set(topic, s);
    return s;
  }

  getSubscription(topic: string): Subscription | undefined {
    return this.subs.get(topic);
  }

  /** Unsubscribes and forgets the subscription. */
  async removeSubscription(s: Subscription): Promise<void> {
    await s.unsubscribe();
    if (this.subs.get(s.topic) === s) this.subs.delete(s.topic);
  }

  /**
   * Publishes on the socket. Acks resolve in the order of the calls (the
   * server answers in order); on history topics they carry `offset` and
   * `epoch`. While disconnected the publish waits for the connection (up to
   * `timeoutMs`); one in flight when the socket drops rejects with
   * `DisconnectedError` (retryable: it may or may not have been accepted).
   */
  async publish(topic: string, data: Data): Promise<PublishResult> {
    const v = await this.request({ type: "publish", topic, data_base64: b64encode(toBytes(data)) });
    const r: PublishResult = {};
    if (typeof v.offset === "number") r.offset = v.offset;
    if (typeof v.epoch === "string") r.epoch = v.epoch;
    return r;
  }

  /** Calls a function of the namespace over the socket; resolves with its `result`. */
  async invoke(fn: string, input: Data = ""): Promise<unknown> {
    const v = await this.request({ type: "invoke", function: fn, input_base64: b64encode(toBytes(input)) });
    return v.result;
  }

  /** An application ping (`{"type":"ping"}`); resolves with the round trip in ms. */
  async ping(): Promise<number> {
    const t = Date.now();
    await this.request({ type: "ping" });
    return Date.now() - t;
  }

  /** The topic's present members (HTTP `GET /v1/pubsub/presence`, grant `pubsub:read:<topic>`). */
  async presence(topic: string): Promise<PresenceMember[]> {
    const v = await this.http("GET", `/v1/pubsub/presence?topic=${encodeURIComponent(topic)}`);
    return (v.members ?? []).map((m: any) => ({
      memberId: m.member_id,
      meta: m.meta ?? null,
      joinedAt: m.joined_at,
      connections: m.connections,
    }));
  }

  /** A page of a history topic's publications (HTTP `GET /v1/pubsub/history`). */
  async history(topic: string, opts: HistoryOptions = {}): Promise<HistoryPage> {
    const q = new URLSearchParams({ topic });
    if (opts.sinceOffset !== undefined) q.set("since_offset", String(opts.sinceOffset));
    if (opts.epoch !== undefined) q.set("epoch", opts.epoch);
    if (opts.limit !== undefined) q.set("limit", String(opts.limit));
    if (opts.reverse) q.set("reverse", "true");
    const v = await this.http("GET", `/v1/pubsub/history?${q}`);
    return {
      topic: v.topic,
      epoch: v.epoch ?? null,
      offset: v.offset ?? 0,
      publications: (v.publications ?? []).map((p: any) =>
        publication(topic, b64decode(p.data_base64 ?? ""), p.timestamp, p.offset, v.epoch ?? undefined),
      ),
      more: v.more === true,
    };
  }

  /**
   * One page of a listing (HTTP `GET`, e.g. `/v1/kv?limit=&cursor=`). The
   * items are as the node answers them: names for `kv`, records for the
   * others.
   */
  async page<T = any>(listing: Listing, opts: PageOptions = {}): Promise<Page<T>> {
    const l = LISTINGS[listing];
    if (!l) throw new TypeError(`unknown listing ${String(listing)}`);
    const q = new URLSearchParams();
    if (opts.prefix !== undefined) q.set("prefix", opts.prefix);
    if (opts.limit !== undefined) q.set("limit", String(opts.limit));
    if (opts.cursor !== undefined) q.set("cursor", opts.cursor);
    const qs = q.toString();
    const v = await this.http("GET", qs ? `${l.path}?${qs}` : l.path);
    return { items: v[l.field] ?? [], nextCursor: v.next_cursor ?? null };
  }

  /**
   * Every item of a listing, page after page (`opts.limit` per request),
   * following `nextCursor` until the last page: `for await (const f of
   * client.items("functions")) ...`.
   */
  async *items<T = any>(listing: Listing, opts: PageOptions = {}): AsyncGenerator<T, void, undefined> {
    let cursor = opts.cursor;
    for (;;) {
      const p: Page<T> = await this.page<T>(listing, { ...opts, cursor });
      yield* p.items;
      if (p.nextCursor === null) return;
      // A cursor that does not move would loop for ever.
      if (p.nextCursor === cursor) throw new ServerError("BAD_CURSOR", `${listing}: the same cursor twice`);
      cursor = p.nextCursor;
    }
  }

  /**
   * The sessions (sign-ins) of the token's own subject in its namespace,
   * every page: `{sid, device_id, created_at, last_refresh_at, expires_at,
   * current}` each.
   */
  async sessions(): Promise<Session[]> {
    return this.all<Session>("sessions");
  }

  /**
   * Ends one of the subject's sessions (`DELETE /v1/auth/sessions/{sid}`):
   * its refresh is refused at once, its access tokens within 2 s. A sid the
   * subject does not have rejects with `SESSION_NOT_FOUND`. Resolves to the
   * sids ended.
   */
  async endSession(sid: string): Promise<string[]> {
    const v = await this.http("DELETE", `/v1/auth/sessions/${encodeURIComponent(sid)}`);
    return v.ended ?? [];
  }

  /** Ends every session of the subject signed in with `deviceId`; the sids ended. */
  async endDeviceSessions(deviceId: string): Promise<string[]> {
    const v = await this.http("DELETE", `/v1/auth/sessions?device_id=${encodeURIComponent(deviceId)}`);
    return v.ended ?? [];
  }

  /** Every item of a listing in one array ([`items`] collected). */
  async all<T = any>(listing: Listing, opts: PageOptions = {}): Promise<T[]> {
    const out: T[] = [];
    for await (const item of this.items<T>(listing, opts)) out.push(item);
    return out;
  }

  // ---- connection -------------------------------------------------------

  private setState(s: ClientState): void {
    if (this._state === s) return;
    this._state = s;
    this.emit("state", s);
  }

  private httpBase(): string {
    return this.url().replace(/^ws(s?):/, "http$1:").replace(/\/v1\/ws\/?$/, "").replace(/\/$/, "");
  }

  private async http(method: string, path: string): Promise<any> {
    const token = this.token ?? (await this.credential());
    const headers: Record<string, string> = { authorization: `Bearer ${token}` };
    if (this.o.namespace) headers["x-namespace"] = this.o.namespace;
    const r = await fetch(this.httpBase() + path, { method, headers });
    const body = await r.text();
    if (!r.ok) throw errorFromHttp(r.status, body);
    return JSON.parse(body);
  }

  /** The token for the next attempt, refreshed when needed. */
  private async credential(): Promise<string> {
    const get = this.o.getToken;
    let need = !this.token || this.forceRefresh;
    if (!need && get && this.token) {
      const exp = jwtExpiry(this.token);
      need = exp !== undefined && exp * 1000 - this.o.tokenRefreshMarginMs <= Date.now();
    }
    if (need) {
      if (!get) {
        if (!this.token) throw new UnauthorizedError("MISSING_CREDENTIAL", "no token and no getToken");
      } else {
        this.token = await get();
        this.tokenFresh = true;
        this.emit("token", { token: this.token });
      }
    }
    this.forceRefresh = false;
    return this.token!;
  }

  private async loadWs(): Promise<any> {
    if (this.wsCtor) return this.wsCtor;
    let ctor: any = this.o.WebSocket;
    if (!ctor && isNode()) {
      // Kept out of bundlers' sight: browsers never load `ws`.
      const spec = "ws";
      const m: any = await import(/* @vite-ignore */ spec);
      ctor = m.default ?? m.WebSocket ?? m;
    }
    if (!ctor) ctor = (globalThis as any).WebSocket;
    if (!ctor) throw new MeshgateError("NO_WEBSOCKET", "no WebSocket implementation: install `ws` (Node)");
    this.nodeWs = typeof ctor.prototype?.on === "function";
    this.wsCtor = ctor;
    return ctor;
  }

  private wsUrl(token: string): string {
    const u = new URL(this.url().replace(/^http(s?):/, "ws$1:"));
    if (!/\/v1\/ws\/?$/.test(u.pathname)) u.pathname = u.pathname.replace(/\/$/, "") + "/v1/ws";
    if (this.o.namespace) u.searchParams.set("namespace", this.o.namespace);
    // A browser cannot set headers on a WebSocket: the credential goes in the query.
    if (!this.nodeWs) u.searchParams.set("token", token);
    return u.toString();
  }

  private async open(): Promise<void> {
    this.setState("connecting");
    let token: string;
    let WS: any;
    try {
      WS = await this.loadWs();
      token = await this.credential();
    } catch (e) {
      const err = e instanceof MeshgateError ? e : new MeshgateError("TOKEN_FAILED", String((e as Error)?.message ?? e), true);
      if (this._state !== "connecting" || this.conn) return;
      if (err instanceof UnauthorizedError || !err.retryable) return this.terminal(err, 0, err.message);
      return this.schedule(0, err.message, err);
    }
    if (this._state !== "connecting" || this.conn) return; // disconnect() meanwhile
    const url = this.wsUrl(token);
    let ws: any;
    try {
      ws = this.nodeWs
        ? new WS(url, { headers: { authorization: `Bearer ${token}` }, handshakeTimeout: this.o.connectTimeoutMs })
        : new WS(url);
    } catch (e) {
      return this.terminal(new MeshgateError("BAD_URL", String((e as Error)?.message ?? e)), 0, "bad url");
    }
    ws.binaryType = "arraybuffer";
    const conn: Conn = { ws, opened: false, done: false, lastHeard: Date.now() };
    this.conn = conn;
    conn.connectTimer = setTimeout(() => this.dead(conn, "connect timeout"), this.o.connectTimeoutMs);
    if (this.nodeWs) {
      ws.on("unexpected-response", (req: any, res: any) => {
        let body = "";
        res.on("data", (c: any) => (body += c));
        res.on("end", () => {
          conn.refusal = errorFromHttp(res.statusCode, body);
          req.destroy();
          this.closed(conn, 1006, `upgrade refused: ${res.statusCode}`);
        });
        res.on("error", () => this.closed(conn, 1006, "upgrade refused"));
      });
      ws.on("error", () => {
        /* a close follows */
      });
      // The node's pings (every ping_interval_seconds) show it alive too; `ws` answers them.
      ws.on("ping", () => (conn.lastHeard = Date.now()));
    } else {
      ws.onerror = () => {
        /* a close follows */
      };
    }
    ws.onopen = () => this.opened(conn);
    ws.onmessage = (ev: any) => this.message(conn, ev.data);
    ws.onclose = (ev: any) => this.closed(conn, ev.code, ev.reason ?? "");
  }

  private opened(conn: Conn): void {
    if (conn.done || this.conn !== conn) return;
    clearTimeout(conn.connectTimer);
    conn.opened = true;
    conn.lastHeard = Date.now();
    this.attempt = 0;
    this.tokenFresh = false;
    this.setState("connected");
    // Subscriptions first (recovering), then what waited: a publish made
    // while offline on a subscribed topic comes back after the recovery.
    for (const s of this.subs.values()) if (s.desired) this._sendSubscribe(s);
    const queued = this.outbox;
    this.outbox = [];
    for (const q of queued) this.sendNow(q.id, q.p);
    conn.pingTimer = setInterval(() => this.heartbeat(conn), this.o.pingIntervalMs);
    this.emit("connected", { url: this.url(), reconnected: this.everConnected });
    this.everConnected = true;
    this.settleConnect(null);
  }

  /** Sends a ping; if nothing at all comes back within `pongTimeoutMs`, the connection is dead. */
  private heartbeat(conn: Conn): void {
    if (conn.done || this.conn !== conn) return;
    const sent = Date.now();
    const id = this.nextId++;
    const p: Pending = { resolve: () => {}, reject: () => {}, frame: { id, type: "ping" } };
    this.sendNow(id, p);
    setTimeout(() => {
      if (!conn.done && this.conn === conn && conn.lastHeard < sent) this.dead(conn, "no pong");
    }, this.o.pongTimeoutMs);
  }

  /** Gives up on a socket that does not answer: drops it and reconnects. */
  private dead(conn: Conn, reason: string): void {
    if (conn.done) return;
    this.closed(conn, CloseCode.ABNORMAL, reason);
    try {
      if (typeof conn.ws.terminate === "function") conn.ws.terminate();
      else conn.ws.close(3000, reason);
    } catch {
      /* closed */
    }
  }

  private finish(conn: Conn): void {
    conn.done = true;
    clearTimeout(conn.connectTimer);
    clearInterval(conn.pingTimer);
    conn.ws.onopen = conn.ws.onmessage = conn.ws.onclose = null;
  }

  /** The node this client talks to now (one of `url`'s). */
  private url(): string {
    const u = this.o.url;
    return Array.isArray(u) ? u[this.urlAt % u.length] : u;
  }

  private closed(conn: Conn, code: number, reason: string): void {
    if (conn.done) return;
    this.finish(conn);
    if (this.conn !== conn) return;
    this.conn = null;
    // Several nodes: one that could not be reached, died or drains is left
    // for the next; the subscriptions recover there (the cluster shares the
    // history, docs/pubsub.md).
    if (Array.isArray(this.o.url) && (!conn.opened || code === CloseCode.ABNORMAL || code === CloseCode.GOING_AWAY || code === CloseCode.NODE_DRAINED)) {
      this.urlAt = (this.urlAt + 1) % this.o.url.length;
    }
    this.failRequests(new DisconnectedError("DISCONNECTED", `the connection ended (${code} ${reason})`.trim(), true), true);
    for (const s of this.subs.values()) {
      s.pending = null;
      s.catchUp = null;
      if (s.desired) s._setState("subscribing", { topic: s.topic, code: String(code), reason: reason || "disconnected" });
    }
    if (!conn.opened && !conn.refusal && !this.nodeWs && typeof fetch === "function") {
      // A browser does not show why an upgrade failed: ask the node who we are.
      void this.probe().then((err) => this.decide(code, reason, err));
      return;
    }
    this.decide(code, reason, conn.refusal);
  }

  private async probe(): Promise<MeshgateError | undefined> {
    try {
      const headers: Record<string, string> = { authorization: `Bearer ${this.token}` };
      if (this.o.namespace) headers["x-namespace"] = this.o.namespace;
      const r = await fetch(this.httpBase() + "/v1/auth/whoami", { headers });
      if (r.status === 401 || r.status === 403) return errorFromHttp(r.status, await r.text());
    } catch {
      /* unreachable, or CORS: a transient failure */
    }
    return undefined;
  }

  /** After a socket ended: reconnect (when, how) or stop. */
  private decide(code: number, reason: string, err?: MeshgateError): void {
    if (this._state === "disconnected" || this.conn) return; // disconnect() or a new socket meanwhile
    if (err instanceof UnauthorizedError) {
      if (this.o.getToken && !this.tokenFresh) {
        this.forceRefresh = true;
        return this.schedule(code, reason, err, 0);
      }
      return this.terminal(err, code, reason);
    }
    if (err instanceof ForbiddenError || err?.code === "NAMESPACE_NOT_FOUND") return this.terminal(err, code, reason);
    if (code === CloseCode.NAMESPACE_GONE) {
      return this.terminal(new ServerError("NAMESPACE_GONE", reason || "the namespace was deleted"), code, reason);
    }
    // 4008 slow consumer (frames were dropped) and 4011 insufficient state
    // (the node's copy of a history topic cannot continue): come back at
    // once and recover; the subscribe answers say whether it could.
    const now = code === CloseCode.SLOW_CONSUMER || code === CloseCode.INSUFFICIENT_STATE || code === CloseCode.NODE_DRAINED;
    const delay = now && this.attempt === 0 ? 0 : undefined;
    this.schedule(code, reason, err, delay);
  }

  private schedule(code: number, reason: string, error?: MeshgateError, delayMs?: number): void {
    const delay = delayMs ?? backoff(this.attempt, this.o.minReconnectDelayMs, this.o.maxReconnectDelayMs);
    this.attempt++;
    this.setState("connecting");
    this.emit("connecting", { code, reason, attempt: this.attempt, delayMs: delay, error });
    clearTimeout(this.reconnectTimer);
    this.reconnectTimer = setTimeout(() => {
      if (this._state === "connecting" && !this.conn) void this.open();
    }, delay);
  }

  private terminal(err: MeshgateError, code: number, reason: string): void {
    clearTimeout(this.reconnectTimer);
    this.failRequests(err);
    this.setState("disconnected");
    this.emit("error", { error: err });
    this.emit("disconnected", { code, reason, error: err });
    this.settleConnect(err);
  }

  private settleConnect(err: MeshgateError | null): void {
    const w = this.connectWaiters;
    this.connectWaiters = [];
    for (const x of w) err ? x.reject(err) : x.resolve();
  }

  // ---- frames -----------------------------------------------------------

  /** Fails what is in flight; with `keepQueued`, requests waiting for a connection stay queued. */
  private failRequests(err: MeshgateError, keepQueued = false): void {
    const inflight = [...this.inflight.values()];
    this.inflight.clear();
    for (const p of inflight) {
      clearTimeout(p.timer);
      if (!p.sub) p.reject(err);
    }
    if (!keepQueued) {
      const q = this.outbox;
      this.outbox = [];
      for (const { p } of q) {
        clearTimeout(p.timer);
        p.reject(err);
      }
    }
  }

  private request(frame: Record<string, unknown>): Promise<any> {
    return new Promise((resolve, reject) => {
      const id = this.nextId++;
      const p: Pending = { resolve, reject, frame: { id, ...frame } };
      p.timer = setTimeout(() => {
        this.inflight.delete(id);
        this.outbox = this.outbox.filter((q) => q.id !== id);
        reject(new TimeoutError("TIMEOUT", `no answer to ${String(frame.type)} within ${this.o.timeoutMs} ms`, true));
      }, this.o.timeoutMs);
      if (this._state === "connected" && this.conn) this.sendNow(id, p);
      else this.outbox.push({ id, p });
    });
  }

  private sendNow(id: number, p: Pending): void {
    const conn = this.conn;
    if (!conn || conn.ws.readyState !== WS_OPEN) {
      this.outbox.push({ id, p });
      return;
    }
    this.inflight.set(id, p);
    conn.ws.send(JSON.stringify(p.frame));
  }

  /** @internal Sends the subscribe frame of `s` (recovering from its position) if connected. */
  _sendSubscribe(s: Subscription): void {
    if (this._state !== "connected" || !this.conn || !s.desired) return;
    const id = this.nextId++;
    const frame: Record<string, unknown> = { id, type: "subscribe", topic: s.topic };
    const pr = s.options.presence;
    if (pr) {
      frame.presence = true;
      frame.member_id = pr.memberId;
      if (pr.meta !== undefined) frame.member_meta = pr.meta;
    }
    const from = s.options.recover !== false ? s.streamPosition : undefined;
    if (from) frame.recover = { offset: from.offset, epoch: from.epoch };
    s.pending = { id, wasRecovering: !!from, from };
    s.catchUp = null;
    this.sendNow(id, {
      sub: s,
      frame,
      resolve: (v) => this.subscribeAnswer(s, id, v),
      reject: () => {},
    });
  }

  /** @internal Sends an unsubscribe frame if connected; resolves when answered. */
  async _sendUnsubscribe(s: Subscription): Promise<void> {
    if (this._state !== "connected" || !this.conn) return;
    try {
      await this.request({ type: "unsubscribe", topic: s.topic });
    } catch {
      /* the socket ended: the subscription ended with it */
    }
  }

  private subscribeAnswer(s: Subscription, id: number, v: any): void {
    const pend = s.pending;
    if (!pend || pend.id !== id || !s.desired) return; // stale, or unsubscribed meanwhile
    s.pending = null;
    if (!v.ok) {
      const e = v.error ?? {};
      const err = errorFromServer(String(e.code ?? "ERROR"), String(e.message ?? ""));
      if (err.retryable) {
        s._error(err);
        const t = backoff(this.attempt, this.o.minReconnectDelayMs, this.o.maxReconnectDelayMs);
        setTimeout(() => this._sendSubscribe(s), t);
      } else s._failed(err);
      return;
    }
    const epoch: string | undefined = typeof v.epoch === "string" ? v.epoch : undefined;
    const top: number | undefined = typeof v.offset === "number" ? v.offset : undefined;
    const recovered = pend.wasRecovering && v.recovered === true;
    let hasRecovered = false;
    if (epoch !== undefined && top !== undefined) {
      if (recovered && pend.from) {
        // The missed ones follow this answer; deliver from `from` on.
        s.pos = { offset: pend.from.offset, epoch };
        hasRecovered = top > pend.from.offset;
        if (hasRecovered) s.catchUp = { from: pend.from.offset, to: top, epoch };
      } else {
        // A fresh start at the top (a first subscribe, or recovery impossible).
        const seen = s.pos && (s.pos.epoch === undefined || s.pos.epoch === epoch) && !pend.wasRecovering ? s.pos.offset : 0;
        s.pos = { offset: Math.max(top, seen), epoch };
      }
    } else s.pos = null;
    s._subscribed({
      topic: s.topic,
      wasRecovering: pend.wasRecovering,
      recovered,
      hasRecoveredPublications: hasRecovered,
      recoverable: epoch !== undefined,
      positioned: s.pos !== null && s.pos.epoch !== undefined,
      streamPosition: s.streamPosition,
    });
    if (recovered && !hasRecovered && pend.from) s._recovered({ from: pend.from.offset, to: pend.from.offset, epoch: epoch! });
  }

  private message(conn: Conn, raw: unknown): void {
    if (conn.done || this.conn !== conn) return;
    conn.lastHeard = Date.now();
    let v: any;
    try {
      v = JSON.parse(typeof raw === "string" ? raw : utf8(new Uint8Array(raw as ArrayBuffer)));
    } catch {
      return;
    }
    if (!v || typeof v !== "object") return;
    if (v.type === "message" && !("id" in v)) return this.publication(v);
    if (!("id" in v)) return;
    const p = this.inflight.get(v.id);
    if (!p) return;
    this.inflight.delete(v.id);
    clearTimeout(p.timer);
    if (p.sub) return p.resolve(v);
    if (v.ok) p.resolve(v);
    else {
      const e = v.error ?? {};
      p.reject(errorFromServer(String(e.code ?? "ERROR"), String(e.message ?? "")));
    }
  }

  private publication(v: any): void {
    const s = this.subs.get(v.topic);
    if (!s || !s.desired) return;
    const offset: number | undefined = typeof v.offset === "number" ? v.offset : undefined;
    if (offset !== undefined) {
      // A recovering subscribe in flight: frames of the old subscription are replayed after its answer.
      if (s.pending?.wasRecovering) return;
      const pos = s.pos;
      if (pos && pos.epoch !== undefined) {
        if (offset <= pos.offset) return; // already delivered
        if (offset > pos.offset + 1) return this.gap(s); // something was lost: recover it
      }
      s.pos = { offset, epoch: pos?.epoch };
    }
    s._deliver(publication(v.topic, b64decode(v.data_base64 ?? ""), v.timestamp, offset, s.pos?.epoch));
  }

  /** Offsets jumped (frames lost): resubscribe recovering from the last one delivered. */
  private gap(s: Subscription): void {
    if (s.pending) return;
    void this.request({ type: "unsubscribe", topic: s.topic }).catch(() => {});
    this._sendSubscribe(s);
  }
}

function publication(topic: string, data: Uint8Array, timestamp: number, offset?: number, epoch?: string): Publication {
  const p: Publication = {
    topic,
    data,
    timestamp,
    text: () => utf8(data),
    json: <T>() => JSON.parse(utf8(data)) as T,
  };
  if (offset !== undefined) p.offset = offset;
  if (epoch !== undefined) p.epoch = epoch;
  return p;
}
