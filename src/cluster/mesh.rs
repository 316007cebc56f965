//! The pub/sub mesh between nodes (docs/design.md §6).
//!
//! Each node runs one libp2p host (TCP, Noise, Yamux) with two behaviours: an
//! allow list and GossipSub. Membership comes from the shared store only:
//! every [`MeshConfig::registry_interval`] a task writes this node's addresses
//! under `_pubsub_mesh_peers/<peer id>` with a time to live. The same task
//! watches the prefix (etcd's watch): every change (a node registering,
//! deregistering, or its lease running out) re-reads the registry at once,
//! and a broken watch is made again (with backoff) followed by a full read;
//! the periodic read is only the safety net. Each read goes to the swarm
//! task, which allows exactly those peers (connections from any other are
//! refused, and connections of a peer that left the registry are closed),
//! checks that an inbound connection comes from one of the peer's registered
//! IPs, and dials every registered peer not connected at its registered
//! addresses only, again with backoff until it is connected. There is no
//! peer exchange, identify, Kademlia or mDNS. [`Mesh::wait_connected`] is
//! the node's readiness: connected to every registered peer.
//!
//! All pub/sub traffic goes on one GossipSub topic ([`MESH_TOPIC`]). A
//! [`WireBatch`] carries the origin's peer id (checked against the GossipSub
//! author, which must be a registered peer) and one or more messages, each
//! with its namespace and
//! topic and a per-(origin, namespace, topic) epoch and sequence number;
//! receivers release each such stream in order through a [`Reorder`] buffer
//! and hand messages to the `deliver_fn`. A batch holds whatever was already
//! waiting when the swarm task came to publish (never waits to fill one), so
//! a burst costs one frame per batch rather than per message. GossipSub
//! message ids are the author and GossipSub's sequence number of that
//! publish ([`message_id`]), so a batch reaching a node by two paths is
//! delivered once.
//!
//! A batch GossipSub could not queue to one peer (its send queue full while
//! another's was not) is not lost: the sender keeps what it sent in a
//! bounded resend buffer ([`MeshConfig::resend_bytes`],
//! [`MeshConfig::resend_messages`]) and every [`HEADS_INTERVAL`] tells each
//! peer how far its recently used streams got (the heads), so a receiver
//! knows of a gap whether a later batch came or not. A receiver asks the
//! sender directly for a gap (`/meshgate/resend/1`, libp2p
//! request-response on the same connections, one request per sender at a
//! time) and releases what comes back in order. A gap is skipped only when
//! its sender is gone from the mesh (no connection left), when the sender
//! no longer holds it (evicted from its resend buffer), when the receiver's
//! reorder buffer is full, or when the sender restarted its counter
//! (`meshgate_mesh_gaps_skipped_total{reason}`).
//!
//! Messages are not signed ([`MessageAuthenticity::Author`]): every frame
//! arrives on a Noise connection whose remote key is a registered peer's
//! (the allow list), so it was sent by a member and not altered on the way;
//! an Ed25519 signature and verification per batch would add nothing a
//! member could not already forge (see docs/cluster.md, "Why mesh messages
//! are not signed").

use super::reorder::Reorder;
use super::{MeshError, MeshResult};
use crate::metrics::Metrics;
use crate::pubsub::MeshMessage;
use crate::pubsub::{MeshSink, PubSubService};
use crate::storage::{Change, OrderedKv, PrefixWatch, Store, StoreResult};
use bytes::Bytes;
use libp2p::futures::StreamExt;
use libp2p::futures::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use libp2p::gossipsub::{self, IdentTopic, MessageAcceptance, MessageAuthenticity, TopicHash};
use libp2p::identity::Keypair;
use libp2p::multiaddr::Protocol;
use libp2p::swarm::dial_opts::{DialOpts, PeerCondition};
use libp2p::swarm::{NetworkBehaviour, SwarmEvent};
use libp2p::{
    Multiaddr, PeerId, StreamProtocol, Swarm, allow_block_list, noise, request_response, tcp, yamux,
};
use serde::{Deserialize, Serialize};
use std::collections::{HashMap, VecDeque};
use std::net::IpAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::{Notify, mpsc, oneshot};
use tokio::task::JoinHandle;
use tracing::{debug, info, warn};

/// Where nodes register their mesh addresses in the shared store.
pub const REGISTRY_PREFIX: &str = "_pubsub_mesh_peers/";
/// How often a node re-registers and re-reads the registry.
pub const REGISTRY_INTERVAL: Duration = Duration::from_secs(15);
/// How long a registration lives unless refreshed.
pub const REGISTRY_TTL: Duration = Duration::from_secs(120);
/// How long a gap with later messages behind it waits before the sender is
/// asked for it (a batch overtaken on a second connection fills it sooner).
pub const RESEND_AFTER: Duration = Duration::from_millis(200);
/// How long a gap known only from the sender's heads (a lost tail) waits
/// before the sender is asked: the batch may still be in the sender's queue.
pub const TAIL_AFTER: Duration = Duration::from_secs(1);
/// How often a sender announces the heads of the streams it used since the
/// last announcement.
pub const HEADS_INTERVAL: Duration = Duration::from_millis(500);
/// Bytes of sent messages a sender keeps for resending (payloads plus
/// [`ENTRY_OVERHEAD`] each): the `[cluster] mesh_resend_mib` default.
pub const RESEND_BYTES: usize = 64 << 20;
/// Sent messages a sender keeps for resending: the `[cluster]
/// mesh_resend_messages` default.
pub const RESEND_MESSAGES: usize = 262_144;
/// The most a resend answer carries (payloads plus [`ENTRY_OVERHEAD`] and
/// names each); the rest of a gap is asked for again.
const RESEND_REPLY_BYTES: usize = 4 << 20;
/// Streams asked for, or heads announced, in one request at most.
const MAX_WANTS: usize = 256;
/// Sequence numbers asked for per stream in one request at most.
const MAX_WANT_LEN: u64 = 65_536;
/// The largest resend request or heads announcement read.
const MAX_REQUEST_FRAME: usize = 256 << 10;
/// The largest resend answer read.
const MAX_RESPONSE_FRAME: usize = 2 * RESEND_REPLY_BYTES + MAX_TRANSMIT;
/// How long a resend request may take before it is asked again.
const RESEND_TIMEOUT: Duration = Duration::from_secs(5);
/// The resend protocol.
const RESEND_PROTOCOL: StreamProtocol = StreamProtocol::new("/meshgate/resend/1");
/// Bytes one stream may hold back waiting for a gap (each message weighs its
/// payload plus [`ENTRY_OVERHEAD`]); beyond it the gap is skipped.
pub const REORDER_BYTES: usize = 8 << 20;
/// The weight of a message beyond its payload, in the reorder buffer.
const ENTRY_OVERHEAD: usize = 64;
/// A stream (sender counter or receiver state) idle this long is forgotten.
/// Each distinct (namespace, topic) published keeps one on the sending node
/// and on every other node until then, so it bounds what a burst of topic
/// names costs the cluster (at a namespace's default 1,000 publishes a
/// second: 60,000 streams a node, not the 600,000 of the first 10 minutes).
/// A forgotten sender counter starts a new epoch; a receiver starts a stream
/// it does not know at the first number it sees (or at 1, when the stream's
/// epoch began after it connected to the sender). A receiver keeps an idle
/// stream twice as long as the sender keeps its counter, so it never takes
/// a stream the sender still numbers for a new one.
pub const STREAM_IDLE: Duration = Duration::from_secs(60);
/// The GossipSub heartbeat.
pub const HEARTBEAT: Duration = Duration::from_millis(700);
/// Locally published messages waiting for the swarm task before further
/// ones are dropped (`meshgate_mesh_messages_dropped_total{reason="queue_full"}`).
pub const FORWARD_QUEUE: usize = 65_536;
/// Bytes of payload waiting for the mesh (a burst faster than the mesh
/// drains, or every peer's GossipSub send queue full), published in order;
/// beyond it messages are dropped (`reason="backlog_full"`).
pub const BACKLOG_BYTES: usize = 64 << 20;
/// How often waiting messages are retried while every peer's queue is full.
const BACKLOG_RETRY: Duration = Duration::from_millis(2);
/// A batch is closed at this many messages…
pub const BATCH_MESSAGES: usize = 512;
/// …or once its payloads reach this many bytes (a single larger message
/// travels alone).
pub const BATCH_BYTES: usize = 64 << 10;
/// While messages arrive faster than batches go out (the swarm task found
/// more than one waiting when it woke), the next batch waits this long to
/// fill (or until it is full) instead of going at once with the few there
/// are: under a burst, batches of a handful of messages made the mesh's cost
/// per batch (GossipSub, Noise, the receiver's decoding) the limit of
/// cross-node throughput. A lone message still goes at once.
const LINGER: Duration = Duration::from_millis(1);
/// How long a batch may wait in a peer's GossipSub send queue before it is
/// abandoned (`reason="send_timeout"`). Long: a full queue already holds
/// publishes back (the backlog), so only a peer that stopped reading loses
/// messages this way.
pub const SEND_TIMEOUT: Duration = Duration::from_secs(60);
/// The largest GossipSub message: a 1 MiB pub/sub payload plus headers.
pub const MAX_TRANSMIT: usize = (1 << 20) + (64 << 10);
/// The one GossipSub topic all pub/sub traffic travels on.
pub const MESH_TOPIC: &str = "meshgate/pubsub/1";
/// Registry refreshes asked for by refused connections are at most this frequent.
const MIN_REFRESH_SPACING: Duration = Duration::from_secs(1);
/// The first and the longest wait before a broken registry watch is made again.
const WATCH_BACKOFF_MIN: Duration = Duration::from_millis(250);
const WATCH_BACKOFF_MAX: Duration = Duration::from_secs(10);
/// The first and the longest wait between dials of a registered peer that is
/// not connected.
const DIAL_BACKOFF_MIN: Duration = Duration::from_millis(100);
const DIAL_BACKOFF_MAX: Duration = Duration::from_secs(5);
/// Of two peers, the one with the smaller id dials at once; the other waits
/// this long first (so usually one connection per pair, see `on_registry`).
const DIAL_GRACE: Duration = Duration::from_secs(1);
/// How often due dials are started.
const DIAL_TICK: Duration = Duration::from_millis(50);
/// Mesh connections are kept while idle (the registry decides who is
/// connected, not traffic).
const IDLE_CONNECTION_TIMEOUT: Duration = Duration::from_secs(24 * 3600);
/// How long `start` waits for the listener to come up.
const LISTEN_TIMEOUT: Duration = Duration::from_secs(10);

/// Hands messages from the mesh to this node: a namespace and its messages
/// (topic, data, origin timestamp in ms), in stream order. Called from the
/// swarm task once per namespace per received batch (and per gap timeout
/// that released held-back ones), never with an empty list; it must not
/// block (the node queues them for its mesh ingress task, which delivers
/// them to the worker relays with the namespace's shared routes).
pub type DeliverFn = Arc<dyn Fn(String, Vec<MeshMessage>) + Send + Sync>;

/// The mesh's timings and sizes; `Default` gives the production values.
#[derive(Debug, Clone)]
pub struct MeshConfig {
    /// How often the node re-registers and re-reads the registry.
    pub registry_interval: Duration,
    /// The time to live of the node's registration.
    pub registry_ttl: Duration,
    /// How long a gap with later messages behind it waits before the sender
    /// is asked for it.
    pub resend_after: Duration,
    /// How long a gap known only from the sender's heads waits before the
    /// sender is asked for it.
    pub tail_after: Duration,
    /// How often the heads of recently used streams are announced.
    pub heads_interval: Duration,
    /// Bytes of sent messages kept for resending.
    pub resend_bytes: usize,
    /// Sent messages kept for resending.
    pub resend_messages: usize,
    /// Test hook: received batches whose payloads it returns true for are
    /// dropped as if GossipSub never delivered them.
    pub drop_received: Option<DropHook>,
    /// Bytes one stream may hold back.
    pub reorder_bytes: usize,
    /// The GossipSub heartbeat.
    pub heartbeat: Duration,
    /// GossipSub's per-connection send queue, in frames (its default 5,000).
    pub send_queue: usize,
}

impl Default for MeshConfig {
    fn default() -> Self {
        Self {
            registry_interval: REGISTRY_INTERVAL,
            registry_ttl: REGISTRY_TTL,
            resend_after: RESEND_AFTER,
            tail_after: TAIL_AFTER,
            heads_interval: HEADS_INTERVAL,
            resend_bytes: RESEND_BYTES,
            resend_messages: RESEND_MESSAGES,
            drop_received: None,
            reorder_bytes: REORDER_BYTES,
            heartbeat: HEARTBEAT,
            send_queue: 5_000,
        }
    }
}

