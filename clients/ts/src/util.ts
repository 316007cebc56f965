// Small helpers shared by the client: payload bytes, base64, JWT expiry.

/** A payload: text (sent as UTF-8) or bytes. */
export type Data = string | Uint8Array | ArrayBuffer;

const encoder = new TextEncoder();
const decoder = new TextDecoder();

export function toBytes(d: Data): Uint8Array {
  if (typeof d === "string") return encoder.encode(d);
  if (d instanceof Uint8Array) return d;
  return new Uint8Array(d);
}

export function utf8(b: Uint8Array): string {
  return decoder.decode(b);
}

/** Standard base64 (what the server reads and writes: `data_base64`). */
export function b64encode(b: Uint8Array): string {
  let s = "";
  for (let i = 0; i < b.length; i += 0x8000) {
    s += String.fromCharCode.apply(null, Array.from(b.subarray(i, i + 0x8000)));
  }
  return btoa(s);
}

export function b64decode(s: string): Uint8Array {
  const bin = atob(s);
  const out = new Uint8Array(bin.length);
  for (let i = 0; i < bin.length; i++) out[i] = bin.charCodeAt(i);
  return out;
}

/** The `exp` claim (unix seconds) of a JWT, or undefined for an API key or an unreadable token. */
export function jwtExpiry(token: string): number | undefined {
  const parts = token.split(".");
  if (parts.length !== 3) return undefined;
  try {
    const p = parts[1].replace(/-/g, "+").replace(/_/g, "/");
    const json = JSON.parse(utf8(b64decode(p + "=".repeat((4 - (p.length % 4)) % 4))));
    return typeof json.exp === "number" ? json.exp : undefined;
  } catch {
    return undefined;
  }
}

/** Whether this runs in Node (then the `ws` package is used). */
export function isNode(): boolean {
  return typeof process !== "undefined" && !!process.versions && !!process.versions.node;
}

/** Exponential backoff with jitter: a random delay in [d/2, d], d = min(max, min·2^attempt). */
export function backoff(attempt: number, minMs: number, maxMs: number): number {
  const d = Math.min(maxMs, minMs * Math.pow(2, Math.min(attempt, 30)));
  return Math.round(d / 2 + Math.random() * (d / 2));
}
