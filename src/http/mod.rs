//! HTTP: the listener, the middleware chain of docs/design.md §2 and the routes of §10;
//! the gRPC listener of deployment hosts (`grpc.rs`).

#![forbid(unsafe_code)]

pub mod access_log;
pub(crate) mod body;
mod chain;
pub mod dashboard;
mod deploy_serve;
mod error;
pub mod forward;
mod grpc;
mod hop;
mod member_call;
mod middleware;
pub mod openapi;
mod policy;
mod request;
mod route_policy;
mod routes;
pub mod state;
pub mod tls;
mod upgrade;
mod ws_invoke;
mod ws_session;

// For the modules outside `http/` (the assembly, the tests): no file of
// `http/` imports from here, each names the file that defines what it uses.
pub use crate::util::now;
pub use error::{ApiError, ApiResult};
pub use state::{Node, Phase};
pub use ws_session::{MAX_IN_FLIGHT, Mode, WsSession};

use crate::error::Code;
use crate::http::policy::RouteTable;
use actix_service::{IntoServiceFactory, ServiceFactoryExt};
use actix_web::dev::AppConfig;
use actix_web::middleware::from_fn;
use actix_web::{App, HttpServer, web};
use std::net::SocketAddr;

/// Builds the route table of every capability; the debug routes only when
/// `[debug]` turns them on.
pub fn route_table(cfg: &crate::config::Config) -> RouteTable {
    let mut t = RouteTable::new(cfg);
    routes::register(&mut t);
    t
}

/// The node's listening addresses, bound but not yet listening.
/// `node::start` binds them before it opens or starts anything, so an
/// address another process holds stops a start that has nothing to undo
/// yet; until [`serve`] listens, a client is refused rather than left in
/// the backlog of a node that is still starting.
pub struct Bound {
    /// `[server] listen`, for [`serve`].
    pub(crate) api: socket2::Socket,
    /// `[metrics] listen`, when set, for [`serve_metrics`].
    pub(crate) metrics: Option<socket2::Socket>,
    /// `[grpc] listen`, when set, for [`serve`].
    pub(crate) grpc: Option<socket2::Socket>,
    /// `[tls.acme] http_listen`, when set, for [`serve_acme_http`].
    pub(crate) acme_http: Option<socket2::Socket>,
}

/// Binds `[server] listen` and `[metrics] listen`. A failure names the
/// address and the settings that choose another.
pub fn bind(cfg: &crate::config::Config) -> anyhow::Result<Bound> {
    let api = bind_socket(cfg.listen_addr()).map_err(|e| {
        cannot_listen(
            &cfg.server.listen,
            "",
            "--listen HOST:PORT or MESHGATE_SERVER_LISTEN",
            e,
        )
    })?;
    let metrics = match cfg.metrics_listen_addr() {
        None => None,
        Some(m) => {
            let addr: SocketAddr = m
                .parse()
                .map_err(|_| anyhow::anyhow!("metrics.listen: {m:?} is not host:port"))?;
            Some(bind_socket(addr).map_err(|e| {
                cannot_listen(
                    m,
                    " ([metrics] listen)",
                    "MESHGATE_METRICS_LISTEN or [metrics] listen",
                    e,
                )
            })?)
        }
    };
    let grpc = match cfg.grpc_listen_addr() {
        None => None,
        Some(g) => {
            let addr: SocketAddr = g
                .parse()
                .map_err(|_| anyhow::anyhow!("grpc.listen: {g:?} is not host:port"))?;
            Some(bind_socket(addr).map_err(|e| {
                cannot_listen(
                    g,
                    " ([grpc] listen)",
                    "MESHGATE_GRPC_LISTEN or [grpc] listen",
                    e,
                )
            })?)
        }
    };
    let acme_http = match cfg.acme_http_listen_addr() {
        None => None,
        Some(addr) => Some(bind_socket(addr).map_err(|e| {
            cannot_listen(
                &addr.to_string(),
                " ([tls.acme] http_listen)",
                "[tls.acme] http_listen",
                e,
            )
        })?),
    };
    Ok(Bound {
        api,
        metrics,
        grpc,
        acme_http,
    })
}