/// A test hook deciding from a received batch's payloads whether to drop it.
#[derive(Clone)]
pub struct DropHook(pub Arc<dyn Fn(&[&[u8]]) -> bool + Send + Sync>);

impl std::fmt::Debug for DropHook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("DropHook")
    }
}

/// One stream's gap asked for, or one stream's head announced, on the
/// resend protocol.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct WireWant {
    namespace: String,
    topic: String,
    epoch: u64,
    /// The first sequence number asked for (for a head: unused, 0).
    from: u64,
    /// The last one asked for (for a head: the last one sent).
    to: u64,
}

/// A request on the resend protocol.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
enum ResendRequest {
    /// Resend these gaps of the responder's streams.
    Resend(Vec<WireWant>),
    /// The requester's streams reached these heads (`to`).
    Heads(Vec<WireWant>),
}

/// An answer on the resend protocol.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
enum ResendResponse {
    /// What the responder still held of the gaps asked for, as an encoded
    /// [`WireBatch`], and the gaps it no longer holds (`gone`). A gap in
    /// neither did not fit the answer and is asked for again.
    Resend { batch: Vec<u8>, gone: Vec<WireWant> },
    /// Heads taken.
    Heads,
}

/// Length-prefixed postcard frames for the resend protocol, bounded on read.
#[derive(Debug, Clone, Default)]
struct ResendCodec;

async fn read_frame<T, M>(io: &mut T, max: usize) -> std::io::Result<M>
where
    T: AsyncRead + Unpin + Send,
    M: serde::de::DeserializeOwned,
{
    let mut len = [0u8; 4];
    io.read_exact(&mut len).await?;
    let len = u32::from_be_bytes(len) as usize;
    if len > max {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            "resend frame too large",
        ));
    }
    let mut buf = vec![0u8; len];
    io.read_exact(&mut buf).await?;
    postcard::from_bytes(&buf).map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))
}

async fn write_frame<T, M>(io: &mut T, m: &M) -> std::io::Result<()>
where
    T: AsyncWrite + Unpin + Send,
    M: Serialize,
{
    let buf = postcard::to_allocvec(m)
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))?;
    let len = u32::try_from(buf.len())
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))?;
    io.write_all(&len.to_be_bytes()).await?;
    io.write_all(&buf).await
}

impl request_response::Codec for ResendCodec {
    type Protocol = StreamProtocol;
    type Request = ResendRequest;
    type Response = ResendResponse;

    async fn read_request<T>(
        &mut self,
        _: &StreamProtocol,
        io: &mut T,
    ) -> std::io::Result<ResendRequest>
    where
        T: AsyncRead + Unpin + Send,
    {
        read_frame(io, MAX_REQUEST_FRAME).await
    }

    async fn read_response<T>(
        &mut self,
        _: &StreamProtocol,
        io: &mut T,
    ) -> std::io::Result<ResendResponse>
    where
        T: AsyncRead + Unpin + Send,
    {
        read_frame(io, MAX_RESPONSE_FRAME).await
    }

    async fn write_request<T>(
        &mut self,
        _: &StreamProtocol,
        io: &mut T,
        req: ResendRequest,
    ) -> std::io::Result<()>
    where
        T: AsyncWrite + Unpin + Send,
    {
        write_frame(io, &req).await
    }

    async fn write_response<T>(
        &mut self,
        _: &StreamProtocol,
        io: &mut T,
        res: ResendResponse,
    ) -> std::io::Result<()>
    where
        T: AsyncWrite + Unpin + Send,
    {
        write_frame(io, &res).await
    }
}

/// What a node writes under `_pubsub_mesh_peers/<peer id>`.
#[derive(Debug, Serialize, Deserialize)]
struct Registration {
    /// The registering node's peer id; peers put only ids from the registry on their allow list.
    peer_id: String,
    /// The node's current listen addresses: the only ones peers dial it at.
    addrs: Vec<String>,
}

/// What one GossipSub message carries (postcard-encoded). Borrowed both
/// ways: the origin encodes it from the messages waiting for the mesh, a
/// receiver decodes it in place (no allocation per namespace, topic or
/// payload while decoding; each payload is then copied once, into the
/// message delivered).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct WireBatch<'a> {
    /// The publishing node's peer id (bytes); must be the GossipSub author.
    #[serde(serialize_with = "byte_string")]
    origin: &'a [u8],
    /// The origin's count of publishes refused because every peer's queue
    /// was full. Kept in the wire format (a field removed would break the
    /// encoding between versions); message ids no longer hash the batch
    /// ([`message_id`]), so a retry is told apart by its new sequence number.
    attempt: u64,
    /// The messages, in the origin's publish order, each numbered in its own stream.
    #[serde(borrow)]
    entries: Vec<WireEntry<'a>>,
}

/// One pub/sub message in a batch.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct WireEntry<'a> {
    /// Tenant namespace the message was published in; delivery stays inside it.
    namespace: &'a str,
    /// Topic within the namespace; with origin and namespace it keys a reorder stream.
    topic: &'a str,
    /// Names the origin's counter for (namespace, topic); a higher epoch
    /// restarts the stream.
    epoch: u64,
    /// 1, 2, 3… within the epoch.
    seq: u64,
    /// When the origin accepted the message (ms since the Unix epoch).
    timestamp: u64,
    #[serde(serialize_with = "byte_string")]
    data: &'a [u8],
    /// A history topic's publication: (offset, epoch) as the store gave them.
    #[serde(borrow)]
    history: Option<(u64, &'a str)>,
}

/// Bytes written as one serde byte string (a length and a copy) rather than
/// a sequence of u8 (a call per byte). In postcard the two are the same
/// bytes on the wire, which is also what lets a receiver read them in place
/// (serde reads `&[u8]` as a byte string) from a batch written either way.
fn byte_string<S: serde::Serializer>(v: &&[u8], s: S) -> Result<S::Ok, S::Error> {
    s.serialize_bytes(v)
}

/// A received batch's entries as runs of one stream each, in batch order
/// (a burst of one topic is one run), ready for [`Reorder::push_run`]: each
/// (epoch, seq, message, weight), the message's payload its own copy and
/// its namespace and topic shared with its run.
#[allow(clippy::type_complexity)]
fn runs(
    origin: PeerId,
    entries: Vec<WireEntry<'_>>,
) -> Vec<(StreamKey, Vec<(u64, u64, Received, usize)>)> {
    let mut out: Vec<(StreamKey, Vec<(u64, u64, Received, usize)>)> = Vec::new();
    let mut shared: Option<(Arc<str>, Arc<str>)> = None;
    for e in entries {
        let same = out
            .last()
            .is_some_and(|((_, ns, topic), _)| ns == e.namespace && topic == e.topic);
        if !same {
            out.push((
                (origin, e.namespace.to_string(), e.topic.to_string()),
                Vec::new(),
            ));
            shared = Some((Arc::from(e.namespace), Arc::from(e.topic)));
        }
        let (namespace, topic) = shared.clone().expect("set with the run");
        let item = Received {
            namespace,
            topic,
            timestamp: e.timestamp,
            // Its own copy: a slice of the batch would keep the whole batch
            // alive as long as this message is held (a slow socket's queue,
            // a history copy), far past what the limits count.
            data: Bytes::copy_from_slice(e.data),
            history: e.history.map(|(o, h)| (o, h.to_string())),
        };
        let weight = e.data.len() + ENTRY_OVERHEAD;
        out.last_mut()
            .expect("a run")
            .1
            .push((e.epoch, e.seq, item, weight));
    }
    out
}

/// A message taken from a received batch, as the reorder buffer holds it
/// until its turn: its namespace and topic shared by its run of the batch.
#[derive(Debug)]
struct Received {
    namespace: Arc<str>,
    topic: Arc<str>,
    timestamp: u64,
    data: Bytes,
    history: Option<(u64, String)>,
}

/// A snapshot of the mesh, for tests and the status page.
#[derive(Debug, Clone)]
pub struct MeshStatus {
    /// This node's id in the mesh.
    pub peer_id: PeerId,
    /// Addresses this node listens on now (also what it registers).
    pub listen_addrs: Vec<Multiaddr>,
    /// Peers in the latest registry scan (this node excluded).
    pub registered: Vec<PeerId>,
    /// Peers with an open connection, subscribed or not.
    pub connected: Vec<PeerId>,
    /// Connected peers subscribed to [`MESH_TOPIC`]: the ones a publish reaches.
    pub subscribed: Vec<PeerId>,
    /// Messages held back waiting for a gap to fill.
    pub pending: usize,
    /// Whether the registry was read at least once (`registered` means
    /// nothing before).
    pub registry_read: bool,
}

/// Where [`Mesh::wait_connected`] got to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Connectedness {
    /// Connected to every registered peer (none registered counts).
    Connected,
    /// These registered peers were not connected (or not yet subscribed).
    Unreached(Vec<PeerId>),
    /// The registry could not be read.
    RegistryUnread,
}

/// A locally published message on its way to the mesh.
struct Outbound {
    /// Namespace the local client published in.
    namespace: String,
    /// Topic it published to; picks the (namespace, topic) send stream.
    topic: String,
    /// The payload; counted against `BACKLOG_BYTES` while it waits.
    data: Bytes,
    /// When this node accepted the publish (ms since the Unix epoch), sent along.
    timestamp: u64,
    /// A history topic's position of it (offset, epoch), sent along.
    history: Option<(u64, String)>,
}

enum Command {
    Forward(Outbound),
    Registry(HashMap<PeerId, Vec<Multiaddr>>),
    Status(oneshot::Sender<MeshStatus>),
}

#[derive(NetworkBehaviour)]
struct Behaviour {
    /// Allows connections only from peers in the registry; updated on every registry read.
    allow: allow_block_list::Behaviour<allow_block_list::AllowedPeers>,
    /// Carries the signed batches on `MESH_TOPIC` to every subscribed peer.
    gossipsub: gossipsub::Behaviour,
    /// Heads announcements and resend requests between two peers.
    resend: request_response::Behaviour<ResendCodec>,
}

/// The node's side of the mesh. Plugged into the [`PubSubService`] as its
/// [`MeshSink`] by [`Mesh::start`].
pub struct Mesh {
    /// This node's id, which keys its registration (removed on stop).
    peer_id: PeerId,
    /// Commands to the swarm task (bounded by `FORWARD_QUEUE`; a full queue drops the message).
    tx: mpsc::Sender<Command>,
    /// Node metrics; the mesh counts drops here and resets the peer gauge on stop.
    metrics: Metrics,
    /// The cluster store holding the peer registry; `stop` deletes this node's entry.
    store: Store,
    /// The swarm and registry tasks, aborted by `stop`.
    tasks: parking_lot::Mutex<Vec<JoinHandle<()>>>,
}

impl MeshSink for Mesh {
    /// Queues a locally published message for the swarm task, which numbers
    /// it in its (namespace, topic) stream and publishes it. One queue, so
    /// publish order is kept.
    fn forward(
        &self,
        namespace: &str,
        topic: &str,
        data: &Bytes,
        timestamp: u64,
        history: Option<(u64, &str)>,
    ) {
        let cmd = Command::Forward(Outbound {
            namespace: namespace.to_string(),
            topic: topic.to_string(),
            data: data.clone(),
            timestamp,
            history: history.map(|(o, e)| (o, e.to_string())),
        });
        if self.tx.try_send(cmd).is_err() {
            self.drop_count("queue_full");
        }
    }
}

impl Mesh {
    /// Starts the mesh with the production timings; see [`Mesh::start_with`].
    pub async fn start(
        store: Store,
        keypair: Keypair,
        listen_addr: Multiaddr,
        pubsub: PubSubService,
        deliver_fn: DeliverFn,
    ) -> MeshResult<Arc<Mesh>> {
        Self::start_with(
            store,
            keypair,
            listen_addr,
            pubsub,
            deliver_fn,
            MeshConfig::default(),
        )
        .await
    }

