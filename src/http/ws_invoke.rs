//! The `invoke` frame of `/v1/ws`: the socket's namespace invokes one of its
//! own functions, through its supervisor like every other path.

use bytes::Bytes;
use futures_util::future::LocalBoxFuture;
use serde_json::{Value, json};

use crate::actors::{CallerInfo, Trigger};
use crate::actors::{NsHandle, PrepareInvoke};
use crate::error::ApiError;
use crate::identity::Identity;
use crate::pubsub::FrameError;

/// Runs `function` of the socket's namespace with `input`; the result is the
/// output as JSON when it parses, else `{"output_base64": ...}`.
pub fn ws_invoke(
    ns: NsHandle,
    identity: Option<Identity>,
    function: String,
    input: Bytes,
) -> LocalBoxFuture<'static, Result<Value, FrameError>> {
    Box::pin(async move {
        let (name, version) = match function.split_once('@') {
            None => (function, None),
            Some((n, v)) => match v.parse::<u64>() {
                Ok(v) => (n.to_string(), Some(v)),
                Err(_) => {
                    return Err(FrameError::new(
                        "BAD_VERSION",
                        "the version is not a number",
                    ));
                }
            },
        };
        if !identity
            .as_ref()
            .is_some_and(|i| i.allows("functions", "invoke", &name))
        {
            return Err(FrameError::new(
                "MISSING_GRANT",
                format!("the credential lacks functions:invoke:{name}"),
            ));
        }
        let caller = CallerInfo {
            subject: identity.map(|i| i.subject),
            request_id: hex::encode(crate::util::random_bytes::<12>()),
        };
        let run = async {
            let prepared = ns
                .ask(PrepareInvoke {
                    name,
                    version,
                    input: input.to_vec(),
                    caller,
                    trigger: Trigger::Ws,
                })
                .await
                .map_err(ApiError::from)?
                .map_err(ApiError::from)?;
            prepared.run().await.map_err(ApiError::from)
        };
        match run.await {
            Ok(reply) => Ok(serde_json::from_slice(&reply.output).unwrap_or_else(|_| {
                use base64::Engine;
                json!({"output_base64": base64::engine::general_purpose::STANDARD.encode(&reply.output)})
            })),
            Err(e) => Err(FrameError::new(e.code.as_str(), e.message)),
        }
    })
}
