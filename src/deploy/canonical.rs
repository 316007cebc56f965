//! The canonical request (docs/design.md §2, docs/security.md "One canonical
//! request"): the one spelling of a path and of a header name that every
//! route match, every step and the upstream read. Two parsers that read one
//! input differently (the node's route match, an upstream's own path
//! normalization; a header the node strips and one a CGI server maps to the
//! same variable) are how a route's policy was skipped, so the path is made
//! canonical once at the edge, and what an upstream could read differently
//! is refused rather than guessed.
//!
//! Pure functions of strings: the edge step that applies them to a request is
//! `http/chain/canonical.rs`.

use std::borrow::Cow;

/// Why a path is refused: a spelling an upstream may read differently from
/// the node (400 `AMBIGUOUS_PATH`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ambiguous {
    /// `%2F` in a segment: one segment to the node, two to an upstream that decodes it.
    EscapedSlash,
    /// `\` or `%5C`: a path separator to some servers.
    Backslash,
    /// A `.` or `..` segment spelled with `%2E`: resolved after decoding by some servers.
    EscapedDot,
    /// NUL or another control character (escaped), or a raw space.
    Control,
    /// `;` in a segment: path parameters, cut off by some servers (`/admin;a=b`).
    Parameter,
    /// `%` not followed by two hex digits.
    BadEscape,
    /// A path that does not start with `/`.
    NotAbsolute,
}

impl Ambiguous {
    /// What the refusal says.
    pub fn reason(self) -> &'static str {
        match self {
            Ambiguous::EscapedSlash => "an escaped slash (%2F) in a path segment",
            Ambiguous::Backslash => "a backslash (\\ or %5C) in the path",
            Ambiguous::EscapedDot => "a dot segment spelled with %2E",
            Ambiguous::Control => "an escaped control character (such as %00) in the path",
            Ambiguous::Parameter => "a ; parameter in a path segment",
            Ambiguous::BadEscape => "a % not followed by two hex digits",
            Ambiguous::NotAbsolute => "a path that does not start with /",
        }
    }
}

/// RFC 3986 §2.3 unreserved characters: their escapes mean the character itself.
fn unreserved(b: u8) -> bool {
    b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~')
}

fn hex(b: u8) -> Option<u8> {
    match b {
        b'0'..=b'9' => Some(b - b'0'),
        b'a'..=b'f' => Some(b - b'a' + 10),
        b'A'..=b'F' => Some(b - b'A' + 10),
        _ => None,
    }
}

/// The byte `%XY` at `b[i]` stands for, if it is a well-formed escape.
fn escape_at(b: &[u8], i: usize) -> Option<u8> {
    Some(hex(*b.get(i + 1)?)? << 4 | hex(*b.get(i + 2)?)?)
}

/// Whether a segment is `.`/`..` once its `%2E`s are read as dots; the
/// second flag says whether an escape spelled it.
fn dot_segment(seg: &[u8]) -> (bool, bool) {
    let (mut dots, mut escaped, mut i) = (0, false, 0);
    while i < seg.len() {
        if seg[i] == b'.' {
            i += 1;
        } else if seg[i] == b'%' && escape_at(seg, i) == Some(b'.') {
            escaped = true;
            i += 3;
        } else {
            return (false, false);
        }
        dots += 1;
        if dots > 2 {
            return (false, false);
        }
    }
    (dots > 0, escaped)
}