    /// Builds the libp2p host, listens on `listen_addr` (waits until it is
    /// up), spawns the swarm and registry tasks on the current tokio runtime,
    /// and plugs the mesh into `pubsub` (`set_mesh`). Messages from other
    /// nodes go to `deliver_fn`.
    pub async fn start_with(
        store: Store,
        keypair: Keypair,
        listen_addr: Multiaddr,
        pubsub: PubSubService,
        deliver_fn: DeliverFn,
        config: MeshConfig,
    ) -> MeshResult<Arc<Mesh>> {
        let metrics = pubsub.metrics.clone();
        let peer_id = keypair.public().to_peer_id();
        let mut swarm = build_swarm(keypair, &config)?;
        let topic = IdentTopic::new(MESH_TOPIC);
        swarm
            .behaviour_mut()
            .gossipsub
            .subscribe(&topic)
            .map_err(|e| MeshError::Setup(e.to_string()))?;
        let listen_err = |reason: String| MeshError::Listen {
            addr: listen_addr.to_string(),
            reason,
        };
        swarm
            .listen_on(listen_addr.clone())
            .map_err(|e| listen_err(e.to_string()))?;
        // The first listen address is needed before registering.
        let first = tokio::time::timeout(LISTEN_TIMEOUT, async {
            loop {
                match swarm.select_next_some().await {
                    SwarmEvent::NewListenAddr { address, .. } => break Ok(address),
                    SwarmEvent::ListenerClosed { reason, .. } => {
                        break Err(format!("{reason:?}"));
                    }
                    SwarmEvent::ListenerError { error, .. } => break Err(error.to_string()),
                    _ => {}
                }
            }
        })
        .await
        .map_err(|_| listen_err("no listen address came up".into()))?
        .map_err(listen_err)?;
        let listen_addrs = Arc::new(parking_lot::RwLock::new(vec![first]));
        let (tx, rx) = mpsc::channel(FORWARD_QUEUE);
        let refresh = Arc::new(Notify::new());
        let task = SwarmTask {
            swarm,
            topic: topic.hash(),
            peer_id,
            origin: peer_id.to_bytes(),
            listen_addrs: listen_addrs.clone(),
            registry: HashMap::new(),
            send: HashMap::new(),
            last_epoch: 0,
            reorder: Reorder::new(config.reorder_bytes),
            kept: Kept::new(config.resend_bytes, config.resend_messages),
            inflight: HashMap::new(),
            connected_since: HashMap::new(),
            heads_at: crate::util::mono_now(),
            config: config.clone(),
            deliver_fn,
            metrics: metrics.clone(),
            refresh: refresh.clone(),
            backlog: VecDeque::new(),
            backlog_bytes: 0,
            refused: 0,
            blocked: false,
            dials: HashMap::new(),
            registry_read: false,
        };
        let tick = (config.resend_after / 4)
            .min(config.heads_interval)
            .max(Duration::from_millis(20));
        let swarm_task = tokio::spawn(task.run(rx, tick));
        let registry_task = tokio::spawn(registry_loop(
            store.clone(),
            peer_id,
            listen_addrs,
            tx.downgrade(),
            refresh,
            config,
        ));
        info!(%peer_id, "Mesh started.");
        let mesh = Arc::new(Mesh {
            peer_id,
            tx,
            metrics,
            store,
            tasks: parking_lot::Mutex::new(vec![swarm_task, registry_task]),
        });
        pubsub.set_mesh(mesh.clone());
        Ok(mesh)
    }

    /// This node's id in the mesh.
    pub fn peer_id(&self) -> PeerId {
        self.peer_id
    }

