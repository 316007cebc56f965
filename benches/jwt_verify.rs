//! JWT verifications per second (EdDSA, one key), and the cost of the
//! cheap rejections that run before any signature check.
//!
//! `cargo bench --bench jwt_verify`

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use meshgate::auth::{Claims, HopIdentity, HopKey, HopRequest, HopVersion, JwtKeys, parse_api_key};
use std::hint::black_box;

const NOW: u64 = 1_700_000_000;

fn bench(c: &mut Criterion) {
    let (keys, _) = JwtKeys::generate().expect("key generation");
    let claims = Claims::new(
        "meshgate",
        "meshgate-api",
        "key_0123456789ab",
        "acme",
        vec!["kv:read:*".into(), "pubsub:publish:chat.*".into()],
        NOW,
    )
    .expect("claims");
    let token = keys.sign(&claims);
    let forged = format!("{}x", &token[..token.len() - 1]);

    let mut g = c.benchmark_group("jwt");
    g.throughput(Throughput::Elements(1));
    g.bench_function("verify_valid", |b| {
        b.iter(|| {
            keys.verify(black_box(&token), NOW, "meshgate", "meshgate-api")
                .expect("valid")
        })
    });
    g.bench_function("verify_bad_signature", |b| {
        b.iter(|| {
            keys.verify(black_box(&forged), NOW, "meshgate", "meshgate-api")
                .is_err()
        })
    });
    g.bench_function("verify_alg_none", |b| {
        let none = "eyJhbGciOiJub25lIn0.e30.";
        b.iter(|| {
            keys.verify(black_box(none), NOW, "meshgate", "meshgate-api")
                .is_err()
        })
    });
    g.bench_function("sign", |b| b.iter(|| keys.sign(black_box(&claims))));
    g.finish();

    let mut g = c.benchmark_group("other");
    g.throughput(Throughput::Elements(1));
    let key = meshgate::auth::generate_api_key(meshgate::auth::KeyKind::Secret).expect("key");
    g.bench_function("api_key_parse", |b| {
        b.iter(|| parse_api_key(black_box(&key)).is_ok())
    });
    // What an API-key request computes before its cache lookup: the
    // operator-key check, the parse and the key's HMAC; with the server
    // secret's HMAC key made per call (as before `Secrets::new`) and prepared.
    let secret = b"0123456789abcdef0123456789abcdef".to_vec();
    let op_hash = meshgate::auth::hash_api_key(&secret, "mgop_bench");
    g.bench_function("api_key_request_key_per_call", |b| {
        b.iter(|| {
            let k = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, &secret);
            let op = ring::hmac::verify(&k, black_box(&key).as_bytes(), &op_hash).is_ok();
            let parsed = parse_api_key(black_box(&key)).is_ok();
            (
                op,
                parsed,
                meshgate::auth::hash_api_key(&secret, black_box(&key)),
            )
        })
    });
    let secrets = meshgate::http::state::Secrets::new(secret.clone(), "mgop_bench");
    g.bench_function("api_key_request_prepared", |b| {
        b.iter(|| {
            let op = secrets.is_operator_key(black_box(&key));
            let parsed = parse_api_key(black_box(&key)).is_ok();
            (op, parsed, secrets.api_key_hash(black_box(&key)))
        })
    });
    let hop = HopKey::from_secret(b"0123456789abcdef0123456789abcdef");
    let id = HopIdentity::from_claims(&claims);
    let digest = meshgate::auth::hop_body_sha256(b"");
    let req = HopRequest {
        method: "GET",
        path: "/v1/kv/x",
        query: "",
        body_sha256: &digest,
    };
    let mac = hop.sign(HopVersion::V4, &req, &id, NOW);
    g.bench_function("hop_mac_verify", |b| {
        b.iter(|| {
            hop.verify(black_box(&[mac.as_str()]), &req, &id, NOW)
                .is_ok()
        })
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
