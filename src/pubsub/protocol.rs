//! The wire protocol of the two sockets (docs/pubsub.md): topic rules, close
//! codes, the frames the server sends (encoded once into shared bytes) and the
//! frames a `/v1/ws` client sends.

use base64::Engine as _;
use bytes::{BufMut, Bytes, BytesMut};
use serde::Serialize;
use serde_json::Value;

/// Longest topic name, in bytes.
pub const MAX_TOPIC_BYTES: usize = 256;
/// Topics under this prefix are reserved for the node (403 for clients).
pub const RESERVED_PREFIX: &str = "_mg/";
/// Most messages one `publish-batch` takes.
pub const MAX_BATCH: usize = 100;
/// Longest presence member id, in bytes.
pub const MAX_MEMBER_ID: usize = 128;
/// Longest presence metadata, in bytes.
pub const MAX_MEMBER_META: usize = 1024;

/// Close codes the server sends (documented in docs/pubsub.md).
pub mod close {
    /// The client closed, or the server ended the socket normally.
    pub const NORMAL: u16 = 1000;
    /// The node is draining (SIGTERM).
    pub const GOING_AWAY: u16 = 1001;
    /// The client broke the WebSocket framing rules.
    pub const PROTOCOL_ERROR: u16 = 1002;
    /// A client frame was larger than `pubsub.max_frame_bytes`.
    pub const TOO_BIG: u16 = 1009;
    /// The namespace was deleted or its supervisor is gone.
    pub const NAMESPACE_GONE: u16 = 4004;
    /// No frame from the client within `pubsub.read_timeout_seconds`.
    pub const READ_TIMEOUT: u16 = 4000;
    /// The socket's token expired or its session was ended: reconnect with
    /// a fresh token.
    pub const CREDENTIAL_ENDED: u16 = 4001;
    /// The outbound queue overflowed: a slow consumer.
    pub const SLOW_CONSUMER: u16 = 4008;
    /// What the socket holds of a history topic cannot be continued on this
    /// node (the topic's epoch changed, or publications between what it got
    /// and what the store keeps are gone): reconnect and recover.
    pub const INSUFFICIENT_STATE: u16 = 4011;
    /// The operator drained this node (`POST /v1/cluster/nodes/{id}/drain`):
    /// its namespaces moved to other nodes; reconnect (through another
    /// node) and recover.
    pub const NODE_DRAINED: u16 = 4012;

    /// The reason sent with a close `code` the supervisor asks for.
    pub fn reason(code: u16) -> &'static str {
        match code {
            NAMESPACE_GONE => "namespace deleted",
            SLOW_CONSUMER => "slow consumer",
            INSUFFICIENT_STATE => "insufficient state: reconnect and recover",
            GOING_AWAY => "node draining",
            NODE_DRAINED => "node drained: reconnect and recover",
            _ => "closed by the server",
        }
    }
}

/// Why a topic name is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TopicError {
    /// Empty, too long, or with whitespace or control characters: 400 `BAD_TOPIC`.
    #[error("a topic is 1 to {MAX_TOPIC_BYTES} bytes without spaces or control characters")]
    Invalid,
    /// Under [`RESERVED_PREFIX`], which only the node publishes to: 403 `RESERVED_TOPIC`.
    #[error("topics under _mg/ are reserved")]
    Reserved,
}

/// Checks a topic a client names.
pub fn check_topic(topic: &str) -> Result<(), TopicError> {
    if topic.is_empty()
        || topic.len() > MAX_TOPIC_BYTES
        || topic.chars().any(|c| c.is_control() || c.is_whitespace())
    {
        return Err(TopicError::Invalid);
    }
    if topic.starts_with(RESERVED_PREFIX) {
        return Err(TopicError::Reserved);
    }
    Ok(())
}

/// A payload larger than `pubsub.max_frame_bytes`: 413 `PAYLOAD_TOO_LARGE`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("the message is larger than pubsub.max_frame_bytes")]
pub struct PayloadTooLarge;