    /// Waits, at most `limit`, until this node is connected to every peer in
    /// the registry as last read (the watch keeps it current) and each of
    /// them is subscribed to the mesh topic, so messages flow both ways.
    pub async fn wait_connected(&self, limit: Duration) -> Connectedness {
        let deadline = crate::util::mono_now() + limit;
        loop {
            let Some(st) = self.status().await else {
                return Connectedness::RegistryUnread;
            };
            let missing: Vec<PeerId> = st
                .registered
                .iter()
                .filter(|p| !st.subscribed.contains(p))
                .copied()
                .collect();
            if st.registry_read && missing.is_empty() {
                return Connectedness::Connected;
            }
            if crate::util::mono_now() >= deadline {
                return if st.registry_read {
                    Connectedness::Unreached(missing)
                } else {
                    Connectedness::RegistryUnread
                };
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// A snapshot of the mesh (None once it stopped).
    pub async fn status(&self) -> Option<MeshStatus> {
        let (tx, rx) = oneshot::channel();
        self.tx.send(Command::Status(tx)).await.ok()?;
        rx.await.ok()
    }

    /// Stops both tasks (closing every connection) and removes this node's
    /// registration so peers stop dialing it. Messages forwarded after this
    /// are dropped.
    pub async fn stop(&self) {
        let tasks: Vec<JoinHandle<()>> = self.tasks.lock().drain(..).collect();
        for task in tasks {
            task.abort();
            // Waited for, so a registration being written cannot land after
            // the delete below.
            let _ = task.await;
        }
        if let Err(e) = self
            .store
            .delete(registry_key(&self.peer_id).as_bytes())
            .await
        {
            warn!(error = %e, "Mesh registration not removed.");
        }
        self.metrics.mesh_peers.set(0);
    }

    fn drop_count(&self, reason: &str) {
        self.metrics.mesh_dropped.with_label_values(&[reason]).inc();
    }
}

fn registry_key(peer: &PeerId) -> String {
    format!("{REGISTRY_PREFIX}{peer}")
}

fn build_swarm(keypair: Keypair, config: &MeshConfig) -> MeshResult<Swarm<Behaviour>> {
    let setup = |e: &dyn std::fmt::Display| MeshError::Setup(e.to_string());
    let gossip_config = gossipsub::ConfigBuilder::default()
        // Small meshes (2 to ~10 nodes): with 9 peers at most every peer can
        // be in the mesh; flood publishing sends a node's own messages to
        // every subscribed peer at once, so the mesh only carries relays.
        .mesh_n_low(2)
        .mesh_n(4)
        .mesh_n_high(9)
        .mesh_outbound_min(1)
        .gossip_lazy(3)
        .flood_publish(true)
        .heartbeat_interval(config.heartbeat)
        // Unsigned (see the module docs): an author and a sequence number,
        // checked for form when present, no signature.
        .validation_mode(gossipsub::ValidationMode::Permissive)
        // The application checks each message's origin against its author
        // and the registry before GossipSub relays it.
        .validate_messages()
        .publish_queue_duration(SEND_TIMEOUT)
        .message_id_fn(message_id)
        .max_transmit_size(MAX_TRANSMIT)
        .connection_handler_queue_len(config.send_queue)
        .build()
        .map_err(|e| setup(&e))?;
    let author = keypair.public().to_peer_id();
    let gossipsub = gossipsub::Behaviour::new(MessageAuthenticity::Author(author), gossip_config)
        .map_err(|e| setup(&e))?;
    let swarm = libp2p::SwarmBuilder::with_existing_identity(keypair)
        .with_tokio()
        .with_tcp(
            tcp::Config::default().nodelay(true),
            noise::Config::new,
            yamux::Config::default,
        )
        .map_err(|e| setup(&e))?
        .with_behaviour(|_| Behaviour {
            allow: allow_block_list::Behaviour::default(),
            gossipsub,
            resend: request_response::Behaviour::new(
                [(RESEND_PROTOCOL, request_response::ProtocolSupport::Full)],
                request_response::Config::default().with_request_timeout(RESEND_TIMEOUT),
            ),
        })
        .map_err(|e| setup(&e))?
        .with_swarm_config(|c| c.with_idle_connection_timeout(IDLE_CONNECTION_TIMEOUT))
        .build();
    Ok(swarm)
}

/// A GossipSub message's id: its author and the sequence number GossipSub
/// drew for that publish (a random u64 per publish in author mode), so a copy
/// arriving by a second path is dropped and a retried batch (a new publish)
/// is not. Hashing the whole batch instead (SHA-256) was the largest single
/// cost of the publishing node's swarm thread under a burst. A message
/// without both (never sent by a member: GossipSub fills them in author
/// mode) falls back to the hash of its data.
fn message_id(m: &gossipsub::Message) -> gossipsub::MessageId {
    match (&m.source, m.sequence_number) {
        (Some(source), Some(seq)) => {
            let mut id = source.to_bytes();
            id.extend_from_slice(&seq.to_be_bytes());
            gossipsub::MessageId::new(&id)
        }
        _ => {
            gossipsub::MessageId::new(ring::digest::digest(&ring::digest::SHA256, &m.data).as_ref())
        }
    }
}

/// Registers this node every interval and keeps the swarm task's registry
/// current, forever: the registry is read after each registration, on every
/// change the watch reports, when a watch is (re)made, and when the swarm
/// task saw an unknown peer (at most once per [`MIN_REFRESH_SPACING`]).
/// Store failures are logged and the previous registry stays in force; a
/// broken watch is made again after a backoff.
async fn registry_loop(
    store: Store,
    peer_id: PeerId,
    listen_addrs: Arc<parking_lot::RwLock<Vec<Multiaddr>>>,
    tx: mpsc::WeakSender<Command>,
    refresh: Arc<Notify>,
    config: MeshConfig,
) {
    let key = registry_key(&peer_id);
    let mut tick = tokio::time::interval(config.registry_interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut watch: Option<PrefixWatch> = None;
    let mut watch_at = tokio::time::Instant::now();
    let mut watch_backoff = WATCH_BACKOFF_MIN;
    let mut refresh_at = tokio::time::Instant::now();
    let mut refresh_pending = false;
    loop {
        let mut register = false;
        tokio::select! {
            _ = tick.tick() => register = true,
            _ = tokio::time::sleep_until(watch_at), if watch.is_none() => {
                match store.watch_prefix(REGISTRY_PREFIX.as_bytes()).await {
                    Ok(w) => {
                        debug!("Mesh registry watch started.");
                        watch = Some(w);
                        watch_backoff = WATCH_BACKOFF_MIN;
                    }
                    Err(e) => {
                        warn!(error = %e, retry_in_ms = watch_backoff.as_millis() as u64, "Mesh registry watch not started.");
                        watch_at = tokio::time::Instant::now() + watch_backoff;
                        watch_backoff = (watch_backoff * 2).min(WATCH_BACKOFF_MAX);
                        continue;
                    }
                }
            }
            changes = next_changes(&mut watch) => match changes {
                Ok(changes) => {
                    // This node's own registration gone (its lease ran out
                    // while etcd was out of reach): written again at once.
                    register = changes.iter().any(|c| matches!(c, Change::Delete(k) if *k == key.as_bytes()));
                    // This node's own re-registration changes nothing.
                    if changes.iter().all(|c| matches!(c, Change::Put(k) if *k == key.as_bytes())) {
                        continue;
                    }
                }
                Err(e) => {
                    warn!(error = %e, retry_in_ms = watch_backoff.as_millis() as u64, "Mesh registry watch broke; making it again.");
                    watch = None;
                    watch_at = tokio::time::Instant::now() + watch_backoff;
                    watch_backoff = (watch_backoff * 2).min(WATCH_BACKOFF_MAX);
                    continue;
                }
            },
            _ = refresh.notified(), if !refresh_pending => {
                if tokio::time::Instant::now() < refresh_at {
                    refresh_pending = true;
                    continue;
                }
            }
            _ = tokio::time::sleep_until(refresh_at), if refresh_pending => {}
        }
        if register {
            let reg = Registration {
                peer_id: peer_id.to_string(),
                addrs: listen_addrs.read().iter().map(|a| a.to_string()).collect(),
            };
            let value = serde_json::to_vec(&reg).expect("serializable");
            if let Err(e) = store
                .put_ttl(key.as_bytes(), &value, config.registry_ttl)
                .await
            {
                warn!(error = %e, "Mesh registration failed.");
            }
        }
        refresh_pending = false;
        refresh_at =
            tokio::time::Instant::now() + MIN_REFRESH_SPACING.min(config.registry_interval);
        match store.scan_all(REGISTRY_PREFIX.as_bytes()).await {
            Ok(entries) => {
                let peers = parse_registry(&entries, &peer_id);
                let Some(tx) = tx.upgrade() else { return };
                if tx.send(Command::Registry(peers)).await.is_err() {
                    return;
                }
            }
            Err(e) => warn!(error = %e, "Mesh registry not read; keeping the last one."),
        }
    }
}

/// The next changes of the watch; never, while there is none.
async fn next_changes(watch: &mut Option<PrefixWatch>) -> StoreResult<Vec<Change>> {
    match watch {
        Some(w) => w.next().await,
        None => std::future::pending().await,
    }
}

/// The registered peers (this node excluded) and their addresses; malformed
/// entries are skipped.
fn parse_registry(entries: &[(Vec<u8>, Vec<u8>)], me: &PeerId) -> HashMap<PeerId, Vec<Multiaddr>> {
    let mut peers = HashMap::new();
    for (key, value) in entries {
        let name = String::from_utf8_lossy(&key[REGISTRY_PREFIX.len().min(key.len())..]);
        let parsed = serde_json::from_slice::<Registration>(value)
            .ok()
            .filter(|r| r.peer_id == name)
            .and_then(|r| Some((r.peer_id.parse::<PeerId>().ok()?, r.addrs)));
        let Some((peer, addrs)) = parsed else {
            warn!(key = %name, "Malformed mesh registration skipped.");
            continue;
        };
        if peer == *me {
            continue;
        }
        let addrs: Vec<Multiaddr> = addrs.iter().filter_map(|a| a.parse().ok()).collect();
        if !addrs.is_empty() {
            peers.insert(peer, addrs);
        }
    }
    peers
}

/// Every listen address registered in the mesh registry (`entries`: a scan
/// of [`REGISTRY_PREFIX`]), this node's too: the cluster's gossip addresses,
/// which the egress policy keeps closed to upstreams.
pub fn registered_addrs(entries: &[(Vec<u8>, Vec<u8>)]) -> Vec<String> {
    entries
        .iter()
        .filter_map(|(_, v)| serde_json::from_slice::<Registration>(v).ok())
        .flat_map(|r| r.addrs)
        .collect()
}

/// The IP a multiaddr names, if any.
fn ip_of(addr: &Multiaddr) -> Option<IpAddr> {
    addr.iter().find_map(|p| match p {
        Protocol::Ip4(ip) => Some(IpAddr::V4(ip)),
        Protocol::Ip6(ip) => Some(IpAddr::V6(ip)),
        _ => None,
    })
}

/// One incarnation of a sender's (namespace, topic) counter: what its kept
/// messages are filed under.
#[derive(Debug, PartialEq, Eq, Hash)]
struct StreamId {
    namespace: String,
    topic: String,
    epoch: u64,
}

/// A sent message kept for resending.
struct KeptMessage {
    timestamp: u64,
    data: Bytes,
    history: Option<(u64, String)>,
}

/// The messages of one stream kept for resending: consecutive sequence
/// numbers from `first`.
struct KeptStream {
    first: u64,
    messages: VecDeque<KeptMessage>,
}

/// The sender's resend buffer: the latest sent messages, bounded by bytes
/// and count; the oldest leave first.
struct Kept {
    streams: HashMap<Arc<StreamId>, KeptStream>,
    /// Runs of one stream in send order: (stream, messages, bytes).
    order: VecDeque<(Arc<StreamId>, usize, usize)>,
    bytes: usize,
    messages: usize,
    max_bytes: usize,
    max_messages: usize,
}

impl Kept {
    fn new(max_bytes: usize, max_messages: usize) -> Self {
        Self {
            streams: HashMap::new(),
            order: VecDeque::new(),
            bytes: 0,
            messages: 0,
            max_bytes,
            max_messages,
        }
    }

    fn weight(m: &KeptMessage) -> usize {
        m.data.len() + ENTRY_OVERHEAD + m.history.as_ref().map_or(0, |(_, e)| e.len())
    }

    /// Keeps message `seq` of stream `id` (sent in order), then drops the
    /// oldest runs until the bounds hold again.
    fn keep(&mut self, id: &Arc<StreamId>, seq: u64, m: KeptMessage) {
        if self.max_messages == 0 || self.max_bytes == 0 {
            return;
        }
        let w = Self::weight(&m);
        let stream = self
            .streams
            .entry(id.clone())
            .or_insert_with(|| KeptStream {
                first: seq,
                messages: VecDeque::new(),
            });
        if stream.first + stream.messages.len() as u64 != seq {
            // Not the next one (cannot happen: a stream is sent in order):
            // start over rather than file it under a wrong number.
            let dropped: usize = stream.messages.iter().map(Self::weight).sum();
            self.bytes -= dropped;
            self.messages -= stream.messages.len();
            stream.messages.clear();
            stream.first = seq;
        }
        stream.messages.push_back(m);
        self.bytes += w;
        self.messages += 1;
        match self.order.back_mut() {
            Some((last, n, b)) if Arc::ptr_eq(last, id) => {
                *n += 1;
                *b += w;
            }
            _ => self.order.push_back((id.clone(), 1, w)),
        }
        while self.bytes > self.max_bytes || self.messages > self.max_messages {
            let Some((id, n, b)) = self.order.pop_front() else {
                break;
            };
            self.bytes -= b;
            self.messages -= n;
            if let Some(stream) = self.streams.get_mut(&id) {
                let n = n.min(stream.messages.len());
                stream.messages.drain(..n);
                stream.first += n as u64;
                if stream.messages.is_empty() {
                    self.streams.remove(&id);
                }
            }
        }
    }

    /// The answer to a resend request: what is still kept of the gaps
    /// asked for (within [`RESEND_REPLY_BYTES`]) as a batch from `origin`,
    /// and the gaps (or their starts) no longer kept.
    fn answer(&self, origin: &[u8], wants: &[WireWant]) -> ResendResponse {
        let mut entries = Vec::new();
        let mut gone = Vec::new();
        let mut bytes = 0;
        'wants: for w in wants.iter().take(MAX_WANTS) {
            if w.to < w.from {
                continue;
            }
            let id = StreamId {
                namespace: w.namespace.clone(),
                topic: w.topic.clone(),
                epoch: w.epoch,
            };
            let Some(stream) = self.streams.get(&id) else {
                gone.push(w.clone());
                continue;
            };
            if w.from < stream.first {
                gone.push(WireWant {
                    to: w.to.min(stream.first - 1),
                    ..w.clone()
                });
            }
            let from = w.from.max(stream.first);
            let to = w.to.min(from.saturating_add(MAX_WANT_LEN));
            for seq in from..=to {
                let Some(m) = stream.messages.get((seq - stream.first) as usize) else {
                    break;
                };
                let weight = Self::weight(m) + w.namespace.len() + w.topic.len();
                if !entries.is_empty() && bytes + weight > RESEND_REPLY_BYTES {
                    break 'wants;
                }
                bytes += weight;
                entries.push(WireEntry {
                    namespace: &w.namespace,
                    topic: &w.topic,
                    epoch: w.epoch,
                    seq,
                    timestamp: m.timestamp,
                    data: &m.data,
                    history: m.history.as_ref().map(|(o, e)| (*o, e.as_str())),
                });
            }
        }
        let batch = if entries.is_empty() {
            Vec::new()
        } else {
            postcard::to_allocvec(&WireBatch {
                origin,
                attempt: 0,
                entries,
            })
            .unwrap_or_default()
        };
        ResendResponse::Resend { batch, gone }
    }
}

/// A sender's counter for one (namespace, topic).
struct SendStream {
    /// The stream's epoch: larger than any earlier one of this origin, across restarts too.
    epoch: u64,
    /// What its kept messages are filed under.
    id: Arc<StreamId>,
    /// The sequence number the next sent message gets (starts at 1).
    next: u64,
    /// Last publish on the stream; an idle one (`STREAM_IDLE`) is forgotten.
    last_used: Instant,
}

/// Receiver streams are keyed by (origin, namespace, topic).
type StreamKey = (PeerId, String, String);

/// What became of one batch.
#[derive(Debug, PartialEq, Eq)]
enum Published {
    Sent,
    /// Every peer's send queue was full: the batch waits for a retry.
    QueuesFull,
    Dropped,
}

struct SwarmTask {
    /// The libp2p swarm: connections, allow list and GossipSub.
    swarm: Swarm<Behaviour>,
    /// Hash of `MESH_TOPIC`, the one topic batches are published on.
    topic: TopicHash,
    /// This node's id; its own messages are refused and it decides who dials first.
    peer_id: PeerId,
    /// This node's peer id as bytes, put in every batch (checked against the signer).
    origin: Vec<u8>,
    /// Current listen addresses, shared with the registry task that registers them.
    listen_addrs: Arc<parking_lot::RwLock<Vec<Multiaddr>>>,
    /// The latest registry scan.
    registry: HashMap<PeerId, Vec<Multiaddr>>,
    /// Send counters by (namespace, topic); idle ones are swept.
    send: HashMap<(String, String), SendStream>,
    /// The largest epoch handed out, so a new counter takes a larger one.
    last_epoch: u64,
    /// Received messages held per stream until the gap before them fills
    /// (or is skipped).
    reorder: Reorder<StreamKey, Received>,
    /// Sent messages kept for resending.
    kept: Kept,
    /// The resend request in flight to each sender (one at a time).
    inflight: HashMap<PeerId, request_response::OutboundRequestId>,
    /// When this node connected to each connected peer (µs since the Unix
    /// epoch, the unit of stream epochs): a stream whose epoch began later
    /// is received from its first message on.
    connected_since: HashMap<PeerId, u64>,
    /// When the heads were last announced.
    heads_at: Instant,
    /// Timings and sizes.
    config: MeshConfig,
    /// Hands received messages to this node's subscribers, per namespace.
    deliver_fn: DeliverFn,
    /// Node metrics: sent, batches, deferred, drops, gaps skipped, peers.
    metrics: Metrics,
    /// Wakes the registry task early, when an unknown peer's connection was refused.
    refresh: Arc<Notify>,
    /// Messages waiting for the mesh, oldest first: published in batches,
    /// in order; while every peer's send queue is full they wait, so a burst
    /// is delayed rather than lost.
    backlog: VecDeque<Outbound>,
    /// Payload bytes in `backlog`; a message past `BACKLOG_BYTES` is dropped.
    backlog_bytes: usize,
    /// Publishes refused because every peer's send queue was full.
    refused: u64,
    /// The last publish was refused so: only the retry timer tries again
    /// (not every arriving message, which would sign a batch for nothing).
    blocked: bool,
    /// Registered peers not connected (or not yet subscribed to the mesh
    /// topic): when to dial next, and the wait after.
    dials: HashMap<PeerId, Redial>,
    /// Whether a registry read arrived.
    registry_read: bool,
}

/// The dial schedule of a registered peer that is not connected.
struct Redial {
    /// When to dial the peer next.
    at: Instant,
    /// The wait after that dial; doubles each time, so a failing peer is not hammered.
    backoff: Duration,
}

impl SwarmTask {
    async fn run(mut self, mut rx: mpsc::Receiver<Command>, tick: Duration) {
        let mut tick = tokio::time::interval(tick);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut last_sweep = crate::util::mono_now();
        let mut retry = tokio::time::interval(BACKLOG_RETRY);
        retry.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut dial_tick = tokio::time::interval(DIAL_TICK);
        dial_tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let linger = tokio::time::sleep(Duration::ZERO);
        tokio::pin!(linger);
        let mut lingering = false;
        loop {
            tokio::select! {
                event = self.swarm.select_next_some() => self.on_event(event),
                _ = &mut linger, if lingering => {
                    lingering = false;
                    if !self.blocked {
                        self.flush_backlog();
                    }
                }
                _ = dial_tick.tick(), if !self.dials.is_empty() => self.dial_due(),
                _ = retry.tick(), if !self.backlog.is_empty() => self.flush_backlog(),
                cmd = rx.recv() => match cmd {
                    Some(cmd) => {
                        self.on_command(cmd);
                        // What is already queued joins the same batches.
                        let mut queued = 1;
                        for _ in 0..BATCH_MESSAGES {
                            match rx.try_recv() {
                                Ok(cmd) => {
                                    self.on_command(cmd);
                                    queued += 1;
                                }
                                Err(_) => break,
                            }
                        }
                        let full = self.backlog.len() >= BATCH_MESSAGES
                            || self.backlog_bytes >= BATCH_BYTES;
                        if self.blocked {
                            // The retry timer publishes.
                        } else if full || (!lingering && queued == 1) {
                            lingering = false;
                            self.flush_backlog();
                        } else if !lingering && !self.backlog.is_empty() {
                            // A burst: let the next batch fill for a moment.
                            linger
                                .as_mut()
                                .reset(tokio::time::Instant::now() + LINGER);
                            lingering = true;
                        }
                    }
                    None => break,
                },
                _ = tick.tick() => {
                    let now = crate::util::mono_now();
                    self.reorder.forget_idle(now, STREAM_IDLE * 2);
                    self.ask_for_gaps(now);
                    if now.duration_since(self.heads_at) >= self.config.heads_interval {
                        self.announce_heads(now);
                    }
                    if now.duration_since(last_sweep) >= STREAM_IDLE / 10 {
                        last_sweep = now;
                        self.send.retain(|_, s| now.duration_since(s.last_used) < STREAM_IDLE);
                    }
                }
            }
        }
    }

    fn drop_count(&self, reason: &str) {
        self.metrics.mesh_dropped.with_label_values(&[reason]).inc();
    }

    fn gaps_skipped(&self, reason: &str, n: u64) {
        if n > 0 {
            self.metrics
                .mesh_gaps_skipped
                .with_label_values(&[reason])
                .inc_by(n);
        }
    }

    /// Asks every sender with a gap that waited long enough for it (one
    /// request per sender in flight); a sender with no connection left is
    /// gone, and its gaps are skipped.
    fn ask_for_gaps(&mut self, now: Instant) {
        let inflight = &self.inflight;
        let wants = self.reorder.wants(
            now,
            self.config.resend_after,
            self.config.tail_after,
            MAX_WANT_LEN,
            |(origin, _, _)| !inflight.contains_key(origin),
        );
        if wants.is_empty() {
            return;
        }
        let mut by_origin: HashMap<PeerId, Vec<WireWant>> = HashMap::new();
        for w in wants {
            let (origin, namespace, topic) = w.key;
            let list = by_origin.entry(origin).or_default();
            if list.len() < MAX_WANTS {
                list.push(WireWant {
                    namespace,
                    topic,
                    epoch: w.epoch,
                    from: w.from,
                    to: w.to,
                });
            }
        }
        for (origin, wants) in by_origin {
            if !self.swarm.is_connected(&origin) {
                self.sender_gone(origin);
                continue;
            }
            debug!(peer_id = %origin, streams = wants.len(), "Mesh gap: asking the sender to resend.");
            self.metrics.mesh_resend_requests.inc();
            let id = self
                .swarm
                .behaviour_mut()
                .resend
                .send_request(&origin, ResendRequest::Resend(wants));
            self.inflight.insert(origin, id);
        }
    }

    /// A sender left the mesh: every gap in its streams is skipped
    /// (counted), releasing what waited behind them.
    fn sender_gone(&mut self, origin: PeerId) {
        let mut ready = Vec::new();
        let skipped = self.reorder.skip_all(|(o, _, _)| *o == origin, &mut ready);
        self.inflight.remove(&origin);
        if skipped > 0 {
            warn!(peer_id = %origin, skipped, "Mesh sender gone; its gaps are skipped.");
        }
        self.gaps_skipped("sender_gone", skipped);
        self.deliver(ready);
    }

    /// Tells every connected peer how far the streams used since the last
    /// announcement got, so a lost last batch is a gap it asks for.
    fn announce_heads(&mut self, now: Instant) {
        let since = self.heads_at;
        self.heads_at = now;
        let heads: Vec<WireWant> = self
            .send
            .iter()
            .filter(|(_, s)| s.last_used >= since && s.next > 1)
            .map(|((namespace, topic), s)| WireWant {
                namespace: namespace.clone(),
                topic: topic.clone(),
                epoch: s.epoch,
                from: 0,
                to: s.next - 1,
            })
            .collect();
        if heads.is_empty() {
            return;
        }
        let peers: Vec<PeerId> = self
            .swarm
            .connected_peers()
            .filter(|p| self.registry.contains_key(p))
            .copied()
            .collect();
        for chunk in heads.chunks(MAX_WANTS) {
            for peer in &peers {
                self.swarm
                    .behaviour_mut()
                    .resend
                    .send_request(peer, ResendRequest::Heads(chunk.to_vec()));
            }
        }
    }

    /// A resend request or heads announcement from a peer, or the answer to ours.
    fn on_resend(&mut self, event: request_response::Event<ResendRequest, ResendResponse>) {
        match event {
            request_response::Event::Message {
                peer,
                message:
                    request_response::Message::Request {
                        request, channel, ..
                    },
                ..
            } => {
                // Only members are answered (the allow list already keeps
                // others out).
                if !self.registry.contains_key(&peer) {
                    return;
                }
                let response = match request {
                    ResendRequest::Resend(wants) => {
                        let answer = self.kept.answer(&self.origin, &wants);
                        if let ResendResponse::Resend { batch, .. } = &answer
                            && !batch.is_empty()
                        {
                            self.metrics.mesh_resends_served.inc();
                        }
                        answer
                    }
                    ResendRequest::Heads(heads) => {
                        self.on_heads(peer, heads);
                        ResendResponse::Heads
                    }
                };
                let _ = self
                    .swarm
                    .behaviour_mut()
                    .resend
                    .send_response(channel, response);
            }
            request_response::Event::Message {
                peer,
                message:
                    request_response::Message::Response {
                        request_id,
                        response,
                    },
                ..
            } => {
                if let ResendResponse::Resend { batch, gone } = response {
                    if self.inflight.get(&peer) == Some(&request_id) {
                        self.inflight.remove(&peer);
                    }
                    self.on_resent(peer, batch, gone);
                }
            }
            request_response::Event::OutboundFailure {
                peer,
                request_id,
                error,
                ..
            } => {
                debug!(peer_id = %peer, error = %error, "Mesh resend request failed.");
                // Asked again at the next tick (or skipped: the sender is gone).
                if self.inflight.get(&peer) == Some(&request_id) {
                    self.inflight.remove(&peer);
                }
            }
            _ => {}
        }
    }

    /// Heads announced by `origin`: anything up to them not received is a gap.
    fn on_heads(&mut self, origin: PeerId, heads: Vec<WireWant>) {
        let now = crate::util::mono_now();
        let since = self.connected_since.get(&origin).copied();
        for h in heads.into_iter().take(MAX_WANTS) {
            let start = since.is_some_and(|c| h.epoch > c);
            self.reorder
                .note_head((origin, h.namespace, h.topic), h.epoch, h.to, start, now);
        }
    }

    /// A resend answer from `origin`: what came is released in order, what
    /// the sender no longer holds is skipped (counted).
    fn on_resent(&mut self, origin: PeerId, batch: Vec<u8>, gone: Vec<WireWant>) {
        let now = crate::util::mono_now();
        let mut released = Vec::new();
        if !batch.is_empty() {
            match postcard::from_bytes::<WireBatch>(&batch) {
                Ok(m) if PeerId::from_bytes(m.origin).ok() == Some(origin) => {
                    self.metrics.mesh_resent.inc_by(m.entries.len() as u64);
                    self.push_entries(origin, m.entries, now, &mut released);
                }
                _ => {
                    warn!(peer_id = %origin, "Invalid mesh resend answer dropped.");
                    self.drop_count("bad_resend");
                }
            }
        }
        let mut evicted = 0;
        for g in gone.into_iter().take(MAX_WANTS) {
            evicted += self.reorder.skip_through(
                &(origin, g.namespace, g.topic),
                g.epoch,
                g.to,
                now,
                &mut released,
            );
        }
        if evicted > 0 {
            warn!(peer_id = %origin, skipped = evicted, "Mesh gap no longer held by its sender; skipped.");
        }
        self.gaps_skipped("evicted", evicted);
        self.deliver(released);
    }

    /// Pushes a batch's entries into the reorder buffer (streams the
    /// receiver saw begin start at 1), counting drops and skipped gaps.
    fn push_entries(
        &mut self,
        origin: PeerId,
        entries: Vec<WireEntry<'_>>,
        now: Instant,
        released: &mut Vec<Received>,
    ) {
        let since = self.connected_since.get(&origin).copied();
        let mut dropped = super::reorder::Run::default();
        for (key, items) in runs(origin, entries) {
            if let (Some(c), Some(&(epoch, _, _, _))) = (since, items.first())
                && epoch > c
                && !self.reorder.has(&key)
            {
                self.reorder.start(key.clone(), epoch, 1, now);
            }
            let r = self.reorder.push_run(key, items, now, released);
            dropped.duplicates += r.duplicates;
            dropped.stale += r.stale;
            dropped.gaps_skipped += r.gaps_skipped;
            dropped.gaps_restarted += r.gaps_restarted;
        }
        for (reason, n) in [
            (super::reorder::Dropped::Duplicate, dropped.duplicates),
            (super::reorder::Dropped::Stale, dropped.stale),
        ] {
            if n > 0 {
                self.metrics
                    .mesh_dropped
                    .with_label_values(&[reason.label()])
                    .inc_by(n);
            }
        }
        self.gaps_skipped("overflow", dropped.gaps_skipped);
        self.gaps_skipped("restarted", dropped.gaps_restarted);
    }

    fn on_command(&mut self, cmd: Command) {
        match cmd {
            Command::Forward(out) => self.hold(out),
            Command::Registry(peers) => self.on_registry(peers),
            Command::Status(reply) => {
                let subscribed = self
                    .swarm
                    .behaviour()
                    .gossipsub
                    .all_peers()
                    .filter(|(_, topics)| topics.contains(&&self.topic))
                    .map(|(p, _)| *p)
                    .collect();
                let _ = reply.send(MeshStatus {
                    peer_id: self.peer_id,
                    listen_addrs: self.listen_addrs.read().clone(),
                    registered: self.registry.keys().copied().collect(),
                    connected: self.swarm.connected_peers().copied().collect(),

                    subscribed,
                    pending: self.reorder.pending(),
                    registry_read: self.registry_read,
                });
            }
        }
    }

    /// Queues a message for the next batch, within the byte budget.
    fn hold(&mut self, out: Outbound) {
        if self.backlog_bytes + out.data.len() > BACKLOG_BYTES {
            self.drop_count("backlog_full");
            return;
        }
        self.backlog_bytes += out.data.len();
        self.backlog.push_back(out);
    }

    /// Publishes waiting messages in batches, in order, until none is left
    /// or every peer's send queue is full (then only the retry timer comes
    /// back, every `BACKLOG_RETRY`).
    fn flush_backlog(&mut self) {
        while !self.backlog.is_empty() {
            let mut n = 0;
            let mut bytes = 0;
            for out in &self.backlog {
                if n == BATCH_MESSAGES || (n > 0 && bytes + out.data.len() > BATCH_BYTES) {
                    break;
                }
                n += 1;
                bytes += out.data.len();
            }
            let published = self.publish(n);
            self.blocked = published == Published::QueuesFull;
            if self.blocked {
                return;
            }
            for out in self.backlog.drain(..n) {
                self.backlog_bytes -= out.data.len();
            }
        }
    }

    /// Numbers the first `n` waiting messages in their (namespace, topic)
    /// streams and publishes them as one batch. The sequences only advance
    /// when GossipSub took the batch, so a batch with no peer to reach leaves
    /// no gap behind, and a refused one is numbered again on its retry.
    fn publish(&mut self, n: usize) -> Published {
        let now = crate::util::mono_now();
        // This batch's streams: (namespace, topic, epoch, first sequence,
        // messages taken), looked up once per stream (a run of one topic,
        // the usual burst, reuses the last one).
        let mut runs: Vec<(&str, &str, u64, u64, u64)> = Vec::new();
        let mut ids: Vec<Arc<StreamId>> = Vec::new();
        let mut entry_run: Vec<usize> = Vec::with_capacity(n);
        let mut index: HashMap<(&str, &str), usize> = HashMap::new();
        let mut entries = Vec::with_capacity(n);
        for out in self.backlog.iter().take(n) {
            let (ns, topic) = (out.namespace.as_str(), out.topic.as_str());
            let i = match runs.last() {
                Some(r) if r.0 == ns && r.1 == topic => runs.len() - 1,
                _ => match index.get(&(ns, topic)) {
                    Some(&i) => i,
                    None => {
                        let stream = self
                            .send
                            .entry((ns.to_string(), topic.to_string()))
                            .or_insert_with(|| {
                                // Epochs grow across restarts (microseconds
                                // since the Unix epoch) and within a run (each
                                // new counter takes a larger one).
                                let epoch = now_micros().max(self.last_epoch + 1);
                                self.last_epoch = epoch;
                                SendStream {
                                    epoch,
                                    id: Arc::new(StreamId {
                                        namespace: ns.to_string(),
                                        topic: topic.to_string(),
                                        epoch,
                                    }),
                                    next: 1,
                                    last_used: now,
                                }
                            });
                        stream.last_used = now;
                        ids.push(stream.id.clone());
                        runs.push((ns, topic, stream.epoch, stream.next, 0));
                        index.insert((ns, topic), runs.len() - 1);
                        runs.len() - 1
                    }
                },
            };
            entry_run.push(i);
            let run = &mut runs[i];
            entries.push(WireEntry {
                namespace: ns,
                topic,
                epoch: run.2,
                seq: run.3 + run.4,
                timestamp: out.timestamp,
                data: &out.data,
                history: out.history.as_ref().map(|(o, e)| (*o, e.as_str())),
            });
            run.4 += 1;
        }
        let batch = WireBatch {
            origin: &self.origin,
            attempt: self.refused,
            entries,
        };
        let encoded = postcard::to_allocvec(&batch).expect("encodable");
        let advance: Vec<((String, String), u64)> = runs
            .iter()
            .map(|r| ((r.0.to_string(), r.1.to_string()), r.4))
            .collect();
        let firsts: Vec<u64> = runs.iter().map(|r| r.3).collect();
        let drop_all = |me: &Self, reason: &str| {
            me.metrics
                .mesh_dropped
                .with_label_values(&[reason])
                .inc_by(n as u64);
            Published::Dropped
        };
        match self
            .swarm
            .behaviour_mut()
            .gossipsub
            .publish(self.topic.clone(), encoded)
        {
            Ok(_) => {
                // Kept for resending, in send order.
                let mut taken = vec![0u64; ids.len()];
                for (out, &i) in self.backlog.iter().take(n).zip(&entry_run) {
                    self.kept.keep(
                        &ids[i],
                        firsts[i] + taken[i],
                        KeptMessage {
                            timestamp: out.timestamp,
                            data: out.data.clone(),
                            history: out.history.clone(),
                        },
                    );
                    taken[i] += 1;
                }
                for (key, taken) in advance {
                    if let Some(stream) = self.send.get_mut(&key) {
                        stream.next += taken;
                    }
                }
                self.metrics.mesh_sent.inc_by(n as u64);
                self.metrics.mesh_batches.inc();
                Published::Sent
            }
            Err(gossipsub::PublishError::AllQueuesFull(_)) => {
                self.refused += 1;
                self.metrics.mesh_deferred.inc();
                Published::QueuesFull
            }
            Err(gossipsub::PublishError::NoPeersSubscribedToTopic) => drop_all(self, "no_peers"),
            Err(gossipsub::PublishError::MessageTooLarge) => drop_all(self, "too_large"),
            Err(e) => {
                debug!(error = %e, "Mesh publish failed.");
                drop_all(self, "publish_failed")
            }
        }
    }

    /// Applies a registry read: allows exactly the registered peers (closing
    /// connections of peers that left it) and schedules dials of the ones
    /// not connected.
    fn on_registry(&mut self, peers: HashMap<PeerId, Vec<Multiaddr>>) {
        let allow = &mut self.swarm.behaviour_mut().allow;
        let gone: Vec<PeerId> = allow
            .allowed_peers()
            .iter()
            .filter(|p| !peers.contains_key(p))
            .copied()
            .collect();
        for peer in gone {
            info!(peer_id = %peer, "Mesh peer left the registry; disconnecting.");
            allow.disallow_peer(peer);
        }
        for peer in peers.keys() {
            allow.allow_peer(*peer);
        }
        self.registry = peers;
        self.registry_read = true;
        self.dials.retain(|p, _| self.registry.contains_key(p));
        let unconnected: Vec<PeerId> = self
            .registry
            .keys()
            .filter(|p| !self.swarm.is_connected(p))
            .copied()
            .collect();
        for peer in unconnected {
            self.schedule_dial(peer);
        }
        self.dial_due();
    }

    /// Puts a registered peer that is not connected on the dial schedule
    /// (unless it is already). Usually one connection per pair: GossipSub
    /// shares one send queue among a peer's connections, so two (both sides
    /// dialing at once) carry its frames in two streams, which the
    /// receiver's reorder buffer must put back in order. The peer with the
    /// smaller id dials at once; the other only if still not connected
    /// [`DIAL_GRACE`] later (its dial also makes a peer that does not know
    /// it yet re-read the registry).
    fn schedule_dial(&mut self, peer: PeerId) {
        let grace = if self.peer_id < peer {
            Duration::ZERO
        } else {
            DIAL_GRACE
        };
        self.dials.entry(peer).or_insert_with(|| Redial {
            at: crate::util::mono_now() + grace,
            backoff: DIAL_BACKOFF_MIN,
        });
    }

    /// Dials the scheduled peers whose time came, each at its registered
    /// addresses only, and doubles their wait. A peer leaves the schedule
    /// once it subscribed to the mesh topic (a connection that works), so a
    /// connection that opens and is closed at once (the other side did not
    /// know this node yet) is retried with backoff, not in a loop.
    fn dial_due(&mut self) {
        let now = crate::util::mono_now();
        let mut due = Vec::new();
        for (peer, r) in self.dials.iter_mut() {
            if now >= r.at && !self.swarm.is_connected(peer) {
                due.push(*peer);
                r.at = now + r.backoff;
                r.backoff = (r.backoff * 2).min(DIAL_BACKOFF_MAX);
            }
        }
        for peer in due {
            let Some(addrs) = self.registry.get(&peer) else {
                continue;
            };
            let opts = DialOpts::peer_id(peer)
                .condition(PeerCondition::DisconnectedAndNotDialing)
                .addresses(addrs.clone())
                .build();
            if let Err(e) = self.swarm.dial(opts) {
                debug!(peer_id = %peer, error = %e, "Mesh dial not started.");
            }
        }
    }

    fn on_event(&mut self, event: SwarmEvent<BehaviourEvent>) {
        match event {
            SwarmEvent::Behaviour(BehaviourEvent::Gossipsub(gossipsub::Event::Message {
                propagation_source,
                message_id,
                message,
            })) => self.on_message(propagation_source, message_id, message),
            SwarmEvent::Behaviour(BehaviourEvent::Resend(event)) => self.on_resend(event),
            SwarmEvent::Behaviour(BehaviourEvent::Gossipsub(gossipsub::Event::Subscribed {
                peer_id,
                ..
            })) => {
                self.dials.remove(&peer_id);
            }
            SwarmEvent::Behaviour(BehaviourEvent::Gossipsub(gossipsub::Event::SlowPeer {
                peer_id,
                failed_messages,
            })) => {
                // Batches that waited past SEND_TIMEOUT in the peer's queue
                // (or found it full while another's was not): the peer asks
                // for them again (its gap, or the heads announced).
                let missed = failed_messages.priority + failed_messages.non_priority;
                debug!(peer_id = %peer_id, batches = missed, "Mesh peer's send queue full; it gets those batches by resend.");
                self.metrics.mesh_peer_queue_full.inc_by(missed as u64);
            }
            SwarmEvent::ConnectionEstablished {
                peer_id,
                connection_id,
                endpoint,
                ..
            } => {
                // The allow list let the peer in; an inbound connection must
                // also come from an IP the peer registered.
                if endpoint.is_listener() {
                    let from = ip_of(endpoint.get_remote_address());
                    let registered = self.registry.get(&peer_id).is_some_and(|addrs| {
                        addrs.iter().any(|a| ip_of(a).is_some() && ip_of(a) == from)
                    });
                    if !registered {
                        warn!(peer_id = %peer_id, from = ?from, "Mesh connection from an unregistered address refused.");
                        self.metrics.mesh_connections_refused.inc();
                        self.swarm.close_connection(connection_id);
                        return;
                    }
                }
                debug!(peer_id = %peer_id, "Mesh peer connected.");
                self.connected_since
                    .entry(peer_id)
                    .or_insert_with(now_micros);
                self.metrics
                    .mesh_peers
                    .set(self.swarm.connected_peers().count() as i64);
            }
            SwarmEvent::ConnectionClosed {
                peer_id,
                num_established,
                ..
            } => {
                debug!(peer_id = %peer_id, "Mesh connection closed.");
                if num_established == 0 {
                    // Gone from the mesh: nothing it sent can be asked for.
                    self.connected_since.remove(&peer_id);
                    self.sender_gone(peer_id);
                }
                // A registered peer lost: dialed again until it is back or
                // its registration goes.
                if num_established == 0 && self.registry.contains_key(&peer_id) {
                    self.schedule_dial(peer_id);
                }
                self.metrics
                    .mesh_peers
                    .set(self.swarm.connected_peers().count() as i64);
            }
            SwarmEvent::IncomingConnectionError { peer_id, error, .. } => {
                // A peer the allow list does not know: refused. It may have
                // just registered, so the registry is re-read soon.
                debug!(peer_id = ?peer_id, error = %error, "Mesh connection refused.");
                self.metrics.mesh_connections_refused.inc();
                self.refresh.notify_one();
            }
            SwarmEvent::OutgoingConnectionError { peer_id, error, .. } => {
                debug!(peer_id = ?peer_id, error = %error, "Mesh dial failed.");
            }
            SwarmEvent::NewListenAddr { address, .. } => {
                let mut addrs = self.listen_addrs.write();
                if !addrs.contains(&address) {
                    addrs.push(address);
                }
            }
            SwarmEvent::ExpiredListenAddr { address, .. } => {
                self.listen_addrs.write().retain(|a| *a != address);
            }
            _ => {}
        }
    }

    /// Checks a received message, lets GossipSub relay it only if valid, and
    /// releases it (and whatever it unblocked) in stream order.
    fn on_message(
        &mut self,
        source: PeerId,
        id: gossipsub::MessageId,
        message: gossipsub::Message,
    ) {
        let checked = match postcard::from_bytes::<WireBatch>(&message.data) {
            Err(_) => Err("decode"),
            Ok(m) => match PeerId::from_bytes(m.origin) {
                Ok(origin)
                    if Some(origin) == message.source
                        && origin != self.peer_id
                        && self.registry.contains_key(&origin) =>
                {
                    Ok((origin, m))
                }
                _ => Err("bad_origin"),
            },
        };
        let acceptance = if checked.is_ok() {
            MessageAcceptance::Accept
        } else {
            MessageAcceptance::Reject
        };
        self.swarm
            .behaviour_mut()
            .gossipsub
            .report_message_validation_result(&id, &source, acceptance);
        let (origin, msg) = match checked {
            Ok(checked) => checked,
            Err(reason) => {
                warn!(peer_id = %source, reason, "Invalid mesh message dropped.");
                self.drop_count(reason);
                return;
            }
        };
        if let Some(hook) = &self.config.drop_received {
            let payloads: Vec<&[u8]> = msg.entries.iter().map(|e| e.data).collect();
            if (hook.0)(&payloads) {
                return;
            }
        }
        self.metrics.mesh_received.inc_by(msg.entries.len() as u64);
        let now = crate::util::mono_now();
        let mut released = Vec::with_capacity(msg.entries.len());
        self.push_entries(origin, msg.entries, now, &mut released);
        self.deliver(released);
    }

    /// Hands released messages to the node: one call per namespace, each
    /// with that namespace's messages in the order released (which keeps
    /// every stream's order).
    fn deliver(&self, ready: Vec<Received>) {
        if ready.is_empty() {
            return;
        }
        // Usually one namespace per batch; a short list, searched linearly.
        let mut groups: Vec<(Arc<str>, Vec<MeshMessage>)> = Vec::with_capacity(1);
        let total = ready.len();
        for m in ready {
            let msg = MeshMessage {
                topic: m.topic,
                data: m.data,
                timestamp: m.timestamp,
                history: m.history,
            };
            match groups.iter_mut().find(|(ns, _)| *ns == m.namespace) {
                Some((_, list)) => list.push(msg),
                None => {
                    let mut list = Vec::with_capacity(total);
                    list.push(msg);
                    groups.push((m.namespace, list));
                }
            }
        }
        for (ns, list) in groups {
            (self.deliver_fn)(ns.to_string(), list);
        }
    }
}

fn now_micros() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_micros() as u64)
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pubsub::Origin;
    use parking_lot::Mutex;

    type Received = Arc<Mutex<Vec<(String, String, Bytes, u64)>>>;

    struct TestNode {
        /// The node's mesh, started on a loopback address.
        mesh: Arc<Mesh>,
        /// The node's delivery service, through which the test publishes.
        pubsub: PubSubService,
        /// What the node's deliver_fn received from the mesh: (namespace, topic, data, timestamp).
        got: Received,
    }

    impl TestNode {
        /// Publishes as a local client would: through the node's delivery
        /// service, which forwards into the mesh.
        fn publish(&self, ns: &str, topic: &str, data: &str) {
            self.pubsub.deliver(
                ns,
                topic,
                &Bytes::copy_from_slice(data.as_bytes()),
                None,
                Origin::Local,
            );
        }

        fn payloads(&self) -> Vec<String> {
            self.got
                .lock()
                .iter()
                .map(|(_, _, d, _)| String::from_utf8_lossy(d).into_owned())
                .collect()
        }

        async fn status(&self) -> MeshStatus {
            self.mesh.status().await.expect("mesh running")
        }
    }

    fn test_config() -> MeshConfig {
        MeshConfig {
            registry_interval: Duration::from_millis(200),
            heartbeat: Duration::from_millis(200),
            resend_after: Duration::from_millis(100),
            tail_after: Duration::from_millis(300),
            heads_interval: Duration::from_millis(200),
            ..MeshConfig::default()
        }
    }

    async fn start_node(store: &Store) -> TestNode {
        start_node_with(store, test_config()).await
    }

    async fn start_node_with(store: &Store, config: MeshConfig) -> TestNode {
        let pubsub = PubSubService::default();
        let got: Received = Arc::default();
        let sink = got.clone();
        let deliver: DeliverFn = Arc::new(move |ns, messages| {
            assert!(!messages.is_empty(), "an empty delivery");
            let mut got = sink.lock();
            for m in messages {
                got.push((ns.clone(), m.topic.to_string(), m.data, m.timestamp));
            }
        });
        let mesh = Mesh::start_with(
            store.clone(),
            Keypair::generate_ed25519(),
            "/ip4/127.0.0.1/tcp/0".parse().unwrap(),
            pubsub.clone(),
            deliver,
            config,
        )
        .await
        .unwrap();
        TestNode { mesh, pubsub, got }
    }

    /// Polls `check` every 50 ms until it holds; panics with `what` after `limit`.
    async fn wait_for<F, Fut>(what: &str, limit: Duration, mut check: F)
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = bool>,
    {
        let deadline = Instant::now() + limit;
        while !check().await {
            assert!(Instant::now() < deadline, "timed out waiting for {what}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Waits until every node sees every other one subscribed to the mesh topic.
    async fn wait_meshed(nodes: &[&TestNode]) {
        for n in nodes {
            wait_for("the mesh to form", Duration::from_secs(20), || async {
                n.status().await.subscribed.len() == nodes.len() - 1
            })
            .await;
        }
    }

    fn sled(dir: &tempfile::TempDir) -> Store {
        Store::open_sled(dir.path()).unwrap()
    }

    /// Sequence numbers skipped, for every reason.
    fn gaps(m: &Metrics) -> u64 {
        ["sender_gone", "evicted", "overflow", "restarted"]
            .map(|r| m.mesh_gaps_skipped.with_label_values(&[r]).get())
            .iter()
            .sum()
    }

    /// Sequence numbers skipped for one reason.
    fn gaps_for(n: &TestNode, reason: &str) -> u64 {
        n.pubsub
            .metrics
            .mesh_gaps_skipped
            .with_label_values(&[reason])
            .get()
    }

    /// Three nodes sharing one registry: a message forwarded on A reaches
    /// B's and C's deliver_fn once each (namespace, topic, data and the
    /// origin's timestamp intact), and A's never.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn message_reaches_every_other_node_once() {
        let dir = tempfile::tempdir().unwrap();
        let store = sled(&dir);
        let (a, b, c) = trio(&store).await;
        a.mesh
            .forward("acme", "room", &Bytes::from_static(b"hello"), 1234, None);
        for n in [&b, &c] {
            wait_for("delivery", Duration::from_secs(10), || async {
                !n.got.lock().is_empty()
            })
            .await;
        }
        // Time for any duplicate (relayed copies, gossip) to show up.
        tokio::time::sleep(Duration::from_secs(1)).await;
        for n in [&b, &c] {
            let got = n.got.lock().clone();
            assert_eq!(
                got,
                vec![(
                    "acme".to_string(),
                    "room".to_string(),
                    Bytes::from_static(b"hello"),
                    1234
                )]
            );
            assert_eq!(n.pubsub.metrics.mesh_received.get(), 1);
        }
        assert!(a.got.lock().is_empty());
        assert_eq!(a.pubsub.metrics.mesh_sent.get(), 1);
        assert_eq!(a.pubsub.metrics.mesh_peers.get(), 2);
    }

    /// 1,000 sequential messages published on A arrive at B and C exactly
    /// once each, in publish order; a second topic interleaved keeps its own order.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn thousand_messages_arrive_once_in_order() {
        let dir = tempfile::tempdir().unwrap();
        let store = sled(&dir);
        let (a, b, c) = trio(&store).await;
        for i in 0..1000 {
            a.publish("acme", "ticks", &i.to_string());
        }
        for n in [&b, &c] {
            wait_for("1,000 deliveries", Duration::from_secs(30), || async {
                n.got.lock().len() >= 1000
            })
            .await;
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
        let expected: Vec<String> = (0..1000).map(|i| i.to_string()).collect();
        for n in [&b, &c] {
            assert_eq!(n.payloads(), expected);
            let m = &n.pubsub.metrics;
            assert_eq!(gaps(m), 0);
        }
        assert_eq!(a.pubsub.metrics.mesh_sent.get(), 1000);
        assert!(a.got.lock().is_empty());
    }

    /// Starts A, B and C (test timings) and waits until they are meshed.
    async fn trio(store: &Store) -> (TestNode, TestNode, TestNode) {
        let (a, b, c) = (
            start_node(store).await,
            start_node(store).await,
            start_node(store).await,
        );
        wait_meshed(&[&a, &b, &c]).await;
        (a, b, c)
    }

    /// A config whose receiver drops the batches holding any of `payloads`,
    /// as if GossipSub never delivered them to this node.
    fn dropping(payloads: &'static [&'static str], config: MeshConfig) -> MeshConfig {
        MeshConfig {
            drop_received: Some(DropHook(Arc::new(move |batch: &[&[u8]]| {
                batch
                    .iter()
                    .any(|d| payloads.iter().any(|p| p.as_bytes() == *d))
            }))),
            ..config
        }
    }

    /// Publishes `m0`..`m{n-1}` on A, one batch each.
    async fn publish_apart(a: &TestNode, range: std::ops::Range<usize>) {
        for i in range {
            a.publish("acme", "room", &format!("m{i}"));
            tokio::time::sleep(Duration::from_millis(40)).await;
        }
    }

    fn numbered(range: std::ops::Range<usize>) -> Vec<String> {
        range.map(|i| format!("m{i}")).collect()
    }

    /// Three nodes; C misses two of A's batches (one in the middle, and the
    /// last one, which no later batch reveals): C asks A for them and still
    /// delivers every message once, in order, with no gap skipped; B is
    /// untouched.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn missed_batch_is_resent_in_order() {
        let dir = tempfile::tempdir().unwrap();
        let store = sled(&dir);
        let (a, b) = (start_node(&store).await, start_node(&store).await);
        let c = start_node_with(&store, dropping(&["m3", "m9"], test_config())).await;
        wait_meshed(&[&a, &b, &c]).await;
        publish_apart(&a, 0..10).await;
        for n in [&b, &c] {
            wait_for("10 deliveries", Duration::from_secs(20), || async {
                n.got.lock().len() >= 10
            })
            .await;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
        for n in [&b, &c] {
            assert_eq!(n.payloads(), numbered(0..10));
            assert_eq!(gaps(&n.pubsub.metrics), 0);
        }
        let m = &c.pubsub.metrics;
        assert!(m.mesh_resent.get() >= 2, "{} resent", m.mesh_resent.get());
        assert!(m.mesh_resend_requests.get() >= 2);
        assert!(a.pubsub.metrics.mesh_resends_served.get() >= 2);
        assert_eq!(b.pubsub.metrics.mesh_resent.get(), 0);
    }

    /// C misses a batch of A's and does not ask in time; A leaves the mesh:
    /// C skips the gap (counted as `sender_gone`) and delivers what waited
    /// behind it, in order.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn gap_of_a_gone_sender_is_skipped_and_counted() {
        let dir = tempfile::tempdir().unwrap();
        let store = sled(&dir);
        let (a, b) = (start_node(&store).await, start_node(&store).await);
        let never = MeshConfig {
            resend_after: Duration::from_secs(3600),
            tail_after: Duration::from_secs(3600),
            ..test_config()
        };
        let c = start_node_with(&store, dropping(&["m3"], never)).await;
        wait_meshed(&[&a, &b, &c]).await;
        publish_apart(&a, 0..6).await;
        wait_for(
            "C to hold m4 and m5 back",
            Duration::from_secs(20),
            || async { c.status().await.pending == 2 },
        )
        .await;
        assert_eq!(c.payloads(), numbered(0..3));
        assert_eq!(gaps(&c.pubsub.metrics), 0, "nothing skipped while A lives");
        a.mesh.stop().await;
        wait_for("C to skip A's gap", Duration::from_secs(20), || async {
            c.got.lock().len() >= 5
        })
        .await;
        assert_eq!(c.payloads(), ["m0", "m1", "m2", "m4", "m5"]);
        assert_eq!(gaps_for(&c, "sender_gone"), 1);
        assert_eq!(gaps(&c.pubsub.metrics), 1);
        assert_eq!(b.payloads(), numbered(0..6));
        assert_eq!(gaps(&b.pubsub.metrics), 0);
    }

    /// A keeps only its last two messages: the batch B missed is gone from
    /// A's resend buffer by the time B asks, so B skips it (counted as
    /// `evicted`) and delivers the rest in order.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn gap_no_longer_held_is_skipped_as_evicted() {
        let dir = tempfile::tempdir().unwrap();
        let store = sled(&dir);
        let a = start_node_with(
            &store,
            MeshConfig {
                resend_messages: 2,
                ..test_config()
            },
        )
        .await;
        let slow = MeshConfig {
            resend_after: Duration::from_millis(1500),
            ..test_config()
        };
        let b = start_node_with(&store, dropping(&["m3"], slow)).await;
        wait_meshed(&[&a, &b]).await;
        publish_apart(&a, 0..10).await;
        wait_for("B to skip the gap", Duration::from_secs(20), || async {
            b.got.lock().len() >= 9
        })
        .await;
        tokio::time::sleep(Duration::from_millis(300)).await;
        let expected: Vec<String> = numbered(0..10).into_iter().filter(|m| m != "m3").collect();
        assert_eq!(b.payloads(), expected);
        assert_eq!(gaps_for(&b, "evicted"), 1);
        assert_eq!(gaps(&b.pubsub.metrics), 1);
    }

