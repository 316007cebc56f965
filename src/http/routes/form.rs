//! What a route's body takes, and the refusals that say so: the multipart
//! parts of a function or static-site deploy ([`Form`]) and the fields of a
//! JSON body ([`Json`], [`Body`]). A body of the wrong shape is answered
//! with the envelope whose message names what went wrong *and* the parts or
//! fields the route takes, so that the next try can be the right one
//! (docs/design.md §9).

use crate::error::{ApiError, ApiResult, Code};
use actix_web::dev::Payload;
use actix_web::{FromRequest, HttpRequest, web};
use futures_util::StreamExt;
use serde::de::DeserializeOwned;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

/// The parts a multipart route takes.
pub struct Form {
    /// The route, as its refusals name it (`POST /v1/functions`).
    pub route: &'static str,
    /// Parts without which the body is refused (`MISSING_PART`).
    pub required: &'static [&'static str],
    /// Parts the route also reads.
    pub optional: &'static [&'static str],
    /// A command that sends a body of the right shape.
    pub example: &'static str,
}

impl Form {
    /// `POST /v1/functions takes the parts name and wasm (required), ...`.
    pub fn takes(&self) -> String {
        let mut s = format!(
            "{} takes the multipart parts {} (required)",
            self.route,
            self.required.join(", ")
        );
        if !self.optional.is_empty() {
            s.push_str(&format!(" and {} (optional)", self.optional.join(", ")));
        }
        s.push_str(&format!(", e.g. {}", self.example));
        s
    }

    /// A refusal of the body's shape: `why`, then what the route takes.
    pub fn refuse(&self, code: Code, why: impl std::fmt::Display) -> ApiError {
        ApiError::new(code, format!("{why}; {}", self.takes()))
    }

    /// 400 `UNKNOWN_PART` for a part the route does not read.
    pub fn unknown_part(&self, part: &str) -> ApiError {
        self.refuse(
            Code::UnknownPart,
            format!("unknown part {}", crate::util::quoted(part)),
        )
    }

    /// 400 `MISSING_PART` for a required part the body lacks.
    pub fn missing_part(&self, part: &str) -> ApiError {
        self.refuse(
            Code::MissingPart,
            format!("the {} part is required", crate::util::quoted(part)),
        )
    }

    /// A multipart parse failure in words a person reads (the parser's own
    /// messages name Rust variants), as 400 `MALFORMED_MULTIPART`.
    pub fn malformed(&self, e: actix_multipart::MultipartError) -> ApiError {
        use actix_multipart::MultipartError as E;
        let why = match e {
            E::ContentTypeMissing | E::ContentTypeParse | E::ContentTypeIncompatible => {
                "the body is not multipart/form-data: send the parts as a form, with \
                 Content-Type: multipart/form-data; boundary=..."
                    .to_string()
            }
            E::BoundaryMissing => {
                "the Content-Type has no boundary=...; let the client build the multipart body"
                    .into()
            }
            E::ContentDispositionMissing | E::ContentDispositionNameMissing => {
                "a part has no Content-Disposition: form-data; name=\"...\" header".into()
            }
            E::Nested => "nested multipart bodies are not accepted".into(),
            E::Incomplete => "the multipart body ends before its closing boundary".into(),
            E::Payload(p) => format!("the body could not be read: {p}"),
            other => format!("the multipart body could not be parsed: {other}"),
        };
        self.refuse(Code::MalformedMultipart, why)
    }

    /// Reads part `part` whole, refusing more than `limit` bytes with `code`
    /// (a 413 code).
    pub async fn read_part(
        &self,
        field: &mut actix_multipart::Field,
        part: &str,
        limit: usize,
        code: Code,
    ) -> ApiResult<Vec<u8>> {
        let mut buf = Vec::new();
        while let Some(chunk) = field.next().await {
            let chunk = chunk.map_err(|e| self.malformed(e))?;
            if buf.len() + chunk.len() > limit {
                return Err(ApiError::new(
                    code,
                    format!("part {part:?} is larger than {limit} bytes"),
                ));
            }
            buf.extend_from_slice(&chunk);
        }
        Ok(buf)
    }

    /// A text part, trimmed; one that is not UTF-8 is `MALFORMED_MULTIPART`.
    pub fn text(&self, bytes: Vec<u8>, part: &str) -> ApiResult<String> {
        String::from_utf8(bytes)
            .map(|s| s.trim().to_string())
            .map_err(|_| {
                self.refuse(
                    Code::MalformedMultipart,
                    format!("part {part:?} is not UTF-8"),
                )
            })
    }
}

/// A JSON request body: what a route's refusals say it takes.
pub trait Body: DeserializeOwned + 'static {
    /// `a JSON object with the fields ...`: by default the fields of the
    /// struct as serde reads them (so the list cannot drift from the struct).
    fn takes() -> String {
        match struct_fields::<Self>() {
            Some(fields) => format!("a JSON object with the fields {}", fields.join(", ")),
            None => "a JSON body".to_string(),
        }
    }
}