/// The one line a listener that cannot be had is reported with.
fn cannot_listen(addr: &str, what: &str, choose: &str, e: std::io::Error) -> anyhow::Error {
    let why = match e.kind() {
        std::io::ErrorKind::AddrInUse => {
            "the address is already in use (another meshgate or another program listens there)"
                .to_string()
        }
        _ => e.to_string(),
    };
    anyhow::anyhow!("cannot listen on {addr}{what}: {why}; pick another address with {choose}")
}

/// Returns the (not yet awaited) server on the bound API address, that
/// address, and the gRPC listener's when `[grpc] listen` is set (served by
/// the same workers, `grpc.rs`).
///
/// The listener is what actix-web's `HttpServer` assembles (its defaults:
/// backlog 1024, keep-alive 5 s, TLS handshake 3 s, graceful shutdown),
/// built here so that WebSocket upgrades go to [`upgrade`] instead of
/// staying on actix-http's HTTP/1 dispatcher.
pub fn serve(
    node: Node,
    api: socket2::Socket,
    grpc_socket: Option<socket2::Socket>,
) -> anyhow::Result<(actix_web::dev::Server, SocketAddr, Option<SocketAddr>)> {
    // Fail start-up now if any route lacks a policy.
    route_table(&node.config).build()?;
    let cfg = node.config.clone();
    let workers = if cfg.server.workers == 0 {
        crate::util::num_cpus()
    } else {
        cfg.server.workers
    };
    let data = web::Data::new(node.clone());
    let shared_limiters = chain::limits::Limiters::new(&cfg);
    let limiters = web::Data::new(shared_limiters.clone());
    let max_body = cfg.server.max_body_bytes;
    let table_cfg = cfg.clone();
    let openapi = web::Data::new(openapi::Document(
        openapi::document(&route_table(&cfg)).to_string().into(),
    ));
    let app = move || {
        let (resources, policies) = route_table(&table_cfg)
            .build()
            .expect("checked at start-up");
        let mut app = App::new()
            .app_data(data.clone())
            .app_data(limiters.clone())
            .app_data(web::Data::new(policies))
            .app_data(openapi.clone())
            .app_data(error::json_config(max_body))
            .app_data(error::payload_config(max_body))
            .app_data(error::query_config())
            .app_data(error::path_config())
            .default_service(web::to(|| async {
                ApiError::new(Code::NotFound, "no such route").error_response_owned()
            }));
        for r in resources {
            app = app.service(r);
        }
        // `wrap` makes the last one outermost: listed here innermost first.
        // The chain, in one layer: admission, the internal-header gate, the
        // route's policy, the request log, the envelope and the security
        // headers (steps 0 to 4, `chain::front`), then steps 5 to 11 (client rate limit …
        // namespace rate limit, `chain::steps`) and step 12: forwarding to
        // the member that owns the namespace, or a routed host's
        // deployment, or the router.
        app.wrap(from_fn(chain::front::front))
            .wrap(actix_web::middleware::Compress::default())
            .wrap(from_fn(middleware::probes))
            // Routed upstream requests: the chain's deployment steps in one.
            .wrap(from_fn(deploy_serve::routed_fast_path))
            // Outermost: an HTTP/2 refusal waits for the body it did not read.
            .wrap(from_fn(middleware::drain_h2_refusals))
    };
    let listener = listen(api).map_err(|e| {
        cannot_listen(
            &cfg.server.listen,
            "",
            "--listen HOST:PORT or MESHGATE_SERVER_LISTEN",
            e,
        )
    })?;
    let addr = listener.local_addr()?;
    let builder = actix_server::Server::build()
        .workers(workers)
        .disable_signals()
        .shutdown_timeout(cfg.server.drain_grace_seconds.max(1));
    let signal = builder.graceful_shutdown_signal();
    // A socket whose peer takes no byte of a write for two ping intervals is gone.
    let stall = std::time::Duration::from_secs(cfg.pubsub.ping_interval_seconds.max(1) * 2);
    // The service of one connection, as `HttpServer` configures it; small
    // frames (acks, pub/sub messages) go out at once rather than waiting
    // for the peer's delayed ACK (Nagle's algorithm).
    macro_rules! http_service {
        ($secure:expr) => {{
            let signal = signal.clone();
            let config = AppConfig::__priv_test_new($secure, addr.to_string(), addr);
            let fac = app().into_factory().map_err(|e| e.error_response());
            actix_http::HttpService::build()
                .graceful_shutdown_signal(move || {
                    let signal = signal.clone();
                    async move { signal.notified().await }
                })
                // `HttpServer`'s values (its disconnect timeout is not
                // actix-http's default).
                .keep_alive(actix_http::KeepAlive::default())
                .client_request_timeout(std::time::Duration::from_secs(5))
                .client_disconnect_timeout(std::time::Duration::from_secs(1))
                .tcp_nodelay(true)
                .local_addr(addr)
                .on_connect_ext(|io: &_, ext: _| tls::on_connect(io as &dyn std::any::Any, ext))
                .upgrade(upgrade::factory(app.clone(), config.clone(), stall))
                .finish(actix_service::map_config(fac, move |_| config.clone()))
        }};
    }
    // One port for HTTP/1.1 and HTTP/2: ALPN under TLS, prior knowledge (h2c) in clear.
    let mut grpc_tls = None;
    let builder = if cfg.tls.cert_file.is_empty() {
        builder.listen("meshgate", listener, move || {
            http_service!(false).tcp_auto_h2c()
        })
    } else {
        // A request by a name on the certificate is the node's: no
        // deployment may take one (`deploy::hosts`).
        let deployments = node.deployments.clone();
        let tls = tls::server_config(
            cfg.tls.cert_file.clone().into(),
            cfg.tls.key_file.clone().into(),
            node.deployments.certs.served.clone(),
            node.deployments.acme_alpn.clone(),
            std::time::Duration::from_secs(cfg.tls.reload_check_seconds),
            cfg.tls
                .acme
                .as_ref()
                .is_some_and(|a| a.challenge == "tls-alpn-01"),
            move |names: &[String]| {
                for n in names {
                    deployments
                        .own_names
                        .note(n, "a DNS name on this node's TLS certificate");
                }
                deployments.drop_reserved_certs();
            },
        )?;
        // The gRPC listener serves the same certificate, with ALPN h2 only.
        let mut g = tls.clone();
        g.alpn_protocols = vec![b"h2".to_vec()];
        grpc_tls = Some(tokio_rustls::TlsAcceptor::from(std::sync::Arc::new(g)));
        builder.listen("meshgate", listener, move || {
            http_service!(true).rustls_0_23(tls.clone())
        })
    }?;
    let (builder, grpc_addr) = match grpc_socket {
        None => (builder, None),
        Some(socket) => {
            let at = cfg.grpc_listen_addr().unwrap_or_default().to_string();
            let listener = listen(socket).map_err(|e| {
                cannot_listen(
                    &at,
                    " ([grpc] listen)",
                    "MESHGATE_GRPC_LISTEN or [grpc] listen",
                    e,
                )
            })?;
            let grpc_addr = listener.local_addr()?;
            let node = node.clone();
            let builder = builder.listen("meshgate-grpc", listener, move || {
                let ctx = std::rc::Rc::new(grpc::Ctx {
                    node: node.clone(),
                    limiters: shared_limiters.clone(),
                });
                let tls = grpc_tls.clone();
                actix_service::fn_service(move |tcp: actix_web::rt::net::TcpStream| {
                    let ctx = ctx.clone();
                    let tls = tls.clone();
                    async move {
                        grpc::serve_connection(ctx, tcp, tls).await;
                        Ok::<_, std::convert::Infallible>(())
                    }
                })
            })?;
            (builder, Some(grpc_addr))
        }
    };
    Ok((builder.run(), addr, grpc_addr))
}

