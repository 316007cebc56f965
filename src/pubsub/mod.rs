//! Pub/sub (docs/design.md §5): the node's delivery service, the per-worker relays
//! and bounded socket queues, the `WsSession` actor, the topic table each
//! namespace supervisor owns, and the wire protocol (docs/pubsub.md).

mod protocol;
mod relay;
mod service;
mod session;
mod table;

pub use protocol::{
    ClientFrame, FrameError, FrameKind, MAX_BATCH, RESERVED_PREFIX, TopicError, check_member,
    check_topic, close, parse_client_frame,
};
pub use relay::{Conn, OutBody, Relay};
pub use service::{Delivery, MeshSink, Origin, PubSubService, RelayMsg, Targets};
pub use session::{MAX_IN_FLIGHT, Mode, Shutdown, WsSession, invoke_hook, send_now};
pub use table::{Member, PresenceEvent, SubscriberRef, TopicInfo, TopicTable};