/// The path in its canonical spelling: dot segments removed (RFC 3986
/// §5.2.4), escapes of unreserved characters decoded and other escapes
/// upper-cased (§6.2.2), `//` merged. Borrowed, with no allocation, when the
/// path is already canonical (the common case: one scan of its bytes).
/// Spellings an upstream could read differently from the node are refused
/// ([`Ambiguous`]). `*` (an `OPTIONS *` request) is kept.
pub fn canonical_path(raw: &str) -> Result<Cow<'_, str>, Ambiguous> {
    let b = raw.as_bytes();
    if b.first() != Some(&b'/') {
        return if raw == "*" {
            Ok(Cow::Borrowed(raw))
        } else {
            Err(Ambiguous::NotAbsolute)
        };
    }
    // The common path first, in one byte loop: no `%`, `\`, `;`, control
    // byte or space, no `//` and no segment starting with `.`.
    let mut prev = 0u8;
    let plain = b.iter().all(|&c| {
        let ok = c > 0x20
            && c != 0x7f
            && c != b'%'
            && c != b'\\'
            && c != b';'
            && !(prev == b'/' && (c == b'/' || c == b'.'));
        prev = c;
        ok
    });
    if plain {
        return Ok(Cow::Borrowed(raw));
    }
    let mut rewrite = false;
    // One pass over the segments (after the leading `/`).
    let mut start = 1;
    loop {
        let end = b[start..]
            .iter()
            .position(|&c| c == b'/')
            .map_or(b.len(), |p| start + p);
        let seg = &b[start..end];
        let last = end == b.len();
        if seg.is_empty() && !last {
            rewrite = true; // `//`
        }
        let (dot, escaped) = dot_segment(seg);
        if escaped {
            return Err(Ambiguous::EscapedDot);
        }
        rewrite |= dot;
        let mut i = 0;
        while i < seg.len() {
            match seg[i] {
                b'%' => {
                    let v = escape_at(seg, i).ok_or(Ambiguous::BadEscape)?;
                    match v {
                        b'/' => return Err(Ambiguous::EscapedSlash),
                        b'\\' => return Err(Ambiguous::Backslash),
                        0..=0x1f | 0x7f => return Err(Ambiguous::Control),
                        _ => {}
                    }
                    if unreserved(v) || seg[i + 1..i + 3].iter().any(u8::is_ascii_lowercase) {
                        rewrite = true;
                    }
                    i += 3;
                }
                b'\\' => return Err(Ambiguous::Backslash),
                b';' => return Err(Ambiguous::Parameter),
                0..=0x20 | 0x7f => return Err(Ambiguous::Control),
                _ => i += 1,
            }
        }
        if last {
            break;
        }
        start = end + 1;
    }
    if !rewrite {
        return Ok(Cow::Borrowed(raw));
    }
    Ok(Cow::Owned(resolve(raw, decode_unreserved)))
}

/// A segment with its unreserved escapes decoded and the others upper-cased
/// (its escapes are known to be well formed).
fn decode_unreserved(seg: &str, out: &mut String) {
    let b = seg.as_bytes();
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%'
            && let Some(v) = escape_at(b, i)
        {
            if unreserved(v) {
                out.push(v as char);
            } else {
                out.push('%');
                out.push(b[i + 1].to_ascii_uppercase() as char);
                out.push(b[i + 2].to_ascii_uppercase() as char);
            }
            i += 3;
        } else {
            // Whole UTF-8 sequences are copied: `%` and ASCII are never inside one.
            let next = b[i + 1..]
                .iter()
                .position(|&c| c == b'%')
                .map_or(b.len(), |p| i + 1 + p);
            out.push_str(&seg[i..next]);
            i = next;
        }
    }
}

/// `path`'s segments, each spelled by `spell`, with `.` and `..` resolved
/// and empty segments merged; a trailing `/` (or a last dot segment) kept as
/// a trailing `/`.
fn resolve(path: &str, spell: impl Fn(&str, &mut String)) -> String {
    let mut out = String::with_capacity(path.len());
    // Where each kept segment starts in `out` (its `/`), for `..`.
    let mut starts: Vec<usize> = Vec::new();
    let rest = path.strip_prefix('/').unwrap_or(path);
    let mut segs = rest.split('/').peekable();
    let mut seg_buf = String::new();
    while let Some(raw) = segs.next() {
        let last = segs.peek().is_none();
        seg_buf.clear();
        spell(raw, &mut seg_buf);
        match seg_buf.as_str() {
            "." | "" => {}
            ".." => {
                if let Some(s) = starts.pop() {
                    out.truncate(s);
                }
            }
            s => {
                starts.push(out.len());
                out.push('/');
                out.push_str(s);
                continue;
            }
        }
        if last {
            out.push('/');
        }
    }
    if out.is_empty() {
        out.push('/');
    }
    out
}

/// How a lenient upstream reads a path, the union of what servers do (nginx,
/// WSGI servers, Tomcat, IIS): `;` parameters cut from each segment, every
/// escape decoded, `\` read as `/`, then dot segments resolved and `//`
/// merged. The node matches a deployment's routes on this reading of a path
/// it passes through unchanged (`pass_ambiguous_paths`), so a route's policy
/// is the one such an upstream's own reading picks. `None` when the decoded
/// path holds NUL (never passed).
pub fn upstream_reading(raw: &str) -> Option<String> {
    let b = raw.as_bytes();
    let mut bytes = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b';' {
            // A path parameter: up to the next separator.
            while i < b.len() && b[i] != b'/' && b[i] != b'\\' {
                i += 1;
            }
        } else if b[i] == b'%'
            && let Some(v) = escape_at(b, i)
        {
            bytes.push(if v == b'\\' { b'/' } else { v });
            i += 3;
        } else {
            bytes.push(if b[i] == b'\\' { b'/' } else { b[i] });
            i += 1;
        }
    }
    if bytes.contains(&0) {
        return None;
    }
    let decoded = String::from_utf8_lossy(&bytes);
    let decoded = if decoded.starts_with('/') {
        decoded.into_owned()
    } else {
        format!("/{decoded}")
    };
    Some(resolve(&decoded, |s, out| out.push_str(s)))
}

