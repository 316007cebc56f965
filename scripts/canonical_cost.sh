#!/usr/bin/env bash
# The cost of the canonical step's pure parts (src/deploy/canonical.rs) per
# request, optimized (rustc -O), without building the crate: the path check
# of a canonical path (the common case, borrowed), the rewrite of one that is
# not, and the header-name scan of a typical request. Prints ns per call.
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
dir="$(mktemp -d)"
trap 'rm -rf "$dir"' EXIT
cat > "$dir/main.rs" <<RS
#![allow(dead_code)]
#[path = "$here/src/deploy/canonical.rs"]
mod canonical;
use std::hint::black_box;
use std::time::Instant;

fn time(what: &str, n: u32, mut f: impl FnMut() -> usize) {
    let mut sink = 0usize;
    for _ in 0..n / 10 { sink = sink.wrapping_add(f()); }
    let t = Instant::now();
    for _ in 0..n { sink = sink.wrapping_add(f()); }
    let ns = t.elapsed().as_nanos() as f64 / n as f64;
    black_box(sink);
    println!("| {what} | {ns:.1} |");
}

fn main() {
    let n = 5_000_000;
    let canonical = "/api/v1/users/12345/profile";
    let spelled = "/api/v1/./users//12345/../12345/%70rofile";
    let headers = ["host", "user-agent", "accept", "accept-encoding", "accept-language",
                   "authorization", "content-type", "x-request-id", "cookie", "referer"];
    println!("| what | ns per call |");
    println!("|---|---:|");
    time("canonical_path, canonical path (borrowed)", n, || {
        match canonical::canonical_path(black_box(canonical)) {
            Ok(std::borrow::Cow::Borrowed(s)) => s.len(),
            _ => panic!("not canonical"),
        }
    });
    time("canonical_path, path rewritten", n, || {
        canonical::canonical_path(black_box(spelled)).map(|c| c.len()).unwrap_or(0)
    });
    time("anchor: one String copy of the canonical path", n, || {
        black_box(String::from(black_box(canonical))).len()
    });
    time("needs_judging, 10 ordinary header names", n, || {
        canonical::needs_judging(black_box(&headers).iter().copied()) as usize
    });
}
RS
rustc -O --edition 2024 -o "$dir/cost" "$dir/main.rs" 2>&1 | grep -v "^warning\|^ *|\|^ *=\|^$" || true
"$dir/cost"
