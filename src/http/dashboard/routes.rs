//! The dashboard's routes: the page and its assets, the JSON API, the event
//! stream (all `Policy::Admin`: the operator key, or a session made from it, from
//! every address), and the sign-in form (public page, credential-bucket POST).

use super::board::Frame;
use super::session;
use crate::error::{ApiError, Code};
use crate::http::policy::{Policy, RouteTable};
use crate::http::state::Node;
use crate::identity::Identity;
use actix_web::http::Method;
use actix_web::http::header::{self, ContentEncoding};
use actix_web::{HttpMessage, HttpRequest, HttpResponse, web};
use bytes::Bytes;
use serde::Deserialize;
use serde_json::json;
use std::sync::Arc;

const INDEX_HTML: &str = include_str!("assets/index.html");
const APP_JS: &str = include_str!("assets/app.js");
const APP_CSS: &str = include_str!("assets/app.css");
const LOGIN_HTML: &str = include_str!("assets/login.html");

/// The page's scripts and styles come from the node only; no CDN, no inline code.
const PAGE_CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self'; \
     connect-src 'self'; img-src 'self' data:; form-action 'self'; frame-ancestors 'none'; base-uri 'none'";
/// The sign-in page has one inline stylesheet and no script.
const LOGIN_CSP: &str = "default-src 'none'; style-src 'unsafe-inline'; form-action 'self'; \
     frame-ancestors 'none'; base-uri 'none'";

pub fn register(t: &mut RouteTable) {
    t.add(Method::GET, "/__admin", Policy::Admin, web::get().to(index))
        .add(
            Method::GET,
            "/__admin/assets/{file}",
            Policy::Admin,
            web::get().to(asset),
        )
        .add(
            Method::GET,
            "/__admin/api/snapshot",
            Policy::Admin,
            web::get().to(api_snapshot),
        )
        .add(
            Method::GET,
            "/__admin/api/node",
            Policy::Admin,
            web::get().to(api_node),
        )
        .add(
            Method::GET,
            "/__admin/api/actors",
            Policy::Admin,
            web::get().to(api_actors),
        )
        .add(
            Method::GET,
            "/__admin/api/namespaces",
            Policy::Admin,
            web::get().to(api_namespaces),
        )
        .add(
            Method::GET,
            "/__admin/api/namespaces/search",
            Policy::Admin,
            web::get().to(api_search),
        )
        .add(
            Method::GET,
            "/__admin/api/history",
            Policy::Admin,
            web::get().to(api_history),
        )
        .add(
            Method::GET,
            "/__admin/api/stream",
            Policy::Admin,
            web::get().to(stream),
        )
        .add(
            Method::GET,
            "/__admin/login",
            Policy::Public,
            web::get().to(login_page),
        )
        .add(
            Method::POST,
            "/__admin/login",
            Policy::Credential,
            web::post().to(login),
        )
        .add(
            Method::POST,
            "/__admin/logout",
            Policy::Public,
            web::post().to(logout),
        );
}

fn page(body: &'static str, content_type: &'static str, csp: Option<&'static str>) -> HttpResponse {
    let mut r = HttpResponse::Ok();
    r.content_type(content_type)
        .insert_header((header::CACHE_CONTROL, "no-store"));
    if let Some(csp) = csp {
        r.insert_header((header::CONTENT_SECURITY_POLICY, csp));
    }
    r.body(body)
}

async fn index() -> HttpResponse {
    page(INDEX_HTML, "text/html; charset=utf-8", Some(PAGE_CSP))
}

async fn asset(file: web::Path<String>) -> Result<HttpResponse, ApiError> {
    match file.as_str() {
        "app.js" => Ok(page(APP_JS, "text/javascript; charset=utf-8", None)),
        "app.css" => Ok(page(APP_CSS, "text/css; charset=utf-8", None)),
        _ => Err(ApiError::new(Code::NotFound, "no such asset")),
    }
}

/// The latest frame; the request keeps the sampler ticking a while (it takes
/// no snapshot while nobody watches) and waits for a first frame after a pause.
async fn latest(node: &Node) -> Arc<Frame> {
    node.dashboard.fresh().await
}

async fn api_snapshot(node: web::Data<Node>) -> HttpResponse {
    HttpResponse::Ok().json(&*latest(&node).await.snapshot)
}

async fn api_node(node: web::Data<Node>) -> HttpResponse {
    let f = latest(&node).await;
    HttpResponse::Ok().json(json!({"at_ms": f.snapshot.at_ms, "tick": f.snapshot.tick,
        "viewers": node.dashboard.viewers(), "node": f.snapshot.node}))
}

async fn api_actors(node: web::Data<Node>) -> HttpResponse {
    let f = latest(&node).await;
    HttpResponse::Ok().json(
        json!({"at_ms": f.snapshot.at_ms, "tick": f.snapshot.tick, "actors": f.snapshot.actors}),
    )
}

async fn api_namespaces(node: web::Data<Node>) -> HttpResponse {
    let f = latest(&node).await;
    HttpResponse::Ok().json(json!({"at_ms": f.snapshot.at_ms, "tick": f.snapshot.tick,
        "namespaces": f.snapshot.namespaces}))
}

#[derive(Deserialize)]
struct SearchQuery {
    /// Part of a namespace name.
    #[serde(default)]
    q: String,
}

