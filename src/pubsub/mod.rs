//! Pub/sub (docs/design.md §5): the node's delivery service, the per-worker relays
//! and bounded socket queues, the topic table each
//! namespace supervisor owns, and the wire protocol (docs/pubsub.md). The
//! socket's own actor, `WsSession`, is the WebSocket front end: `http/ws_session.rs`.

#![forbid(unsafe_code)]

pub mod history;
pub mod protocol;
mod relay;
mod service;
mod table;

pub use history::{HistoryCaps, HistoryRule, NsHistory, Position, Recovery};
pub use protocol::{
    ClientFrame, FrameError, FrameKind, MAX_BATCH, NotBase64, PayloadTooLarge, RESERVED_PREFIX,
    TopicError, check_member, check_payload, check_topic, close, decode_base64, parse_client_frame,
};
pub use relay::{Conn, OutBody, Relay, Shutdown};
pub use service::{Delivery, MeshMessage, MeshSink, Origin, PubSubService, RelayMsg, Targets};
pub use table::{Member, MeshRoutes, PresenceEvent, Route, SubscriberRef, TopicInfo, TopicTable};