/// Checks the payload of a client's publish against `max_frame_bytes`
/// (`pubsub.max_frame_bytes`): the one size check of both publish paths,
/// `POST /v1/pubsub/publish[-batch]` and the `publish` frame of `/v1/ws`.
/// Called after [`check_topic`] and the caller's grant.
pub fn check_payload(data: &[u8], max_frame_bytes: usize) -> Result<(), PayloadTooLarge> {
    if data.len() > max_frame_bytes {
        return Err(PayloadTooLarge);
    }
    Ok(())
}

/// A payload field that is not standard base64: 400 `BAD_BASE64`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("not standard base64")]
pub struct NotBase64;

/// A payload as clients send it (`data_base64`, `input_base64`), decoded:
/// standard base64, the one decoding of both publish paths.
pub fn decode_base64(text: &str) -> Result<Bytes, NotBase64> {
    base64::engine::general_purpose::STANDARD
        .decode(text)
        .map(Bytes::from)
        .map_err(|_| NotBase64)
}

/// How a subscriber wants its messages framed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FrameKind {
    /// The simple socket: text `{"topic","data_base64","timestamp"}`.
    Simple,
    /// The full socket: text `{"type":"message","topic","data_base64","timestamp"}`.
    Full,
    /// The simple socket with `format=binary`: one binary frame, the raw payload.
    Binary,
}

impl FrameKind {
    /// Every kind, in [`FrameKind::index`] order.
    pub const ALL: [FrameKind; 3] = [FrameKind::Simple, FrameKind::Full, FrameKind::Binary];
    /// 0, 1 or 2: the slot of this kind in per-kind arrays (frames, counts).
    pub fn index(self) -> usize {
        self as usize
    }
}

/// Milliseconds since the Unix epoch.
pub fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or_default()
}

/// WebSocket opcodes of the frames the server writes.
#[derive(Clone, Copy)]
pub enum Opcode {
    /// A UTF-8 text frame (JSON messages, acks, errors).
    Text = 0x1,
    /// A binary frame (`format=binary` messages).
    Binary = 0x2,
    /// A close frame: code and reason.
    Close = 0x8,
    /// A ping; the client answers with a pong.
    Ping = 0x9,
    /// The answer to a client's ping.
    Pong = 0xA,
}

/// Encodes one complete, unmasked server frame (RFC 6455 §5.2): header and
/// payload in one buffer, so every subscriber can be handed the same bytes.
pub fn ws_frame(op: Opcode, payload: &[u8]) -> Bytes {
    let len = payload.len();
    let mut b = BytesMut::with_capacity(len + 10);
    b.put_u8(0x80 | op as u8);
    if len < 126 {
        b.put_u8(len as u8);
    } else if len <= u16::MAX as usize {
        b.put_u8(126);
        b.put_u16(len as u16);
    } else {
        b.put_u8(127);
        b.put_u64(len as u64);
    }
    b.extend_from_slice(payload);
    b.freeze()
}

/// A close frame with a code and a short reason.
pub fn close_frame(code: u16, reason: &str) -> Bytes {
    let mut p = Vec::with_capacity(2 + reason.len());
    p.extend_from_slice(&code.to_be_bytes());
    p.extend_from_slice(&reason.as_bytes()[..reason.len().min(120)]);
    ws_frame(Opcode::Close, &p)
}

/// A text frame holding `v` as JSON.
pub fn json_frame(v: &impl Serialize) -> Bytes {
    ws_frame(Opcode::Text, &serde_json::to_vec(v).unwrap_or_default())
}

/// The message frame of `kind`, encoded once per publish and shared by every
/// subscriber of that kind. `offset`: the publication's place in the topic's
/// history (topics with a history rule only): a JSON field, or, on a binary
/// frame, 8 bytes big-endian before the payload.
pub fn message_frame(
    kind: FrameKind,
    topic: &str,
    data: &[u8],
    timestamp: u64,
    offset: Option<u64>,
) -> Bytes {
    #[derive(Serialize)]
    struct Out<'a> {
        /// `"message"` on the full socket; absent on the simple one.
        #[serde(rename = "type", skip_serializing_if = "Option::is_none")]
        kind: Option<&'static str>,
        /// The topic published to.
        topic: &'a str,
        /// The payload, standard base64.
        data_base64: String,
        /// Unix milliseconds given by the publishing node.
        timestamp: u64,
        /// The publication's offset in the topic's history (history topics only).
        #[serde(skip_serializing_if = "Option::is_none")]
        offset: Option<u64>,
    }
    match kind {
        FrameKind::Binary => match offset {
            None => ws_frame(Opcode::Binary, data),
            Some(o) => {
                let mut b = Vec::with_capacity(8 + data.len());
                b.extend_from_slice(&o.to_be_bytes());
                b.extend_from_slice(data);
                ws_frame(Opcode::Binary, &b)
            }
        },
        FrameKind::Simple | FrameKind::Full => json_frame(&Out {
            kind: (kind == FrameKind::Full).then_some("message"),
            topic,
            data_base64: base64::engine::general_purpose::STANDARD.encode(data),
            timestamp,
            offset,
        }),
    }
}

