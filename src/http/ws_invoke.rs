//! The `invoke` frame of `/v1/ws`: the socket's namespace invokes one of its
//! own functions, through its supervisor like every other path.

use bytes::Bytes;
use futures_util::future::LocalBoxFuture;
use serde_json::{Value, json};

use crate::actors::{CallerInfo, Trigger};
use crate::actors::{NsHandle, PrepareInvoke};
use crate::error::{ApiError, Code};
use crate::identity::Identity;
use crate::pubsub::FrameError;
use crate::wasm::MAX_INPUT_BYTES;

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
        check_input(&input)?;
        let caller = CallerInfo {
            subject: identity.map(|i| i.subject.clone()),
            request_id: crate::http::chain::logger::fresh_request_id(),
            trace: None,
        };
        let run = async {
            let prepared = ns
                .prepare(PrepareInvoke {
                    name,
                    version,
                    input: input.to_vec(),
                    caller,
                    trigger: Trigger::Ws,
                })
                .await
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
