//! Large answer bodies handed to the HTTP/1 dispatcher a chunk at a time.
//!
//! actix-http's dispatcher copies a body chunk into its write buffer whole
//! and holds it there until the client has read it: an answer given as one
//! `Bytes` of 24 MiB cost a 24 MiB copy per connection, shared buffer or
//! not. Given as slices of at most [`CHUNK`], the dispatcher asks for the
//! next one only as the connection drains, so a slow reader holds one chunk
//! of copy (and a reference to the shared bytes).

use actix_web::body::SizedStream;
use bytes::Bytes;
use futures_util::Stream;
use std::convert::Infallible;

/// Bytes handed to the dispatcher at a time.
pub const CHUNK: usize = 64 << 10;

/// `body` as a sized stream of slices of at most [`CHUNK`] (no copy), with
/// `hold` kept until the last slice is out or the answer is dropped.
pub fn in_chunks<H: 'static>(
    body: Bytes,
    hold: H,
) -> SizedStream<impl Stream<Item = Result<Bytes, Infallible>> + 'static> {
    SizedStream::new(body.len() as u64, slices(body, hold))
}

/// The slices of [`in_chunks`].
fn slices<H: 'static>(
    body: Bytes,
    hold: H,
) -> impl Stream<Item = Result<Bytes, Infallible>> + 'static {
    futures_util::stream::unfold((body, hold), |(mut rest, hold)| async move {
        if rest.is_empty() {
            return None;
        }
        let chunk = rest.split_to(rest.len().min(CHUNK));
        Some((Ok(chunk), (rest, hold)))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures_util::StreamExt as _;

    /// The slices are the body, in order, none over a chunk, each a view
    /// of the same bytes; the hold goes with the last one.
    #[tokio::test]
    async fn a_body_goes_out_in_slices_of_itself() {
        let body = Bytes::from((0..(CHUNK * 2 + 5)).map(|i| i as u8).collect::<Vec<u8>>());
        let hold = std::sync::Arc::new(());
        let mut s = Box::pin(slices(body.clone(), hold.clone()));
        let mut got = Vec::new();
        let mut sizes = Vec::new();
        while let Some(Ok(c)) = s.next().await {
            assert!(
                body.as_ptr_range().contains(&c.as_ptr()),
                "a view, not a copy"
            );
            sizes.push(c.len());
            got.extend_from_slice(&c);
        }
        assert_eq!(sizes, [CHUNK, CHUNK, 5]);
        assert_eq!(got, body);
        assert_eq!(std::sync::Arc::strong_count(&hold), 1, "let go at the end");
    }
}