/// An ack of a `/v1/ws` client frame: `{"id","ok":true, ...extra}`.
pub fn ack(id: &Value, extra: Option<(&str, Value)>) -> Bytes {
    let mut m = serde_json::Map::new();
    m.insert("id".into(), id.clone());
    m.insert("ok".into(), Value::Bool(true));
    if let Some((k, v)) = extra {
        m.insert(k.into(), v);
    }
    json_frame(&Value::Object(m))
}

/// An ack with several extra fields: `{"id","ok":true, ...fields}`.
pub fn ack_fields(id: &Value, fields: serde_json::Map<String, Value>) -> Bytes {
    let mut m = serde_json::Map::new();
    m.insert("id".into(), id.clone());
    m.insert("ok".into(), Value::Bool(true));
    m.extend(fields);
    json_frame(&Value::Object(m))
}

/// An error answer: `{"id","ok":false,"error":{"code","message"}}`.
pub fn error_frame(id: &Value, e: &FrameError) -> Bytes {
    json_frame(&serde_json::json!({
        "id": id,
        "ok": false,
        "error": {"code": e.code, "message": e.message},
    }))
}

/// An error answered on a socket; the socket stays open.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FrameError {
    /// Machine-readable, the same codes as the HTTP API (`BAD_FRAME`, `BAD_TOPIC`, ...).
    pub code: &'static str,
    /// For people; sent as `error.message`.
    pub message: String,
}

impl FrameError {
    /// An error with `code` and `message`.
    pub fn new(code: &'static str, message: impl Into<String>) -> Self {
        Self {
            code,
            message: message.into(),
        }
    }
}

impl From<crate::error::ApiError> for FrameError {
    fn from(e: crate::error::ApiError) -> Self {
        FrameError::new(e.code.as_str(), e.message)
    }
}

/// A client frame of `/v1/ws`, parsed.
#[derive(Debug, PartialEq)]
pub enum ClientFrame {
    /// `{"type":"subscribe","topic",...}`: adds a topic to the socket.
    Subscribe {
        /// The topic, not yet checked.
        topic: String,
        /// With `"presence":true`: the `member_id` and `member_meta` (JSON
        /// other than a string is kept as its text).
        presence: Option<(String, Option<String>)>,
        /// `"recover":{"offset","epoch"}`: the last position the client saw.
        recover: Option<(u64, String)>,
    },
    /// `{"type":"unsubscribe","topic"}`.
    Unsubscribe {
        /// The topic to leave.
        topic: String,
    },
    /// `{"type":"publish","topic","data_base64"}`.
    Publish {
        /// The topic, not yet checked.
        topic: String,
        /// The decoded payload; empty when `data_base64` is absent.
        data: Bytes,
    },
    /// `{"type":"invoke","function","input_base64"}`: calls a function of the namespace.
    Invoke {
        /// The function's name.
        function: String,
        /// The decoded input; empty when `input_base64` is absent.
        input: Bytes,
    },
    /// `{"type":"ping"}`: answered with an ack.
    Ping,
}

fn str_field(v: &Value, k: &str) -> Result<String, FrameError> {
    v.get(k)
        .and_then(Value::as_str)
        .map(str::to_string)
        .ok_or_else(|| FrameError::new("BAD_FRAME", format!("`{k}` must be a string")))
}