/// The field names serde reads for `T` when `T` is a struct
/// (`#[derive(Deserialize)]`): asked of a deserializer that only records
/// them. None for maps, sequences, enums and flattened structs.
pub fn struct_fields<T: DeserializeOwned>() -> Option<&'static [&'static str]> {
    let mut out = None;
    let _ = T::deserialize(FieldProbe(&mut out));
    out
}

/// A deserializer that answers nothing and records the fields a struct asks for.
struct FieldProbe<'a>(&'a mut Option<&'static [&'static str]>);

/// [`FieldProbe`]'s only answer.
#[derive(Debug)]
struct Probed;

impl std::fmt::Display for Probed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("probed")
    }
}

impl std::error::Error for Probed {}

impl serde::de::Error for Probed {
    fn custom<T: std::fmt::Display>(_: T) -> Self {
        Probed
    }
}

impl<'de> serde::Deserializer<'de> for FieldProbe<'_> {
    type Error = Probed;

    fn deserialize_any<V: serde::de::Visitor<'de>>(self, _: V) -> Result<V::Value, Probed> {
        Err(Probed)
    }

    fn deserialize_struct<V: serde::de::Visitor<'de>>(
        self,
        _name: &'static str,
        fields: &'static [&'static str],
        _: V,
    ) -> Result<V::Value, Probed> {
        *self.0 = Some(fields);
        Err(Probed)
    }

    serde::forward_to_deserialize_any! {
        bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string bytes
        byte_buf option unit unit_struct newtype_struct seq tuple tuple_struct map
        enum identifier ignored_any
    }
}

/// The refusal of a JSON body that does not parse as `T`: the
/// parser's reason, then the route and what it takes.
pub fn json_refusal<T: Body>(code: Code, route: &str, why: impl std::fmt::Display) -> ApiError {
    ApiError::new(code, format!("{why}; {route} takes {}", T::takes()))
}

/// `web::Json<T>` whose refusals (400 `MALFORMED_JSON`, 415, every one but
/// the 413 of a body over the limit) also name the route and the fields
/// it takes ([`Body::takes`]). The limit and the codes are `web::JsonConfig`'s
/// (`http/error.rs`).
pub struct Json<T>(pub T);

impl<T> Json<T> {
    /// The body.
    pub fn into_inner(self) -> T {
        self.0
    }
}

impl<T> std::ops::Deref for Json<T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.0
    }
}

impl<T: Body> FromRequest for Json<T> {
    type Error = actix_web::Error;
    type Future = JsonFut<T>;

    fn from_request(req: &HttpRequest, payload: &mut Payload) -> Self::Future {
        JsonFut {
            inner: web::Json::<T>::from_request(req, payload),
            req: Some(req.clone()),
        }
    }
}

/// The future of [`Json`]'s extraction.
pub struct JsonFut<T: Body> {
    inner: <web::Json<T> as FromRequest>::Future,
    /// For the route's name in a refusal.
    req: Option<HttpRequest>,
}

impl<T: Body> Future for JsonFut<T> {
    type Output = Result<Json<T>, actix_web::Error>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.get_mut();
        let res = std::task::ready!(Pin::new(&mut this.inner).poll(cx));
        Poll::Ready(match res {
            Ok(j) => Ok(Json(j.into_inner())),
            Err(e) => Err(match (e.as_error::<ApiError>(), this.req.take()) {
                (Some(api), Some(req)) if api.status.as_u16() != 413 => {
                    let route = format!(
                        "{} {}",
                        req.method(),
                        req.match_pattern()
                            .unwrap_or_else(|| req.path().to_string())
                    );
                    json_refusal::<T>(api.code, &route, &api.message).into()
                }
                _ => e,
            }),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde::Deserialize;

    #[derive(Deserialize)]
    #[serde(deny_unknown_fields)]
    #[allow(dead_code)]
    struct Sample {
        name: String,
        #[serde(default, rename = "max")]
        limit: Option<u32>,
    }
    impl Body for Sample {}

    /// A derived struct's fields are read as serde names them; a map has none.
    #[test]
    fn fields_of_a_struct_as_serde_reads_them() {
        assert_eq!(struct_fields::<Sample>(), Some(&["name", "max"][..]));
        assert_eq!(Sample::takes(), "a JSON object with the fields name, max");
        assert_eq!(
            struct_fields::<std::collections::BTreeMap<String, u64>>(),
            None
        );
    }

    /// A form names its required and optional parts and an example.
    #[test]
    fn a_form_names_its_parts() {
        let f = Form {
            route: "POST /x",
            required: &["name", "wasm"],
            optional: &["metadata"],
            example: "curl -F name=a -F wasm=@a.wasm",
        };
        let e = f.unknown_part("file");
        assert_eq!((e.code, e.status.as_u16()), (Code::UnknownPart, 400));
        assert_eq!(
            e.message,
            "unknown part \"file\"; POST /x takes the multipart parts name, wasm (required) \
             and metadata (optional), e.g. curl -F name=a -F wasm=@a.wasm"
        );
    }
}
