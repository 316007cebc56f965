//! The `invoke` frame of `/v1/ws`: the socket's namespace invokes one of its
//! own functions. On a member (or a single node) it runs here through the
//! namespace's invoker like every other path; on a non-member it runs on a
//! member (`member_call.rs`, the internal invoke route), and the answer
//! comes back on this socket in the frame's place.

use bytes::Bytes;
use futures_util::future::LocalBoxFuture;
use serde_json::{Value, json};

use crate::actors::{CallerInfo, Trigger};
use crate::actors::{NsHandle, PrepareInvoke};
use crate::error::{ApiError, Code};
use crate::http::member_call::{
    INVOKE_PATH, call_member, member_error, members_elsewhere, query_value,
};
use crate::http::state::Node;
use crate::identity::Identity;
use crate::pubsub::FrameError;
use crate::wasm::MAX_INPUT_BYTES;

/// `name` or `name@version` split; a version that is not a number is `BAD_VERSION`.
pub(crate) fn split_version(function: &str) -> Result<(String, Option<u64>), FrameError> {
    match function.split_once('@') {
        None => Ok((function.to_string(), None)),
        Some((n, v)) => match v.parse::<u64>() {
            Ok(v) => Ok((n.to_string(), Some(v))),
            Err(_) => Err(FrameError::new(
                "BAD_VERSION",
                "the version is not a number",
            )),
        },
    }
}

/// Runs `name` (at `version`) of `ns`'s namespace on this node with
/// `trigger`: the output bytes.
pub(crate) async fn run_here(
    ns: &NsHandle,
    subject: Option<String>,
    name: String,
    version: Option<u64>,
    input: Vec<u8>,
    trigger: Trigger,
) -> Result<Vec<u8>, ApiError> {
    let caller = CallerInfo {
        subject,
        request_id: crate::http::chain::logger::fresh_request_id(),
        trace: None,
    };
    let prepared = ns
        .prepare(PrepareInvoke {
            name,
            version,
            input,
            caller,
            trigger,
        })
        .await
        .map_err(ApiError::from)?;
    Ok(prepared.run().await.map_err(ApiError::from)?.output)
}

/// Runs `function` (`name[@version]`) of namespace `ns` on a member with
/// `trigger`, as `hop` (the member checks its grant again for a socket's
/// invoke): the output bytes, or the member's error.
pub(crate) async fn run_on_member(
    node: &Node,
    ns: &str,
    members: &[String],
    hop: &crate::auth::HopIdentity,
    function: &str,
    trigger: Trigger,
    input: Bytes,
) -> Result<Bytes, ApiError> {
    let query = format!(
        "function={}&trigger={}",
        query_value(function),
        trigger.as_str()
    );
    let call = call_member(
        node,
        ns,
        members,
        &hop.subject,
        INVOKE_PATH,
        &query,
        hop,
        input,
        "application/octet-stream",
    );
    match call.await {
        Ok(a) if a.status.is_success() => Ok(a.body),
        Ok(a) => Err(member_error(&a)),
        Err(e) => Err(e),
    }
}

/// Runs `function` of the socket's namespace with `input`; the result is the
/// output as JSON when it parses, else `{"output_base64": ...}`.
pub fn ws_invoke(
    node: Node,
    ns: NsHandle,
    identity: Option<Identity>,
    function: String,
    input: Bytes,
) -> LocalBoxFuture<'static, Result<Value, FrameError>> {
    Box::pin(async move {
        let (name, version) = split_version(&function)?;
        let Some(identity) = identity.filter(|i| i.allows("functions", "invoke", &name)) else {
            return Err(FrameError::new(
                "MISSING_GRANT",
                format!("the credential lacks functions:invoke:{name}"),
            ));
        };
        check_input(&input)?;
        let elsewhere = if ns.is_member() {
            None
        } else {
            members_elsewhere(&node, &ns.name)
                .await
                .map_err(FrameError::from)?
        };
        let output = match elsewhere {
            Some(members) => {
                let hop = crate::http::forward::hop_identity(&identity, &ns.name);
                run_on_member(
                    &node,
                    &ns.name,
                    &members,
                    &hop,
                    &function,
                    Trigger::Ws,
                    input,
                )
                .await
                .map_err(FrameError::from)?
                .to_vec()
            }
            None => run_here(
                &ns,
                Some(identity.subject.clone()),
                name,
                version,
                input.to_vec(),
                Trigger::Ws,
            )
            .await
            .map_err(FrameError::from)?,
        };
        Ok(serde_json::from_slice(&output).unwrap_or_else(|_| {
            use base64::Engine;
            json!({"output_base64": base64::engine::general_purpose::STANDARD.encode(&output)})
        }))
    })
}

/// The socket path's check of the engine's input limit, on the input as the
/// frame decoded it (the frame reader bounds a frame by
/// `pubsub.max_frame_bytes`, another limit): `INPUT_TOO_LARGE` above it.
/// `PrepareInvoke` and the invoker take the input as checked here.
fn check_input(input: &[u8]) -> Result<(), FrameError> {
    if input.len() > MAX_INPUT_BYTES {
        return Err(FrameError::new(
            Code::InputTooLarge.as_str(),
            format!("the input is larger than {MAX_INPUT_BYTES} bytes"),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An input of exactly the engine's limit passes; one byte more is
    /// `INPUT_TOO_LARGE`, the code the engine itself answers.
    #[test]
    fn input_limit() {
        assert_eq!(check_input(&vec![0; MAX_INPUT_BYTES]), Ok(()));
        let e = check_input(&vec![0; MAX_INPUT_BYTES + 1]).unwrap_err();
        assert_eq!(e.code, "INPUT_TOO_LARGE");
        let engine = crate::functions::wasm_error_code(&crate::wasm::WasmError::InputTooLarge);
        assert_eq!(e.code, engine.as_str());
    }
}