    /// Starts A and B meshed, with `send_queue` frames per connection.
    async fn pair(store: &Store, send_queue: usize) -> (TestNode, TestNode) {
        let config = MeshConfig {
            send_queue,
            ..test_config()
        };
        let (a, b) = (
            start_node_with(store, config.clone()).await,
            start_node_with(store, config).await,
        );
        wait_meshed(&[&a, &b]).await;
        (a, b)
    }

    /// Waits until B has `n` messages and checks they are `expected`, once
    /// each and in order, with nothing dropped or skipped on either side.
    async fn all_arrive_in_order(a: &TestNode, b: &TestNode, expected: Vec<String>) {
        let n = expected.len();
        let deadline = Instant::now() + Duration::from_secs(60);
        while b.got.lock().len() < n {
            let (ma, mb) = (&a.pubsub.metrics, &b.pubsub.metrics);
            assert!(
                Instant::now() < deadline,
                "{} of {n} arrived; A sent {} in {} batches, {} deferred, dropped {:?}; B received {}, skipped {}",
                b.got.lock().len(),
                ma.mesh_sent.get(),
                ma.mesh_batches.get(),
                ma.mesh_deferred.get(),
                ["queue_full", "backlog_full", "no_peers", "publish_failed"]
                    .map(|r| ma.mesh_dropped.with_label_values(&[r]).get()),
                mb.mesh_received.get(),
                gaps(mb),
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
        assert!(b.payloads() == expected, "lost, duplicated or out of order");
        let m = &a.pubsub.metrics;
        assert_eq!(m.mesh_sent.get(), n as u64);
        for reason in ["queue_full", "backlog_full", "publish_failed"] {
            assert_eq!(
                m.mesh_dropped.with_label_values(&[reason]).get(),
                0,
                "{reason}"
            );
        }
        assert_eq!(gaps(&b.pubsub.metrics), 0);
    }

    /// A burst of 60,000 small messages travels in batches (far fewer
    /// GossipSub messages than pub/sub messages) and arrives whole, in order.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn burst_travels_in_batches_whole_and_in_order() {
        let dir = tempfile::tempdir().unwrap();
        let store = sled(&dir);
        let (a, b) = pair(&store, 5_000).await;
        const N: usize = 60_000;
        for i in 0..N {
            a.mesh
                .forward("acme", "burst", &Bytes::from(i.to_string()), 0, None);
        }
        all_arrive_in_order(&a, &b, (0..N).map(|i| i.to_string()).collect()).await;
        let batches = a.pubsub.metrics.mesh_batches.get();
        assert!(
            batches * 10 <= N as u64,
            "{batches} batches for {N} messages"
        );
    }

    /// When every peer's send queue is full (here 4 frames, with 40 KiB
    /// messages that travel one per batch), publishes are refused; the
    /// messages wait and are retried rather than lost.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn full_send_queue_defers_instead_of_dropping() {
        let dir = tempfile::tempdir().unwrap();
        let store = sled(&dir);
        let (a, b) = pair(&store, 4).await;
        const N: usize = 1_000;
        let pad = "x".repeat(40 << 10);
        for i in 0..N {
            a.mesh
                .forward("acme", "big", &Bytes::from(format!("{i}:{pad}")), 0, None);
        }
        all_arrive_in_order(&a, &b, (0..N).map(|i| format!("{i}:{pad}")).collect()).await;
        assert!(
            a.pubsub.metrics.mesh_deferred.get() > 0,
            "the send queue never filled"
        );
    }

