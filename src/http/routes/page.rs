//! Paged listings (docs/api.md, "Listings"): every listing
//! route takes `?limit=` (1 to [`MAX_PAGE`], default [`DEFAULT_PAGE`]) and
//! `?cursor=`, and answers its usual document plus `next_cursor`, null on
//! the last page.
//!
//! A cursor is opaque to clients: base64url of the listing's name, the
//! namespace it lists and the last key of the page it follows. A page
//! resumes strictly after that key, inside the caller's own prefix: a
//! cursor names no other namespace's data and carries no authority, so it
//! needs no MAC. One made for another listing or another namespace, or one
//! that does not decode, is refused (400 `INVALID_CURSOR`) rather than read
//! from somewhere the client did not mean.

use crate::error::{ApiError, Code};
use base64::Engine;
use base64::engine::general_purpose::URL_SAFE_NO_PAD;
use serde::Deserialize;

/// Items a page holds when the request names no `limit`.
pub const DEFAULT_PAGE: usize = 100;
/// Most items a page may hold; a larger `limit` is refused.
pub const MAX_PAGE: usize = 1000;
/// Longest cursor accepted, in characters (a key of the longest kind, the
/// KV's, encoded with its namespace and listing fits well within it).
const MAX_CURSOR: usize = 4096;

/// The paging parameters of a listing's query string.
#[derive(Debug, Default, Deserialize)]
pub struct PageQuery {
    /// Items wanted: a whole number from 1 to `MAX_PAGE`; absent: `DEFAULT_PAGE`.
    #[serde(default)]
    pub limit: Option<String>,
    /// The `next_cursor` of the page before; absent: the first page.
    #[serde(default)]
    pub cursor: Option<String>,
}

/// Where a page starts and how long it is, checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Page {
    /// Listing this page belongs to (`"namespaces"`, `"kv"`, ...).
    listing: &'static str,
    /// The namespace listed (empty for the operator's namespace listing).
    ns: String,
    /// Items on the page.
    pub limit: usize,
    /// The key (relative to the listing's prefix) the page starts strictly after.
    pub after: Option<Vec<u8>>,
}

impl Page {
    /// Checks `limit` and `cursor` for `listing` of namespace `ns`: 400
    /// `INVALID_LIMIT` naming the bounds, 400 `INVALID_CURSOR` for a cursor
    /// that does not decode or was made for another listing or namespace.
    pub fn parse(q: &PageQuery, listing: &'static str, ns: &str) -> Result<Page, ApiError> {
        let limit = match q.limit.as_deref() {
            None => DEFAULT_PAGE,
            Some(s) => match s.parse::<usize>() {
                Ok(n) if (1..=MAX_PAGE).contains(&n) => n,
                _ => {
                    return Err(ApiError::new(
                        Code::InvalidLimit,
                        format!(
                            "limit must be a whole number from 1 to {MAX_PAGE} (default {DEFAULT_PAGE}); got {:?}",
                            s.chars().take(32).collect::<String>()
                        ),
                    ));
                }
            },
        };
        let after = match q.cursor.as_deref() {
            None => None,
            Some(c) => Some(decode(c, listing, ns)?),
        };
        Ok(Page {
            listing,
            ns: ns.to_owned(),
            limit,
            after,
        })
    }

    /// The cursor of the page after the one that ended at `last` (a key
    /// relative to the listing's prefix), when more follow.
    pub fn next_cursor(&self, last: Option<&[u8]>) -> Option<String> {
        last.map(|k| encode(self.listing, &self.ns, k))
    }

    /// `after` inside the listing's store `prefix`: the full key to resume
    /// strictly after.
    pub fn after_key(&self, prefix: &[u8]) -> Option<Vec<u8>> {
        self.after.as_ref().map(|a| {
            let mut k = prefix.to_vec();
            k.extend_from_slice(a);
            k
        })
    }
}

/// `listing NUL ns NUL key`, base64url without padding.
fn encode(listing: &str, ns: &str, key: &[u8]) -> String {
    let mut raw = Vec::with_capacity(listing.len() + ns.len() + key.len() + 2);
    raw.extend_from_slice(listing.as_bytes());
    raw.push(0);
    raw.extend_from_slice(ns.as_bytes());
    raw.push(0);
    raw.extend_from_slice(key);
    URL_SAFE_NO_PAD.encode(raw)
}