/// A TCP socket bound as `HttpServer` binds one: the address reused.
fn bind_socket(addr: SocketAddr) -> std::io::Result<socket2::Socket> {
    let socket = socket2::Socket::new(
        socket2::Domain::for_address(addr),
        socket2::Type::STREAM,
        Some(socket2::Protocol::TCP),
    )?;
    socket.set_reuse_address(true)?;
    socket.bind(&addr.into())?;
    Ok(socket)
}

/// The bound socket listening, with `HttpServer`'s backlog of 1024.
fn listen(socket: socket2::Socket) -> std::io::Result<std::net::TcpListener> {
    socket.listen(1024)?;
    Ok(socket.into())
}

/// Serves `[metrics] listen` on its bound socket, when set: a second
/// listener (plain HTTP, one worker) that serves only `GET /metrics`, whole
/// and without a key, for a Prometheus scraper on a private interface;
/// anything else there is 404. It has no chain: no route of the node is
/// reachable through it.
pub fn serve_metrics(
    node: Node,
    socket: Option<socket2::Socket>,
) -> anyhow::Result<Option<(actix_web::dev::Server, SocketAddr)>> {
    let Some(socket) = socket else {
        return Ok(None);
    };
    let at = node
        .config
        .metrics_listen_addr()
        .unwrap_or_default()
        .to_string();
    let listener = listen(socket).map_err(|e| {
        cannot_listen(
            &at,
            " ([metrics] listen)",
            "MESHGATE_METRICS_LISTEN or [metrics] listen",
            e,
        )
    })?;
    let data = web::Data::new(node);
    let server = HttpServer::new(move || {
        App::new()
            .app_data(data.clone())
            .route(
                "/metrics",
                web::get().to(|node: web::Data<Node>| async move {
                    actix_web::HttpResponse::Ok()
                        .content_type("text/plain; version=0.0.4")
                        .body(
                            node.metrics
                                .render(node.config.metrics.namespace_series_limit),
                        )
                }),
            )
            .default_service(web::to(|| async {
                ApiError::new(Code::NotFound, "this listener serves only GET /metrics")
                    .error_response_owned()
            }))
    })
    .workers(1)
    .disable_signals()
    .shutdown_timeout(1)
    .listen(listener)
    .map_err(|e| anyhow::anyhow!("cannot listen on {at} ([metrics] listen): {e}"))?;
    let addr = server.addrs()[0];
    Ok(Some((server.run(), addr)))
}