/// Headers whose name an upstream reads with `_` as `-` (CGI, WSGI, PHP, Rack:
/// `HTTP_X_MESHGATE_SUBJECT`): `name` (lower-case) equal to `want` with `_` read as `-`.
fn eq_norm(name: &str, want: &str) -> bool {
    name.len() == want.len() && starts_norm(name, want)
}

/// `name` starts with `prefix`, `_` read as `-`.
fn starts_norm(name: &str, prefix: &str) -> bool {
    name.len() >= prefix.len()
        && name
            .bytes()
            .zip(prefix.bytes())
            .all(|(a, b)| a == b || (a == b'_' && b == b'-'))
}

/// Prefixes of headers only the node sets: the identity it vouches for, the
/// forwarding headers.
const RESERVED_PREFIXES: &[&str] = &["x-meshgate-", "x-forwarded-"];
/// Whole names only the node sets.
const RESERVED_NAMES: &[&str] = &["forwarded", "x-real-ip"];
/// Headers that belong to one hop and are never forwarded (the proxy's
/// header writer drops them, `super::headers`).
pub(crate) const HOP_BY_HOP: &[&str] = &[
    "connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "proxy-connection",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "http2-settings",
];
/// Names the node reads itself in their exact spelling besides the
/// hop-by-hop ones (the framing, the host, credentials): another spelling
/// of one of these or of [`HOP_BY_HOP`] (with `_`) is a second copy an
/// upstream could read instead.
const NODE_READS: &[&str] = &["host", "content-length", "authorization", "x-api-key"];

/// What the edge does with one header name of a client's request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HeaderName {
    /// Passed on.
    Keep,
    /// A forwarding header from a trusted proxy (`X-Forwarded-For`,
    /// `X-Forwarded-Proto`, exactly so spelled): kept for the node to read and extend.
    Trusted,
    /// Removed from the request.
    Drop,
}

/// Judges one header name of a client's request (lower-case, as actix and
/// hyper give names), read with `_` as `-`: a name that reads as a reserved
/// header (`x-meshgate-*`, `x-forwarded-*`, `forwarded`, `x-real-ip`) is
/// dropped, as is a second spelling (`_`) of `x-internal-auth-*` or of a
/// header the node reads itself; a name with `_` is dropped unless
/// `underscores` (nginx's `underscores_in_headers off`). From a trusted proxy
/// its `x-forwarded-for` and `x-forwarded-proto` are kept.
pub fn judge_header(name: &str, underscores: bool, trusted_peer: bool) -> HeaderName {
    let has_underscore = name.contains('_');
    if has_underscore && !underscores {
        return HeaderName::Drop;
    }
    if RESERVED_PREFIXES.iter().any(|p| starts_norm(name, p))
        || RESERVED_NAMES.iter().any(|n| eq_norm(name, n))
    {
        if trusted_peer && (name == "x-forwarded-for" || name == "x-forwarded-proto") {
            return HeaderName::Trusted;
        }
        return HeaderName::Drop;
    }
    if has_underscore
        && (starts_norm(name, "x-internal-auth-")
            || HOP_BY_HOP
                .iter()
                .chain(NODE_READS)
                .any(|n| eq_norm(name, n)))
    {
        return HeaderName::Drop;
    }
    HeaderName::Keep
}

/// Whether any header name needs [`judge_header`]'s closer look: one pass
/// over the first bytes of each, no allocation (the common request has none).
pub fn needs_judging<'a>(mut names: impl Iterator<Item = &'a str>) -> bool {
    names.any(|n| {
        n.contains('_')
            || (n.starts_with("x-")
                && (n.starts_with("x-meshgate-")
                    || n.starts_with("x-forwarded-")
                    || n == "x-real-ip"))
            || n == "forwarded"
    })
}