/// Namespaces whose name contains `q`, with this tick's numbers: how the page
/// finds a namespace outside the top N. At most `SEARCH_LIMIT` rows; `matched`
/// counts them all.
async fn api_search(
    node: web::Data<Node>,
    q: web::Query<SearchQuery>,
) -> Result<HttpResponse, ApiError> {
    let q = q.into_inner().q;
    if q.trim().is_empty() || q.len() > 63 {
        return Err(ApiError::new(
            Code::BadRequest,
            "q: 1 to 63 characters of a namespace name",
        ));
    }
    let f = latest(&node).await;
    let (rows, matched) = f.snapshot.search(&q);
    Ok(
        HttpResponse::Ok().json(json!({"at_ms": f.snapshot.at_ms, "tick": f.snapshot.tick,
        "query": q.trim().to_lowercase(), "matched": matched, "namespaces": rows})),
    )
}

async fn api_history(node: web::Data<Node>) -> HttpResponse {
    node.dashboard.fresh().await;
    HttpResponse::Ok().json(json!({
        "interval_ms": super::sampler::TICK_INTERVAL.as_millis() as u64,
        "capacity": super::board::HISTORY_LEN,
        "points": node.dashboard.history(),
    }))
}

/// Server-sent events: the latest frame at once, then each new one. Every viewer
/// sends the same pre-rendered bytes; a viewer that falls behind skips to the
/// newest frame instead of queueing old ones. Ends when the node drains, and
/// a stream opened with a session cookie ends when its session does (checked
/// before each frame; the session cache keeps that to a store read every few
/// seconds).
async fn stream(req: HttpRequest, node: web::Data<Node>) -> Result<HttpResponse, ApiError> {
    let by_session = req
        .extensions()
        .get::<Identity>()
        .is_some_and(|i| i.kind == "admin_session");
    let session = by_session
        .then(|| session::cookie_value(req.headers()))
        .flatten()
        .map(|token| (node.get_ref().clone(), token));
    let guard = node
        .dashboard
        .admit_viewer()
        .ok_or_else(|| ApiError::overloaded("too many dashboard streams are open"))?;
    let mut frames = node.dashboard.subscribe();
    frames.mark_changed();
    let draining = node.draining.subscribe();
    let first = Bytes::from_static(b"retry: 2000\n\n");
    let state = (Some(first), frames, draining, guard, session);
    let body = futures_util::stream::unfold(
        state,
        |(pending, mut frames, mut draining, guard, session)| async move {
            if let Some(b) = pending {
                return Some((
                    Ok::<_, actix_web::Error>(b),
                    (None, frames, draining, guard, session),
                ));
            }
            let stop = tokio::select! {
                changed = frames.changed() => changed.is_err(),
                _ = draining.wait_for(|d| *d) => true,
            };
            if stop {
                return None;
            }
            if let Some((node, token)) = &session
                && !session::is_open(node, token).await
            {
                return None;
            }
            let bytes = frames.borrow_and_update().sse.clone();
            Some((Ok(bytes), (None, frames, draining, guard, session)))
        },
    );
    Ok(HttpResponse::Ok()
        .content_type("text/event-stream")
        .insert_header((header::CACHE_CONTROL, "no-store"))
        // Compression would hold events back in the encoder's buffer.
        .insert_header(ContentEncoding::Identity)
        .insert_header(("x-accel-buffering", "no"))
        .streaming(body))
}

#[derive(Deserialize)]
struct LoginQuery {
    #[serde(default)]
    failed: Option<String>,
}

async fn login_page(q: web::Query<LoginQuery>) -> HttpResponse {
    let msg = if q.failed.is_some() {
        r#"<p class="err" role="alert">That is not the operator key.</p>"#
    } else {
        ""
    };
    HttpResponse::Ok()
        .content_type("text/html; charset=utf-8")
        .insert_header((header::CACHE_CONTROL, "no-store"))
        .insert_header((header::CONTENT_SECURITY_POLICY, LOGIN_CSP))
        .body(LOGIN_HTML.replace("<!--MESSAGE-->", msg))
}

#[derive(Deserialize)]
struct LoginForm {
    key: String,
}

fn see_other(location: &str, cookie: String) -> HttpResponse {
    HttpResponse::SeeOther()
        .insert_header((header::LOCATION, location))
        .insert_header((header::SET_COOKIE, cookie))
        .insert_header((header::CACHE_CONTROL, "no-store"))
        .finish()
}

/// Checks the operator key and opens a session (see [`session`]); a wrong key goes
/// back to the form. In the credential rate bucket, so guessing is capped.
async fn login(
    req: HttpRequest,
    node: web::Data<Node>,
    form: web::Form<LoginForm>,
) -> Result<HttpResponse, ApiError> {
    if !node.secrets.is_operator_key(form.key.trim()) {
        tracing::warn!("Dashboard sign-in refused.");
        return Ok(see_other(
            "/__admin/login?failed=1",
            session::clear_cookie(),
        ));
    }
    let token = session::open(&node).await?;
    let secure = req.connection_info().scheme() == "https";
    tracing::info!("Dashboard session opened.");
    Ok(see_other("/__admin", session::set_cookie(&token, secure)))
}

/// Ends the cookie's session in the store (on every node: the record is
/// gone) and clears the cookie.
async fn logout(req: HttpRequest, node: web::Data<Node>) -> Result<HttpResponse, ApiError> {
    if let Some(token) = session::cookie_value(req.headers()) {
        session::close(&node, &token).await?;
        tracing::info!("Dashboard session ended.");
    }
    Ok(see_other("/__admin/login", session::clear_cookie()))
}