/// Serves `[tls.acme] http_listen`, when set: plain HTTP answering only
/// ACME HTTP-01 challenges, `GET /.well-known/acme-challenge/{token}` with
/// the key authorization stored for the token by whichever node orders
/// (`deploy::acme`); an unknown token, and anything else, is 404. No chain:
/// nothing of the node is reachable through it.
pub fn serve_acme_http(
    node: Node,
    socket: Option<socket2::Socket>,
) -> anyhow::Result<Option<(actix_web::dev::Server, SocketAddr)>> {
    let Some(socket) = socket else {
        return Ok(None);
    };
    let listener = listen(socket)
        .map_err(|e| anyhow::anyhow!("cannot listen ([tls.acme] http_listen): {e}"))?;
    let data = web::Data::new(node);
    let server = HttpServer::new(move || {
        App::new()
            .app_data(data.clone())
            .route(
                "/.well-known/acme-challenge/{token}",
                web::get().to(
                    |node: web::Data<Node>, token: web::Path<String>| async move {
                        let token = token.into_inner();
                        if !crate::deploy::acme::valid_token(&token) {
                            return ApiError::new(Code::NotFound, "no such ACME challenge")
                                .error_response_owned();
                        }
                        match crate::storage::OrderedKv::get(
                            &node.store,
                            &crate::deploy::acme::http_token_key(&token),
                        )
                        .await
                        {
                            Ok(Some(ka)) => actix_web::HttpResponse::Ok()
                                .content_type("application/octet-stream")
                                .body(ka),
                            Ok(None) => ApiError::new(Code::NotFound, "no such ACME challenge")
                                .error_response_owned(),
                            Err(e) => ApiError::internal(e.to_string()).error_response_owned(),
                        }
                    },
                ),
            )
            .default_service(web::to(|| async {
                ApiError::new(
                    Code::NotFound,
                    "this listener serves only GET /.well-known/acme-challenge/{token}",
                )
                .error_response_owned()
            }))
    })
    .workers(1)
    .disable_signals()
    .shutdown_timeout(1)
    .listen(listener)
    .map_err(|e| anyhow::anyhow!("cannot listen ([tls.acme] http_listen): {e}"))?;
    let addr = server.addrs()[0];
    Ok(Some((server.run(), addr)))
}

