// Typed errors. Every error the client gives carries the server's stable
// error code (`MISSING_GRANT`, `TOKEN_EXPIRED`, ...) or one of the client's
// own (`DISCONNECTED`, `TIMEOUT`, `CLIENT_CLOSED`, `CONNECTION_FAILED`).

/** Any error of the client: `code` is the server's code or the client's own. */
export class MeshgateError extends Error {
  /** Machine-readable: the server's `error.code`, or a client code. */
  readonly code: string;
  /** Whether trying again later may succeed. */
  readonly retryable: boolean;
  /** The HTTP status, when the error came from an HTTP answer (the upgrade or a REST call). */
  readonly status?: number;
  constructor(code: string, message: string, retryable = false, status?: number) {
    super(message || code);
    this.name = new.target.name;
    this.code = code;
    this.retryable = retryable;
    this.status = status;
  }
}

/** The credential was refused (HTTP 401): bad, revoked or expired key or token. */
export class UnauthorizedError extends MeshgateError {}

/** The credential lacks a grant, or the topic is reserved (HTTP 403, `MISSING_GRANT`, `RESERVED_TOPIC`). */
export class ForbiddenError extends MeshgateError {}

/** The server refused a frame or request for another reason (`BAD_TOPIC`, `OVERLOADED`, ...). */
export class ServerError extends MeshgateError {}

/** No answer within the client's timeout (code `TIMEOUT`), or the server's 504 `TIMEOUT`. */
export class TimeoutError extends MeshgateError {}

/**
 * The connection ended while the request was in flight (code `DISCONNECTED`,
 * retryable: the server may or may not have handled it), or the client was
 * closed by `disconnect()` (code `CLIENT_CLOSED`).
 */
export class DisconnectedError extends MeshgateError {}

/** The credential codes answered with 401. */
const UNAUTHORIZED = new Set([
  "MISSING_CREDENTIAL", "API_KEY_EXPIRED", "API_KEY_REVOKED", "BAD_CHECKSUM", "BAD_SIGNATURE",
  "INVALID_API_KEY", "INVALID_OPERATOR_KEY", "MALFORMED_API_KEY", "MALFORMED_TOKEN", "MISSING_KID",
  "TOKEN_BAD_ENCODING", "TOKEN_BAD_JSON", "TOKEN_EXPIRED", "TOKEN_ISSUED_IN_FUTURE",
  "TOKEN_NOT_YET_VALID", "UNKNOWN_KID", "UNSUPPORTED_ALG", "WRONG_AUDIENCE", "WRONG_ISSUER",
]);
/** The codes answered with 403. */
const FORBIDDEN = new Set([
  "MISSING_GRANT", "RESERVED_TOPIC", "NAMESPACE_MISMATCH", "OPERATOR_ONLY", "CORS_ORIGIN_DENIED",
  "CROSS_ORIGIN", "GRANT_ESCALATION", "INTERNAL_ONLY",
]);
/** Codes worth retrying whatever the server's flag says. */
const RETRYABLE = new Set(["OVERLOADED", "TIMEOUT", "DRAINING", "RATE_LIMITED", "FUNCTION_BUSY"]);

/** The error for a server's `{code, message, retryable?}` (from a frame or an HTTP envelope). */
export function errorFromServer(
  code: string,
  message: string,
  status?: number,
  retryable?: boolean,
): MeshgateError {
  const r = retryable ?? RETRYABLE.has(code);
  if (status === 401 || UNAUTHORIZED.has(code)) return new UnauthorizedError(code, message, false, status);
  if (status === 403 || FORBIDDEN.has(code)) return new ForbiddenError(code, message, false, status);
  if (code === "TIMEOUT") return new TimeoutError(code, message, true, status);
  return new ServerError(code, message, r, status);
}

/** Parses an HTTP error body (the envelope `{"ok":false,"error":{code,message,retryable}}`). */
export function errorFromHttp(status: number, body: string): MeshgateError {
  try {
    const v = JSON.parse(body);
    if (v && v.error && typeof v.error.code === "string") {
      return errorFromServer(v.error.code, String(v.error.message ?? ""), status, v.error.retryable);
    }
  } catch {
    /* not the envelope */
  }
  const retryable = status === 429 || status >= 500;
  return errorFromServer(`HTTP_${status}`, body.slice(0, 200) || `HTTP ${status}`, status, retryable);
}