/// Whether `name` reads as an `x-meshgate-*` header (`_` as `-`).
pub fn reads_as_identity(name: &str) -> bool {
    starts_norm(name, "x-meshgate-")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn canon(p: &str) -> Result<String, Ambiguous> {
        canonical_path(p).map(Cow::into_owned)
    }

    /// A canonical path is borrowed as it is: no allocation on the common path.
    #[test]
    fn canonical_paths_are_borrowed() {
        for p in [
            "/",
            "/admin",
            "/v1/kv/a%20b",
            "/a/b/",
            "/%C3%A9",
            "/a.b/..c/...",
            "*",
        ] {
            assert!(
                matches!(canonical_path(p), Ok(Cow::Borrowed(_))),
                "{p} should be canonical"
            );
        }
    }

    /// Dot segments resolve, slashes merge, unreserved escapes decode, hex is upper-cased.
    #[test]
    fn paths_are_made_canonical() {
        for (raw, want) in [
            ("/health/../admin", "/admin"),
            // `//` merged first, as nginx and posixpath.normpath read it.
            ("/health//../admin", "/admin"),
            ("/./admin", "/admin"),
            ("/x/../admin", "/admin"),
            ("/%61dmin", "/admin"),
            ("//admin", "/admin"),
            ("/a//b//", "/a/b/"),
            ("/a/b/..", "/a/"),
            ("/a/.", "/a/"),
            ("/..", "/"),
            ("/../../etc", "/etc"),
            ("/%7e%2D", "/~-"),
            ("/%c3%a9", "/%C3%A9"),
            ("/a%20b/", "/a%20b/"),
        ] {
            assert_eq!(canon(raw).as_deref(), Ok(want), "{raw}");
        }
    }

    /// What an upstream may read differently is refused, and says why.
    #[test]
    fn ambiguous_spellings_are_refused() {
        for (raw, why) in [
            ("/health/%2e%2e/admin", Ambiguous::EscapedDot),
            ("/%2E/admin", Ambiguous::EscapedDot),
            ("/.%2e/admin", Ambiguous::EscapedDot),
            ("/admin%2f", Ambiguous::EscapedSlash),
            ("/a%2Fb", Ambiguous::EscapedSlash),
            ("/admin%5c", Ambiguous::Backslash),
            ("/a\\b", Ambiguous::Backslash),
            ("/admin;a=b", Ambiguous::Parameter),
            ("/admin%00", Ambiguous::Control),
            ("/admin%0a", Ambiguous::Control),
            ("/admin%zz", Ambiguous::BadEscape),
            ("/admin%4", Ambiguous::BadEscape),
            ("admin", Ambiguous::NotAbsolute),
        ] {
            assert_eq!(canon(raw), Err(why), "{raw}");
        }
    }

    /// The upstream's reading decodes every escape before resolving.
    #[test]
    fn upstream_reading_decodes_then_resolves() {
        assert_eq!(
            upstream_reading("/health/%2e%2e/admin").as_deref(),
            Some("/admin")
        );
        assert_eq!(upstream_reading("/a%2fb").as_deref(), Some("/a/b"));
        assert_eq!(upstream_reading("/a//b").as_deref(), Some("/a/b"));
        assert_eq!(upstream_reading("/admin;x=1").as_deref(), Some("/admin"));
        assert_eq!(
            upstream_reading("/open;a/..\\admin").as_deref(),
            Some("/admin")
        );
        assert_eq!(upstream_reading("/a%5cb%3bc").as_deref(), Some("/a/b;c"));
        assert_eq!(upstream_reading("/a%00"), None);
    }

    /// Names are judged with `_` read as `-`; underscores are dropped unless allowed.
    #[test]
    fn header_names_are_judged_normalized() {
        use HeaderName::*;
        for (name, under, trusted, want) in [
            ("x-meshgate-subject", true, false, Drop),
            ("x-meshgate_subject", true, false, Drop),
            ("x_meshgate_grants", true, true, Drop),
            ("x-meshgate_subject", false, false, Drop),
            ("x-forwarded-proto", false, false, Drop),
            ("x-forwarded-proto", false, true, Trusted),
            ("x-forwarded-for", false, true, Trusted),
            ("x_forwarded_for", true, true, Drop),
            ("x-forwarded-host", false, true, Drop),
            ("forwarded", false, true, Drop),
            ("x-real-ip", false, true, Drop),
            ("x_real_ip", true, false, Drop),
            ("x-internal_auth-subject", true, false, Drop),
            ("x-internal-auth-subject", false, false, Keep),
            ("transfer_encoding", true, false, Drop),
            ("content_length", true, false, Drop),
            ("my_header", true, false, Keep),
            ("my_header", false, false, Drop),
            ("accept", false, false, Keep),
            ("x-request-id", false, false, Keep),
        ] {
            assert_eq!(judge_header(name, under, trusted), want, "{name}");
        }
        assert!(!needs_judging(
            ["accept", "host", "x-request-id", "user-agent"].into_iter()
        ));
        assert!(needs_judging(["accept", "x-forwarded-for"].into_iter()));
        assert!(needs_judging(["a_b"].into_iter()));
    }
}