/// The key a cursor resumes after, if it was made for `listing` of `ns`.
fn decode(cursor: &str, listing: &str, ns: &str) -> Result<Vec<u8>, ApiError> {
    let bad = |why: &str| {
        ApiError::new(
            Code::InvalidCursor,
            format!(
                "the cursor {why}: pass a next_cursor this listing returned, or none for the first page"
            ),
        )
    };
    if cursor.len() > MAX_CURSOR {
        return Err(bad("is too long"));
    }
    let raw = URL_SAFE_NO_PAD
        .decode(cursor)
        .map_err(|_| bad("is not base64url"))?;
    let mut parts = raw.splitn(3, |b| *b == 0);
    let (Some(l), Some(n), Some(key)) = (parts.next(), parts.next(), parts.next()) else {
        return Err(bad("does not decode"));
    };
    if l != listing.as_bytes() {
        return Err(bad("belongs to another listing"));
    }
    if n != ns.as_bytes() {
        return Err(bad("belongs to another namespace"));
    }
    if key.is_empty() {
        return Err(bad("names no key"));
    }
    Ok(key.to_vec())
}

/// One page of an in-memory list sorted by `key`: the items strictly after
/// `page.after`, at most `page.limit`, and the cursor of the next page.
pub fn page_sorted<T>(
    items: impl IntoIterator<Item = T>,
    page: &Page,
    key: impl Fn(&T) -> &[u8],
) -> (Vec<T>, Option<String>) {
    let mut out: Vec<T> = items
        .into_iter()
        .filter(|t| page.after.as_deref().is_none_or(|a| key(t) > a))
        .take(page.limit.saturating_add(1))
        .collect();
    let next = if out.len() > page.limit {
        out.truncate(page.limit);
        page.next_cursor(out.last().map(&key))
    } else {
        None
    };
    (out, next)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn q(limit: Option<&str>, cursor: Option<&str>) -> PageQuery {
        PageQuery {
            limit: limit.map(str::to_owned),
            cursor: cursor.map(str::to_owned),
        }
    }

    /// A cursor round-trips for its listing and namespace, and only for them.
    #[test]
    fn cursor_is_bound_to_listing_and_namespace() {
        let c = encode("kv", "a", b"k\x00/3");
        let p = Page::parse(&q(None, Some(&c)), "kv", "a").unwrap();
        assert_eq!(p.after.as_deref(), Some(&b"k\x00/3"[..]));
        for (listing, ns) in [("kv", "b"), ("functions", "a")] {
            let e = Page::parse(&q(None, Some(&c)), listing, ns).unwrap_err();
            assert_eq!(e.code, Code::InvalidCursor);
        }
        for garbled in ["%%%", "", "AAAA", &"A".repeat(MAX_CURSOR + 1)] {
            let e = Page::parse(&q(None, Some(garbled)), "kv", "a").unwrap_err();
            assert_eq!(e.code, Code::InvalidCursor, "{garbled:?}");
        }
    }

    /// `limit` is 1 to MAX_PAGE, DEFAULT_PAGE when absent.
    #[test]
    fn limit_bounds() {
        assert_eq!(
            Page::parse(&q(None, None), "kv", "a").unwrap().limit,
            DEFAULT_PAGE
        );
        assert_eq!(
            Page::parse(&q(Some("1000"), None), "kv", "a")
                .unwrap()
                .limit,
            1000
        );
        for bad in ["0", "1001", "-1", "ten", ""] {
            let e = Page::parse(&q(Some(bad), None), "kv", "a").unwrap_err();
            assert_eq!(e.code, Code::InvalidLimit, "{bad:?}");
        }
    }

    /// An in-memory list pages strictly after the cursor's key.
    #[test]
    fn sorted_list_pages_reach_every_item_once() {
        let items: Vec<String> = (0..7).map(|i| format!("t{i}")).collect();
        let mut seen = Vec::new();
        let mut cursor = None;
        loop {
            let p = Page::parse(&q(Some("3"), cursor.as_deref()), "topics", "a").unwrap();
            let (got, next) = page_sorted(items.clone(), &p, |t| t.as_bytes());
            seen.extend(got);
            match next {
                Some(c) => cursor = Some(c),
                None => break,
            }
        }
        assert_eq!(seen, items);
    }
}