fn b64_field(v: &Value, k: &str) -> Result<Bytes, FrameError> {
    match v.get(k) {
        None | Some(Value::Null) => Ok(Bytes::new()),
        Some(Value::String(s)) => decode_base64(s)
            .map_err(|_| FrameError::new("BAD_BASE64", format!("`{k}` is not base64"))),
        Some(_) => Err(FrameError::new(
            "BAD_FRAME",
            format!("`{k}` must be a string"),
        )),
    }
}

/// `{"offset": <u64>, "epoch": "<string>"}`: anything else is `BAD_OFFSET`.
fn recover_field(r: &Value) -> Result<(u64, String), FrameError> {
    let bad = || {
        FrameError::new(
            "BAD_OFFSET",
            "recover is {\"offset\": a whole number >= 0, \"epoch\": a string}",
        )
    };
    let offset = r.get("offset").and_then(Value::as_u64).ok_or_else(bad)?;
    let epoch = r.get("epoch").and_then(Value::as_str).ok_or_else(bad)?;
    Ok((offset, epoch.to_string()))
}

/// Parses a `/v1/ws` client frame. Always yields the frame's `id` (null when
/// it has none or is not JSON), so even a refusal is answered in order.
pub fn parse_client_frame(text: &[u8]) -> (Value, Result<ClientFrame, FrameError>) {
    let v: Value = match serde_json::from_slice(text) {
        Ok(v @ Value::Object(_)) => v,
        Ok(_) => {
            return (
                Value::Null,
                Err(FrameError::new("BAD_FRAME", "a frame is a JSON object")),
            );
        }
        Err(e) => {
            return (
                Value::Null,
                Err(FrameError::new("MALFORMED_JSON", e.to_string())),
            );
        }
    };
    let id = v.get("id").cloned().unwrap_or(Value::Null);
    let frame = (|| {
        let ty = v.get("type").and_then(Value::as_str).unwrap_or_default();
        Ok(match ty {
            "subscribe" => {
                let presence = if v.get("presence").and_then(Value::as_bool) == Some(true) {
                    let member = str_field(&v, "member_id")?;
                    let meta = v.get("member_meta").map(|m| match m {
                        Value::String(s) => s.clone(),
                        other => other.to_string(),
                    });
                    Some((member, meta))
                } else {
                    None
                };
                let recover = match v.get("recover") {
                    None | Some(Value::Null) => None,
                    Some(r) => Some(recover_field(r)?),
                };
                ClientFrame::Subscribe {
                    topic: str_field(&v, "topic")?,
                    presence,
                    recover,
                }
            }
            "unsubscribe" => ClientFrame::Unsubscribe {
                topic: str_field(&v, "topic")?,
            },
            "publish" => ClientFrame::Publish {
                topic: str_field(&v, "topic")?,
                data: b64_field(&v, "data_base64")?,
            },
            "invoke" => ClientFrame::Invoke {
                function: str_field(&v, "function")?,
                input: b64_field(&v, "input_base64")?,
            },
            "ping" => ClientFrame::Ping,
            "" => return Err(FrameError::new("BAD_FRAME", "a frame needs a `type`")),
            other => {
                return Err(FrameError::new(
                    "UNKNOWN_TYPE",
                    format!(
                        "unknown frame type {:?}",
                        other.chars().take(64).collect::<String>()
                    ),
                ));
            }
        })
    })();
    (id, frame)
}