    /// A libp2p peer that is not in the registry but knows A's address dials
    /// A: A refuses it, it never joins, and nothing it publishes is delivered
    /// on A, B or C.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn unregistered_peer_cannot_join() {
        let dir = tempfile::tempdir().unwrap();
        let store = sled(&dir);
        let (a, b, c) = trio(&store).await;
        // The rogue keeps its own registry, in which it finds A (copied from
        // the cluster's), so it dials A at A's real address.
        let rogue_dir = tempfile::tempdir().unwrap();
        let rogue_store = sled(&rogue_dir);
        let key = registry_key(&a.mesh.peer_id());
        let a_reg = store
            .get(key.as_bytes())
            .await
            .unwrap()
            .expect("A registered");
        rogue_store
            .put_ttl(key.as_bytes(), &a_reg, REGISTRY_TTL)
            .await
            .unwrap();
        // Members may have been refused while the registry was forming.
        let refused_before = a.pubsub.metrics.mesh_connections_refused.get();
        let rogue = start_node(&rogue_store).await;
        wait_for("A to refuse the rogue", Duration::from_secs(10), || async {
            a.pubsub.metrics.mesh_connections_refused.get() >= refused_before + 2
        })
        .await;
        for i in 0..20 {
            rogue.publish("acme", "room", &format!("forged {i}"));
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
        let rogue_id = rogue.mesh.peer_id();
        for n in [&a, &b, &c] {
            assert!(n.got.lock().is_empty(), "a rogue message was delivered");
            let st = n.status().await;
            assert!(!st.connected.contains(&rogue_id));
            assert_eq!(st.connected.len(), 2);
        }
        assert!(rogue.status().await.connected.is_empty());
        assert_eq!(rogue.pubsub.metrics.mesh_sent.get(), 0);
        // The cluster itself still works.
        b.publish("acme", "room", "still here");
        wait_for("delivery on A", Duration::from_secs(10), || async {
            a.payloads() == ["still here"]
        })
        .await;
    }

