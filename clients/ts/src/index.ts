// meshgate-client: the TypeScript client of meshgate's pub/sub socket `/v1/ws`.
export { Client, CloseCode } from "./client.js";
export type {
  ClientOptions,
  ClientState,
  ClientEvents,
  ConnectingContext,
  ConnectedContext,
  DisconnectedContext,
  PublishResult,
  PresenceMember,
  HistoryOptions,
  HistoryPage,
  Listing,
  Page,
  PageOptions,
  Session,
} from "./client.js";
export { Subscription } from "./subscription.js";
export type {
  Publication,
  PresenceEvent,
  RecoveredContext,
  StateContext,
  StreamPosition,
  SubscribedContext,
  SubscriptionEvents,
  SubscriptionOptions,
  SubscriptionState,
} from "./subscription.js";
export {
  MeshgateError,
  UnauthorizedError,
  ForbiddenError,
  ServerError,
  TimeoutError,
  DisconnectedError,
  errorFromServer,
  errorFromHttp,
} from "./errors.js";
export type { Data } from "./util.js";