#[cfg(test)]
mod tests {
    use super::request::SMALL_FUTURE;

    /// Every route of the node's table is an operation of the document, with
    /// its grant; every code of the table is in the envelope.
    #[test]
    fn every_route_and_code_is_in_the_document() {
        let mut cfg = crate::config::Config::default();
        cfg.debug.fault_injection = true;
        let doc = super::openapi::document(&super::route_table(&cfg));
        let table = super::route_table(&cfg);
        let mut n = 0;
        for (method, pattern, policy) in table.routes() {
            let op = &doc["paths"][super::openapi::openapi_path(pattern)]
                [method.as_str().to_ascii_lowercase()];
            assert!(op.is_object(), "{method} {pattern} missing");
            let policy = policy.expect("every route has a policy");
            assert_eq!(op["x-meshgate-policy"], policy.name(), "{method} {pattern}");
            if let Some((d, a)) = policy.grant()
                && !d.is_empty()
            {
                assert_eq!(
                    op["x-meshgate-grants"],
                    serde_json::json!([format!("{d}:{a}")])
                );
            }
            n += 1;
        }
        assert!(n > 50, "{n} routes");
        let codes = doc["components"]["schemas"]["Error"]["properties"]["error"]["properties"]
            ["code"]["enum"]
            .as_array()
            .expect("codes")
            .len();
        assert_eq!(codes, crate::error::Code::ALL.len());
        // Off by default, the debug routes are not in a default node's document.
        let plain =
            super::openapi::document(&super::route_table(&crate::config::Config::default()));
        assert!(plain["paths"]["/v1/namespaces/{name}/debug/panic"].is_null());
        assert!(plain["paths"]["/v1/debug/sleep"].is_null());
    }
    use super::state::Node;
    use actix_web::body::BoxBody;
    use actix_web::middleware::Next;

    /// The size of the future a function of two arguments returns.
    fn size2<A, B, F>(_: impl Fn(A, B) -> F) -> usize {
        size_of::<F>()
    }

    /// The chain's futures hold no rarely-taken kilobyte state inline: a
    /// store read inline on etcd (6.7 KiB) or a hop made every request's
    /// future that large, and actix moves it whole into a box (BENCHMARKS.md,
    /// "The request path's futures boxed where they are rare").
    #[test]
    fn chain_futures_stay_small() {
        for (what, size) in [
            (
                "routed_fast_path",
                size2(super::deploy_serve::routed_fast_path::<BoxBody>),
            ),
            (
                "probes",
                size2(|r, n: Next<BoxBody>| super::middleware::probes(r, n)),
            ),
            (
                "front",
                size2(|r, n: Next<BoxBody>| super::chain::front::front(r, n)),
            ),
            ("steps", size2(super::chain::steps::steps::<BoxBody>)),
            (
                "cluster_forward",
                size2(super::forward::cluster_forward::<BoxBody>),
            ),
            (
                "deployment_dispatch",
                size2(super::deploy_serve::deployment_dispatch::<BoxBody>),
            ),
            (
                "authenticate",
                size2(|n: &'static Node, c: &'static str| super::chain::access::authenticate(n, c)),
            ),
        ] {
            assert!(
                size < SMALL_FUTURE,
                "{what}'s future is {size} bytes: box the rarely-taken await that made it large"
            );
        }
    }
}