/// Checks presence options.
pub fn check_member(member_id: &str, meta: Option<&str>) -> Result<(), FrameError> {
    if member_id.is_empty() || member_id.len() > MAX_MEMBER_ID {
        return Err(FrameError::new(
            "BAD_MEMBER",
            format!("member_id is 1 to {MAX_MEMBER_ID} bytes"),
        ));
    }
    if meta.is_some_and(|m| m.len() > MAX_MEMBER_META) {
        return Err(FrameError::new(
            "BAD_MEMBER",
            format!("member_meta is at most {MAX_MEMBER_META} bytes"),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Frame headers use the 7-, 16- and 64-bit length forms at their edges.
    #[test]
    fn frame_lengths() {
        assert_eq!(&ws_frame(Opcode::Text, &[0; 125])[..2], &[0x81, 125]);
        assert_eq!(
            &ws_frame(Opcode::Binary, &[0; 126])[..4],
            &[0x82, 126, 0, 126]
        );
        let big = ws_frame(Opcode::Binary, &[0; 70_000]);
        assert_eq!(&big[..2], &[0x82, 127]);
        assert_eq!(big.len(), 70_010);
        assert_eq!(
            &close_frame(4008, "slow consumer")[..4],
            &[0x88, 15, 0x0f, 0xa8]
        );
    }

    /// Topic rules: reserved prefix, length, whitespace.
    #[test]
    fn topics() {
        assert_eq!(check_topic("chat.room1"), Ok(()));
        assert_eq!(check_topic("_mg/presence"), Err(TopicError::Reserved));
        assert_eq!(check_topic(""), Err(TopicError::Invalid));
        assert_eq!(check_topic("a b"), Err(TopicError::Invalid));
        assert_eq!(check_topic(&"x".repeat(257)), Err(TopicError::Invalid));
    }

    /// A payload of exactly `max_frame_bytes` passes; one byte more is refused.
    #[test]
    fn payload_bound() {
        assert_eq!(check_payload(&[0; 16], 16), Ok(()));
        assert_eq!(check_payload(&[], 16), Ok(()));
        assert_eq!(check_payload(&[0; 17], 16), Err(PayloadTooLarge));
    }

    /// Standard base64 decodes (the empty text to no bytes); anything else is refused.
    #[test]
    fn base64_payloads() {
        assert_eq!(decode_base64("aGk="), Ok(Bytes::from_static(b"hi")));
        assert_eq!(decode_base64(""), Ok(Bytes::new()));
        assert_eq!(decode_base64("!!"), Err(NotBase64));
        // URL-safe base64 is not the standard alphabet.
        assert_eq!(decode_base64("-_8="), Err(NotBase64));
    }

    /// Each frame type parses; errors keep the id.
    #[test]
    fn client_frames() {
        let (id, f) =
            parse_client_frame(br#"{"id":7,"type":"publish","topic":"t","data_base64":"aGk="}"#);
        assert_eq!(id, serde_json::json!(7));
        assert_eq!(
            f.unwrap(),
            ClientFrame::Publish {
                topic: "t".into(),
                data: Bytes::from_static(b"hi")
            }
        );
        let (id, f) = parse_client_frame(br#"{"id":"a","type":"dance"}"#);
        assert_eq!(id, serde_json::json!("a"));
        assert_eq!(f.unwrap_err().code, "UNKNOWN_TYPE");
        let (id, f) = parse_client_frame(b"{not json");
        assert_eq!(id, Value::Null);
        assert_eq!(f.unwrap_err().code, "MALFORMED_JSON");
        let (_, f) =
            parse_client_frame(br#"{"id":1,"type":"publish","topic":"t","data_base64":"!!"}"#);
        assert_eq!(f.unwrap_err().code, "BAD_BASE64");
    }

    /// The message frame is a valid text frame holding the documented JSON.
    #[test]
    fn message_frames() {
        let f = message_frame(FrameKind::Full, "t", b"hi", 5, None);
        let v: Value = serde_json::from_slice(&f[2..]).unwrap();
        assert_eq!(
            v,
            serde_json::json!({"type":"message","topic":"t","data_base64":"aGk=","timestamp":5})
        );
        let f = message_frame(FrameKind::Simple, "t", b"hi", 5, None);
        let v: Value = serde_json::from_slice(&f[2..]).unwrap();
        assert!(v.get("type").is_none());
        assert_eq!(
            &message_frame(FrameKind::Binary, "t", b"hi", 5, None)[..],
            &[0x82, 2, b'h', b'i']
        );
    }

    proptest! {
        // Parsers of untrusted bytes: thousands of generated inputs each.
        #![proptest_config(ProptestConfig::with_cases(3000))]
        /// The client frame parser never panics, whatever the bytes.
        #[test]
        fn parser_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
            let _ = parse_client_frame(&bytes);
        }

        /// Nor on JSON-shaped input with arbitrary fields.
        #[test]
        fn parser_json_shapes(ty in "[a-z]{0,12}", topic in ".{0,40}", d in ".{0,40}") {
            let s = serde_json::json!({"id": 1, "type": ty, "topic": topic, "data_base64": d}).to_string();
            let _ = parse_client_frame(s.as_bytes());
        }
    }

    // -----------------------------------------------------------------
    // The client frame decoder against generated frames: what a client may
    // send parses back to the frame it meant, with its id; anything else is
    // refused with one of the codes docs/pubsub.md lists, in a message of
    // bounded size (the input is never echoed whole); and the server's own
    // frames read back under RFC 6455's framing.

    /// The refusal codes of a client frame (docs/pubsub.md, "/v1/ws").
    const FRAME_CODES: &[&str] = &[
        "MALFORMED_JSON",
        "BAD_FRAME",
        "UNKNOWN_TYPE",
        "BAD_BASE64",
        "BAD_OFFSET",
    ];

    /// A generated frame a client may send, with its JSON.
    fn client_frame() -> impl Strategy<Value = (ClientFrame, Value)> {
        use base64::engine::general_purpose::STANDARD;
        let text = || ".{0,24}";
        let data = || proptest::collection::vec(any::<u8>(), 0..48);
        prop_oneof![
            (
                text(),
                proptest::option::of((text(), proptest::option::of(text()))),
                proptest::option::of((any::<u64>(), text())),
            )
                .prop_map(|(topic, presence, recover)| {
                    let mut v = serde_json::json!({"type": "subscribe", "topic": topic});
                    if let Some((m, meta)) = &presence {
                        v["presence"] = true.into();
                        v["member_id"] = m.clone().into();
                        if let Some(meta) = meta {
                            v["member_meta"] = meta.clone().into();
                        }
                    }
                    if let Some((o, e)) = &recover {
                        v["recover"] = serde_json::json!({"offset": o, "epoch": e});
                    }
                    (ClientFrame::Subscribe { topic, presence, recover }, v)
                }),
            text().prop_map(|topic| (
                ClientFrame::Unsubscribe { topic: topic.clone() },
                serde_json::json!({"type": "unsubscribe", "topic": topic}),
            )),
            (text(), data()).prop_map(|(topic, d)| (
                ClientFrame::Publish { topic: topic.clone(), data: Bytes::from(d.clone()) },
                serde_json::json!({"type": "publish", "topic": topic, "data_base64": STANDARD.encode(&d)}),
            )),
            (text(), data()).prop_map(|(function, d)| (
                ClientFrame::Invoke { function: function.clone(), input: Bytes::from(d.clone()) },
                serde_json::json!({"type": "invoke", "function": function, "input_base64": STANDARD.encode(&d)}),
            )),
            Just(()).prop_map(|()| (ClientFrame::Ping, serde_json::json!({"type": "ping"}))),
        ]
    }

    /// Any JSON value, a few levels deep.
    fn any_json() -> impl Strategy<Value = Value> {
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::from),
            any::<i64>().prop_map(Value::from),
            any::<f64>()
                .prop_map(|f| serde_json::Number::from_f64(f).map_or(Value::Null, Value::Number)),
            ".{0,16}".prop_map(Value::from),
            prop_oneof![
                Just("subscribe"),
                Just("publish"),
                Just("invoke"),
                Just("unsubscribe"),
                Just("ping"),
                Just("aGk="),
                Just("!!")
            ]
            .prop_map(Value::from),
        ];
        leaf.prop_recursive(3, 24, 4, |inner| {
            prop_oneof![
                proptest::collection::vec(inner.clone(), 0..4).prop_map(Value::from),
                proptest::collection::btree_map(
                    prop_oneof![
                        Just("type".to_string()),
                        Just("topic".to_string()),
                        Just("id".to_string()),
                        Just("data_base64".to_string()),
                        Just("input_base64".to_string()),
                        Just("function".to_string()),
                        Just("presence".to_string()),
                        Just("member_id".to_string()),
                        Just("member_meta".to_string()),
                        Just("recover".to_string()),
                        Just("offset".to_string()),
                        Just("epoch".to_string()),
                        ".{0,6}",
                    ],
                    inner,
                    0..6,
                )
                .prop_map(|m| Value::Object(m.into_iter().collect())),
            ]
        })
    }

    /// An RFC 6455 reading of one unmasked server frame: FIN, opcode, payload.
    fn read_ws_frame(b: &[u8]) -> Option<(bool, u8, &[u8])> {
        let (&b0, rest) = b.split_first()?;
        let (&b1, rest) = rest.split_first()?;
        if b1 & 0x80 != 0 {
            return None; // a server never masks
        }
        let (len, rest) = match b1 & 0x7f {
            126 => {
                let (l, r) = rest.split_at_checked(2)?;
                let n = u16::from_be_bytes([l[0], l[1]]) as usize;
                if n < 126 {
                    return None; // not the shortest form
                }
                (n, r)
            }
            127 => {
                let (l, r) = rest.split_at_checked(8)?;
                let n = u64::from_be_bytes(l.try_into().ok()?);
                if n <= u16::MAX as u64 || n >> 63 != 0 {
                    return None;
                }
                (usize::try_from(n).ok()?, r)
            }
            n => (n as usize, rest),
        };
        (rest.len() == len).then_some((b0 & 0x80 != 0, b0 & 0x0f, rest))
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(3000))]

        /// What a client may send parses back to the frame it meant, id echoed.
        #[test]
        fn client_frames_parse_back(
            (frame, mut v) in client_frame(),
            id in prop_oneof![Just(Value::Null), any::<u32>().prop_map(Value::from), ".{0,8}".prop_map(Value::from)],
        ) {
            if !id.is_null() {
                v["id"] = id.clone();
            }
            let (got_id, got) = parse_client_frame(v.to_string().as_bytes());
            prop_assert_eq!(got_id, id);
            prop_assert_eq!(got.map_err(|e| e.code), Ok(frame));
        }

        /// Any JSON, any bytes: a frame or a refusal with a documented code,
        /// its message bounded whatever the input's size.
        #[test]
        fn refusals_have_documented_codes_and_bounded_messages(
            v in any_json(),
            long in proptest::option::of(".{200,2000}"),
            bytes in proptest::collection::vec(any::<u8>(), 0..256),
        ) {
            let mut inputs = vec![v.to_string().into_bytes(), bytes];
            if let (Some(long), Value::Object(_)) = (long, &v) {
                let mut v = v.clone();
                v["type"] = long.clone().into();
                inputs.push(v.to_string().into_bytes());
                v["type"] = "publish".into();
                v["topic"] = "t".into();
                v["data_base64"] = long.into();
                inputs.push(v.to_string().into_bytes());
            }
            for input in inputs {
                let (id, r) = parse_client_frame(&input);
                if let Err(e) = r {
                    prop_assert!(FRAME_CODES.contains(&e.code), "{}", e.code);
                    prop_assert!(e.message.len() <= 1024, "{} bytes", e.message.len());
                    if matches!(e.code, "MALFORMED_JSON") {
                        prop_assert!(id.is_null());
                    }
                }
            }
        }

        /// The server's frames read back under RFC 6455 at every length form;
        /// a close frame's reason is cut to fit a control frame.
        #[test]
        fn server_frames_read_back(
            len in prop_oneof![0usize..130, 65_530usize..65_540, Just(70_000usize)],
            op in 0usize..4,
            code in any::<u16>(),
            reason in ".{0,200}",
        ) {
            let op = [Opcode::Text, Opcode::Binary, Opcode::Ping, Opcode::Pong][op];
            let payload = vec![len as u8; len];
            let f = ws_frame(op, &payload);
            let (fin, opcode, p) = read_ws_frame(&f).unwrap();
            prop_assert!(fin);
            prop_assert_eq!(opcode, op as u8);
            prop_assert_eq!(p, &payload[..]);
            let c = close_frame(code, &reason);
            let (fin, opcode, p) = read_ws_frame(&c).unwrap();
            prop_assert!(fin && opcode == 0x8 && p.len() <= 125);
            prop_assert_eq!(&p[..2], &code.to_be_bytes()[..]);
        }

        /// Base64 payloads: what the standard engine writes decodes back;
        /// anything else decodes or is refused, never a panic.
        #[test]
        fn base64_payloads_round_trip(d in proptest::collection::vec(any::<u8>(), 0..256), junk in ".{0,64}") {
            use base64::engine::general_purpose::STANDARD;
            prop_assert_eq!(&decode_base64(&STANDARD.encode(&d)).unwrap()[..], &d[..]);
            let _ = decode_base64(&junk);
        }
    }
}