    /// A connected peer whose registration disappears is disconnected at the
    /// next registry refresh, and dialled again once it is back.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn peer_leaving_the_registry_is_disconnected() {
        let dir = tempfile::tempdir().unwrap();
        let store = sled(&dir);
        let a = start_node(&store).await;
        // D keeps its own registry (where it finds A); the test copies D's
        // record into the cluster's registry by hand, so it can take it away.
        let d_dir = tempfile::tempdir().unwrap();
        let d_store = sled(&d_dir);
        let a_key = registry_key(&a.mesh.peer_id());
        let a_reg = wait_registered(&store, &a_key).await;
        d_store
            .put_ttl(a_key.as_bytes(), &a_reg, REGISTRY_TTL)
            .await
            .unwrap();
        let d = start_node(&d_store).await;
        let d_key = registry_key(&d.mesh.peer_id());
        let d_reg = wait_registered(&d_store, &d_key).await;
        store
            .put_ttl(d_key.as_bytes(), &d_reg, REGISTRY_TTL)
            .await
            .unwrap();
        wait_for("A to dial D", Duration::from_secs(10), || async {
            a.status().await.connected.contains(&d.mesh.peer_id())
        })
        .await;
        store.delete(d_key.as_bytes()).await.unwrap();
        wait_for("A to drop D", Duration::from_secs(10), || async {
            a.status().await.connected.is_empty()
        })
        .await;
        store
            .put_ttl(d_key.as_bytes(), &d_reg, REGISTRY_TTL)
            .await
            .unwrap();
        wait_for("A to dial D again", Duration::from_secs(10), || async {
            a.status().await.connected.contains(&d.mesh.peer_id())
        })
        .await;
    }

    async fn wait_registered(store: &Store, key: &str) -> Vec<u8> {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Some(v) = store.get(key.as_bytes()).await.unwrap() {
                return v;
            }
            assert!(Instant::now() < deadline, "never registered");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// A stopped node removes its registration and its peers lose it.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn stop_deregisters() {
        let dir = tempfile::tempdir().unwrap();
        let store = sled(&dir);
        let (a, b) = (start_node(&store).await, start_node(&store).await);
        wait_meshed(&[&a, &b]).await;
        b.mesh.stop().await;
        let key = registry_key(&b.mesh.peer_id());
        assert!(store.get(key.as_bytes()).await.unwrap().is_none());
        wait_for("A to lose B", Duration::from_secs(10), || async {
            a.status().await.connected.is_empty()
        })
        .await;
        assert!(b.mesh.status().await.is_none());
    }

    /// Registry entries that do not parse, or name another peer than their
    /// key, are skipped; this node is left out.
    #[test]
    fn registry_parsing_skips_bad_entries() {
        let me = Keypair::generate_ed25519().public().to_peer_id();
        let other = Keypair::generate_ed25519().public().to_peer_id();
        let third = Keypair::generate_ed25519().public().to_peer_id();
        let entry = |key: &PeerId, named: &PeerId, addrs: &[&str]| {
            (
                registry_key(key).into_bytes(),
                serde_json::to_vec(&Registration {
                    peer_id: named.to_string(),
                    addrs: addrs.iter().map(|a| a.to_string()).collect(),
                })
                .unwrap(),
            )
        };
        let entries = vec![
            entry(&me, &me, &["/ip4/127.0.0.1/tcp/1"]),
            entry(&other, &other, &["/ip4/127.0.0.1/tcp/2", "not an addr"]),
            entry(&third, &other, &["/ip4/127.0.0.1/tcp/3"]),
            (format!("{REGISTRY_PREFIX}junk").into_bytes(), b"{".to_vec()),
        ];
        let peers = parse_registry(&entries, &me);
        assert_eq!(peers.len(), 1);
        assert_eq!(
            peers[&other],
            vec!["/ip4/127.0.0.1/tcp/2".parse::<Multiaddr>().unwrap()]
        );
    }

    /// The wire encoding round-trips and is read in place (the payload a
    /// slice of the received bytes); it is byte for byte what earlier
    /// versions wrote with owned fields and sequences of u8; arbitrary bytes
    /// never panic the decoder.
    #[test]
    fn wire_batch_round_trips() {
        let origin = Keypair::generate_ed25519().public().to_peer_id().to_bytes();
        let data = [0u8, 1, 2, 255];
        let entry = |seq| WireEntry {
            namespace: "acme",
            topic: "room/1",
            epoch: 1_700_000_000_000_000,
            seq,
            timestamp: 1_700_000_000_000,
            data: &data,
            history: Some((seq, "e1")),
        };
        let m = WireBatch {
            origin: &origin,
            attempt: 3,
            entries: vec![entry(41), entry(42)],
        };
        let bytes = postcard::to_allocvec(&m).unwrap();
        let back = postcard::from_bytes::<WireBatch>(&bytes).unwrap();
        assert_eq!(back, m);
        assert!(
            bytes
                .as_ptr_range()
                .contains(&back.entries[1].data.as_ptr()),
            "read in place"
        );
        // The owned encoding of earlier versions: the same bytes.
        #[derive(Serialize)]
        struct LegacyBatch {
            origin: Vec<u8>,
            attempt: u64,
            entries: Vec<LegacyEntry>,
        }
        #[derive(Serialize)]
        struct LegacyEntry {
            namespace: String,
            topic: String,
            epoch: u64,
            seq: u64,
            timestamp: u64,
            data: Vec<u8>,
            history: Option<(u64, String)>,
        }
        let legacy = LegacyBatch {
            origin: origin.clone(),
            attempt: 3,
            entries: [41, 42]
                .map(|seq| LegacyEntry {
                    namespace: "acme".into(),
                    topic: "room/1".into(),
                    epoch: 1_700_000_000_000_000,
                    seq,
                    timestamp: 1_700_000_000_000,
                    data: data.to_vec(),
                    history: Some((seq, "e1".into())),
                })
                .into(),
        };
        assert_eq!(postcard::to_allocvec(&legacy).unwrap(), bytes);
        proptest::proptest!(|(junk: Vec<u8>)| {
            let _ = postcard::from_bytes::<WireBatch>(&junk);
        });
    }

    /// A received batch splits into runs of one stream each, in order; a
    /// run shares its namespace and topic, and every payload is its own copy
    /// (nothing delivered keeps the batch alive).
    #[test]
    fn a_batch_splits_into_runs_of_one_stream() {
        let origin = Keypair::generate_ed25519().public().to_peer_id();
        let payload = b"abcdefgh".to_vec();
        let entry = |topic, seq: u64| WireEntry {
            namespace: "acme",
            topic,
            epoch: 7,
            seq,
            timestamp: 1,
            data: &payload[seq as usize..seq as usize + 1],
            history: None,
        };
        let got = runs(
            origin,
            vec![entry("a", 1), entry("a", 2), entry("b", 1), entry("a", 3)],
        );
        let shape: Vec<(&str, Vec<u64>)> = got
            .iter()
            .map(|((_, _, t), items)| (t.as_str(), items.iter().map(|i| i.1).collect()))
            .collect();
        assert_eq!(
            shape,
            vec![("a", vec![1, 2]), ("b", vec![1]), ("a", vec![3])]
        );
        let first = &got[0].1;
        assert!(Arc::ptr_eq(&first[0].2.topic, &first[1].2.topic));
        assert_eq!(&*first[1].2.data, b"c");
        assert_eq!(first[1].3, 1 + ENTRY_OVERHEAD);
        for (_, items) in &got {
            for (_, _, m, _) in items {
                assert!(!payload.as_ptr_range().contains(&m.data.as_ptr()), "a copy");
            }
        }
    }

    /// Message ids: one per publish (author and GossipSub's sequence number),
    /// the same for every copy of that publish, different for the same bytes
    /// published again (a retried batch) or by another author; a message
    /// without author or number falls back to the hash of its data.
    #[test]
    fn message_ids_name_a_publish_not_its_bytes() {
        let a = Keypair::generate_ed25519().public().to_peer_id();
        let b = Keypair::generate_ed25519().public().to_peer_id();
        let msg = |source: Option<PeerId>, seq: Option<u64>, data: &[u8]| gossipsub::Message {
            source,
            data: data.to_vec(),
            sequence_number: seq,
            topic: IdentTopic::new(MESH_TOPIC).hash(),
        };
        let first = message_id(&msg(Some(a), Some(7), b"batch"));
        assert_eq!(first, message_id(&msg(Some(a), Some(7), b"batch")));
        assert_ne!(first, message_id(&msg(Some(a), Some(8), b"batch")));
        assert_ne!(first, message_id(&msg(Some(b), Some(7), b"batch")));
        let mut expected = a.to_bytes();
        expected.extend_from_slice(&7u64.to_be_bytes());
        assert_eq!(first, gossipsub::MessageId::new(&expected));
        let anonymous = message_id(&msg(None, None, b"batch"));
        assert_eq!(anonymous, message_id(&msg(None, None, b"batch")));
        assert_ne!(anonymous, message_id(&msg(None, None, b"other")));
        assert_ne!(anonymous, first);
    }
}
