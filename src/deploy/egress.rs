//! The egress policy of upstream deployments (docs/deployments.md, "Egress
//! policy"). An upstream is a tenant's choice of where the node connects, so
//! by default it may not reach what the tenant does not own: no loopback,
//! unspecified, link-local (cloud metadata), private, CGNAT, multicast,
//! broadcast or reserved address, in any spelling (IPv4, IPv6, IPv4-mapped,
//! -compatible, -translated, NAT64 and 6to4 IPv6, and the decimal, octal and
//! hex IPv4 forms resolvers accept), and none of the node's own listen,
//! advertise, gossip or etcd addresses.
//!
//! Checked when a deployment is created (and rolled back), on the literal
//! address or on every address its name resolves to; and again when the proxy
//! connects, on the addresses actually connected: the proxy's client resolves
//! through [`CheckedResolver`], so a name that re-resolves to a forbidden
//! address is never connected.
//!
//! `[deploy] upstream_allow` opens ranges (CIDR), `upstream_deny` closes more
//! and wins. The node's own addresses (its listeners, etcd's client and peer
//! URLs, every cluster member's API and gossip addresses, learned by the
//! node and never forgotten: [`EgressPolicy::set_own`]) stay closed whatever `upstream_allow`
//! says, unless `[deploy] upstream_allow_own = true`.

use crate::config::DeployConfig;
use crate::error::ApiError;
use crate::error::Code;
use ipnet::IpNet;
use parking_lot::RwLock;
use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::path::PathBuf;
use std::sync::{Arc, LazyLock};
use std::time::Duration;

/// Test hook: names resolve from this hosts-format file only (re-read at every
/// lookup; no DNS at all). Never set it in production.
pub const TEST_RESOLVE_ENV: &str = "MESHGATE_TEST_RESOLVE_FILE";

pub use crate::config::parse_range;

/// A range no upstream reaches by default.
#[derive(Debug, Clone, Copy)]
pub struct Rule {
    /// The range the rule covers; an address in it is refused unless `upstream_allow` has it.
    pub net: IpNet,
    /// Its short name: `loopback`, `unspecified`, `link-local`, `private`,
    /// `cgnat`, `multicast`, `broadcast` or `reserved`.
    pub kind: &'static str,
    /// What it is, in words.
    pub what: &'static str,
}

/// The built-in rules, first match wins.
static RULES: LazyLock<Vec<Rule>> = LazyLock::new(|| {
    [
        (
            "0.0.0.0/8",
            "unspecified",
            "an unspecified (\"this network\") address",
        ),
        ("127.0.0.0/8", "loopback", "a loopback address"),
        (
            "169.254.0.0/16",
            "link-local",
            "a link-local (cloud metadata) address",
        ),
        ("10.0.0.0/8", "private", "a private address"),
        ("172.16.0.0/12", "private", "a private address"),
        ("192.168.0.0/16", "private", "a private address"),
        ("100.64.0.0/10", "cgnat", "a CGNAT (shared) address"),
        ("224.0.0.0/4", "multicast", "a multicast address"),
        ("255.255.255.255/32", "broadcast", "the broadcast address"),
        ("240.0.0.0/4", "reserved", "a reserved address"),
        ("::/128", "unspecified", "the unspecified address"),
        ("::1/128", "loopback", "the loopback address"),
        ("fe80::/10", "link-local", "a link-local address"),
        ("fc00::/7", "private", "a private (unique local) address"),
        ("fec0::/10", "private", "a private (site-local) address"),
        (
            "64:ff9b:1::/48",
            "private",
            "a private (local-use NAT64) address",
        ),
        ("ff00::/8", "multicast", "a multicast address"),
    ]
    .into_iter()
    .map(|(net, kind, what)| Rule {
        net: net.parse().expect("static range"),
        kind,
        what,
    })
    .collect()
});

/// The built-in rule an address falls under, read as given (the IPv4 address an
/// IPv6 one carries is checked separately).
pub fn builtin_rule(ip: IpAddr) -> Option<Rule> {
    RULES.iter().find(|r| r.net.contains(&ip)).copied()
}

/// The IPv4 address an IPv6 one carries, and how: mapped (`::ffff:a.b.c.d`),
/// translated (`::ffff:0:a.b.c.d`), compatible (`::a.b.c.d`), NAT64
/// (`64:ff9b::a.b.c.d`) or 6to4 (`2002:aabb:ccdd::`).
pub fn embedded_v4(ip: Ipv6Addr) -> Option<(Ipv4Addr, &'static str)> {
    let s = ip.segments();
    let o = ip.octets();
    let tail = Ipv4Addr::new(o[12], o[13], o[14], o[15]);
    match s {
        [0, 0, 0, 0, 0, 0xffff, _, _] => Some((tail, "IPv4-mapped")),
        [0, 0, 0, 0, 0xffff, 0, _, _] => Some((tail, "IPv4-translated")),
        // `::` and `::1` are IPv6's own unspecified and loopback.
        [0, 0, 0, 0, 0, 0, 0, 0 | 1] => None,
        [0, 0, 0, 0, 0, 0, _, _] => Some((tail, "IPv4-compatible")),
        [0x64, 0xff9b, 0, 0, 0, 0, _, _] => Some((tail, "NAT64")),
        [0x2002, ..] => Some((Ipv4Addr::new(o[2], o[3], o[4], o[5]), "6to4")),
        _ => None,
    }
}

/// An address as given, and the IPv4 address it carries (with how), if any.
type Forms = [Option<(IpAddr, Option<&'static str>)>; 2];

/// The address itself, and the IPv4 address it carries (with how), if any
/// (no allocation: this runs on every proxied request to a literal address).
fn forms(ip: IpAddr) -> Forms {
    let carried = match ip {
        IpAddr::V6(v6) => embedded_v4(v6).map(|(v4, how)| (IpAddr::V4(v4), Some(how))),
        IpAddr::V4(_) => None,
    };
    [Some((ip, None)), carried]
}

/// An address as the node compares it with its own: IPv4-mapped IPv6 as IPv4.
fn canonical(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => v6
            .to_ipv4_mapped()
            .map(IpAddr::V4)
            .unwrap_or(IpAddr::V6(v6)),
        v4 => v4,
    }
}

/// An IPv4 address in the forms `inet_aton` (and so most resolvers) accept:
/// one to four dot-separated parts, each decimal, octal (`0` prefix) or hex
/// (`0x` prefix), the last filling the remaining bytes (`127.1`, `2130706433`,
/// `0x7f.1`, `0177.0.0.1`).
pub fn inet_aton(s: &str) -> Option<Ipv4Addr> {
    let parts: Vec<&str> = s.split('.').collect();
    if parts.is_empty() || parts.len() > 4 {
        return None;
    }
    let mut nums = Vec::with_capacity(4);
    for p in &parts {
        let (digits, radix) = if let Some(h) = p.strip_prefix("0x").or(p.strip_prefix("0X")) {
            (h, 16)
        } else if p.len() > 1 && p.starts_with('0') {
            (&p[1..], 8)
        } else {
            (*p, 10)
        };
        if radix == 10 && digits.is_empty() || !digits.chars().all(|c| c.is_digit(radix)) {
            return None;
        }
        let v = if digits.is_empty() {
            0
        } else {
            u32::from_str_radix(digits, radix).ok()?
        };
        nums.push(v);
    }
    let (last, init) = nums.split_last()?;
    if init.iter().any(|&n| n > 0xff) {
        return None;
    }
    let room = 32 - 8 * init.len() as u32;
    if room < 32 && *last >> room != 0 {
        return None;
    }
    let mut v = *last;
    for (i, n) in init.iter().enumerate() {
        v |= n << (24 - 8 * i as u32);
    }
    Some(Ipv4Addr::from(v))
}

/// The address a URL host names literally, in any spelling (`[::1]`,
/// `127.0.0.1`, `127.1`, `0x7f000001`, a trailing dot); None for a name.
pub fn literal_ip(host: &str) -> Option<IpAddr> {
    if let Some(inner) = host.strip_prefix('[').and_then(|h| h.strip_suffix(']')) {
        return inner.parse::<Ipv6Addr>().ok().map(IpAddr::V6);
    }
    let h = host.strip_suffix('.').unwrap_or(host);
    h.parse::<IpAddr>()
        .ok()
        .or_else(|| inet_aton(h).map(IpAddr::V4))
}

/// `scheme://host[:port]` split into host and port (the scheme's default).
pub fn host_port(base: &str) -> Option<(String, u16)> {
    let uri: actix_web::http::Uri = base.parse().ok()?;
    let host = uri.host()?.to_string();
    let port = uri.port_u16().or(match uri.scheme_str() {
        Some("http") | Some("ws") => Some(80),
        Some("https") | Some("wss") => Some(443),
        _ => None,
    })?;
    Some((host, port))
}

/// The literal socket address of an instance base URL, if its host is an address.
pub fn literal_addr(base: &str) -> Option<SocketAddr> {
    let (host, port) = host_port(base)?;
    literal_ip(&host).map(|ip| SocketAddr::new(ip, port))
}

/// Names under `localhost` are loopback (RFC 6761), whatever DNS says.
fn is_localhost(name: &str) -> bool {
    name == "localhost" || name.ends_with(".localhost")
}

/// Why an address is refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    /// `loopback`, `private`, ..., `own` or `deny`: the rule's short name.
    pub kind: &'static str,
    /// The address refused (`127.0.0.1:2379`).
    pub addr: String,
    /// The rule, in words (`a loopback address (127.0.0.0/8)`).
    pub rule: String,
    /// The name that resolved to it, if any.
    pub name: Option<String>,
}

impl fmt::Display for Refusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.name {
            Some(n) => write!(f, "{n} resolves to {}, {}", self.addr, self.rule),
            None => write!(f, "{} is {}", self.addr, self.rule),
        }
    }
}

/// A checked lookup's failure: a refused address, or no address at all.
#[derive(Debug)]
pub enum EgressError {
    Forbidden(Refusal),
    Unresolved(String),
}

impl fmt::Display for EgressError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            EgressError::Forbidden(r) => write!(f, "forbidden by the egress policy: {r}"),
            EgressError::Unresolved(e) => write!(f, "{e}"),
        }
    }
}

impl std::error::Error for EgressError {}

/// How upstream names become addresses.
#[derive(Debug, Clone)]
pub enum Resolver {
    /// The system's resolver (`getaddrinfo`).
    System,
    /// Test only: a hosts-format file (`<address> <name>...` per line, `#`
    /// comments), re-read at every lookup; a name it lacks does not resolve.
    HostsFile(PathBuf),
}

/// One of the node's own addresses.
#[derive(Debug, Clone, PartialEq, Eq)]
enum OwnHost {
    Ip(IpAddr),
    Name(String),
}

#[derive(Debug, Clone)]
struct Own {
    /// Which of the node's addresses this is ("this node's own listen
    /// address", "the etcd peer URL of member m1", ...), named in the refusal.
    what: Arc<str>,
    /// The address, or the name as configured (names are also noted resolved).
    host: OwnHost,
    /// The port it listens on: only this port of the host counts as the node itself.
    port: u16,
}

/// The policy: the operator's ranges, the node's own addresses, the resolver.
pub struct EgressPolicy {
    /// `[deploy] upstream_allow`: ranges exempt from the built-in rules (and, for an
    /// exact address, from the own-address check).
    allow: Vec<IpNet>,
    /// `[deploy] upstream_deny`: ranges always refused, checked before everything else.
    deny: Vec<IpNet>,
    /// `[deploy] upstream_allow_own`: the node's own addresses are judged like
    /// any other (by the rules and `allow`) instead of always refused.
    allow_own: bool,
    /// The node's own addresses, noted at start, so an upstream cannot loop back into it.
    own: RwLock<Vec<Own>>,
    /// How upstream names resolve: the system's, or a hosts file in tests.
    resolver: Resolver,
    /// Limit on one name lookup: the connect timeout, at least one second.
    lookup_timeout: Duration,
}

impl EgressPolicy {
    /// From `[deploy]` (ranges already validated; a bad one is skipped) and
    /// the test hook's environment variable.
    pub fn from_config(cfg: &DeployConfig) -> EgressPolicy {
        let resolver = match std::env::var_os(TEST_RESOLVE_ENV) {
            Some(p) if !p.is_empty() => {
                tracing::warn!(
                    file = %PathBuf::from(&p).display(),
                    "{TEST_RESOLVE_ENV} is set: upstream names resolve from this file only (a test hook; never set it in production)."
                );
                Resolver::HostsFile(PathBuf::from(p))
            }
            _ => Resolver::System,
        };
        let ranges = |l: &[String]| l.iter().filter_map(|r| parse_range(r)).collect();
        EgressPolicy {
            allow: ranges(&cfg.upstream_allow),
            deny: ranges(&cfg.upstream_deny),
            allow_own: cfg.upstream_allow_own,
            own: RwLock::new(Vec::new()),
            resolver,
            lookup_timeout: Duration::from_secs(cfg.connect_timeout_seconds.max(1)),
        }
    }

    /// The same policy resolving names through `resolver` instead.
    pub fn with_resolver(mut self, resolver: Resolver) -> EgressPolicy {
        self.resolver = resolver;
        self
    }

    /// Notes one of the node's own addresses (`what`: "listen address", ...);
    /// a name is kept as a name and also resolved, each address noted.
    pub async fn note_own(&self, what: &'static str, host: &str, port: u16) {
        let what: Arc<str> = format!("this node's own {what}").into();
        let entries = self.own_entries(&what, None, host, port).await;
        let mut own = self.own.write();
        for e in entries {
            if !own.iter().any(|o| o.host == e.host && o.port == e.port) {
                own.push(e);
            }
        }
    }

    /// Adds to the own addresses of `source` ("etcd members", "cluster
    /// members", ...) the `entries` (what each is, host, port), names
    /// resolved first: the node calls it whenever the etcd member list or the
    /// cluster registry may have changed, so a member that joins is refused
    /// from then on. The set only grows: a member missing from a later update
    /// (it left, or a store writer deleted its registry record) stays refused
    /// for the life of the process, as does an address a name resolved to
    /// once; a departed member's port is nobody a tenant should reach either.
    pub async fn set_own(&self, source: &'static str, entries: &[(String, String, u16)]) {
        let mut fresh = Vec::new();
        for (what, host, port) in entries {
            let what: Arc<str> = what.as_str().into();
            fresh.extend(self.own_entries(&what, Some(source), host, *port).await);
        }
        let mut own = self.own.write();
        for e in fresh {
            if !own.iter().any(|o| o.host == e.host && o.port == e.port) {
                own.push(e);
            }
        }
    }

    /// One own address as entries: the address, or the name and each address
    /// it resolves to now.
    async fn own_entries(
        &self,
        what: &Arc<str>,
        source: Option<&'static str>,
        host: &str,
        port: u16,
    ) -> Vec<Own> {
        let mut hosts = Vec::new();
        match literal_ip(host) {
            Some(ip) => hosts.push(OwnHost::Ip(canonical(ip))),
            None => {
                let name = host.trim_end_matches('.').to_ascii_lowercase();
                hosts.push(OwnHost::Name(name));
                match self.lookup(host, port).await {
                    Ok(addrs) => hosts.extend(addrs.iter().map(|a| OwnHost::Ip(canonical(a.ip())))),
                    // Refreshed sets are re-resolved at each update: quieter.
                    Err(e) if source.is_some() => {
                        tracing::debug!(host, error = %e, "Could not resolve one of the cluster's addresses; it is refused by name only.")
                    }
                    Err(e) => {
                        tracing::warn!(host, error = %e, "Could not resolve one of the node's own addresses; it is refused by name only.")
                    }
                }
            }
        }
        hosts
            .into_iter()
            .map(|host| Own {
                what: what.clone(),
                host,
                port,
            })
            .collect()
    }

    /// Whether one of the operator's allow entries contains `ip` (any form).
    fn allowed(&self, forms: &Forms) -> bool {
        forms
            .iter()
            .flatten()
            .any(|(f, _)| self.allow.iter().any(|n| n.contains(f)))
    }

    /// Which of the node's own addresses `(ip, port)` is, if it is one.
    fn own_match(&self, ip: IpAddr, port: u16) -> Option<Arc<str>> {
        if self.allow_own {
            return None;
        }
        let t = canonical(ip);
        self.own.read().iter().find_map(|o| match o.host {
            OwnHost::Ip(mine) if o.port == port => {
                let hit = t == mine
                    // Connecting to 0.0.0.0 or :: reaches the local host.
                    || t.is_unspecified()
                    // A node listening on every address is reached on each local one.
                    || mine.is_unspecified() && is_local(t);
                hit.then(|| o.what.clone())
            }
            _ => None,
        })
    }

    /// Checks one address an upstream would connect to.
    pub fn check_addr(&self, ip: IpAddr, port: u16) -> Result<(), Refusal> {
        let forms = forms(ip);
        let refuse = |kind, rule| Refusal {
            kind,
            addr: SocketAddr::new(ip, port).to_string(),
            rule,
            name: None,
        };
        for (f, _) in forms.iter().flatten() {
            if let Some(n) = self.deny.iter().find(|n| n.contains(f)) {
                return Err(refuse("deny", format!("in [deploy] upstream_deny ({n})")));
            }
        }
        if let Some(what) = self.own_match(ip, port) {
            return Err(refuse("own", what.to_string()));
        }
        for (f, how) in forms.iter().flatten() {
            if let Some(rule) = builtin_rule(*f)
                && !self.allowed(&forms)
            {
                let how = how.map(|h| format!(", {h} IPv6")).unwrap_or_default();
                return Err(refuse(
                    rule.kind,
                    format!("{} ({}{how})", rule.what, rule.net),
                ));
            }
        }
        Ok(())
    }

    /// The addresses `host` stands for: itself when it is an address in any
    /// spelling, loopback for `localhost` names, else the resolver's answer.
    pub async fn lookup(&self, host: &str, port: u16) -> Result<Vec<SocketAddr>, EgressError> {
        if let Some(ip) = literal_ip(host) {
            return Ok(vec![SocketAddr::new(ip, port)]);
        }
        let name = host.trim_end_matches('.').to_ascii_lowercase();
        if is_localhost(&name) {
            return Ok(vec![SocketAddr::new(Ipv4Addr::LOCALHOST.into(), port)]);
        }
        let addrs: Vec<SocketAddr> = match &self.resolver {
            Resolver::HostsFile(path) => {
                let text = std::fs::read_to_string(path).map_err(|e| {
                    EgressError::Unresolved(format!(
                        "the test resolve file {} cannot be read: {e}",
                        path.display()
                    ))
                })?;
                hosts_file_lookup(&text, &name)
                    .into_iter()
                    .map(|ip| SocketAddr::new(ip, port))
                    .collect()
            }
            Resolver::System => {
                match tokio::time::timeout(
                    self.lookup_timeout,
                    tokio::net::lookup_host((name.as_str(), port)),
                )
                .await
                {
                    Ok(Ok(a)) => a.collect(),
                    Ok(Err(e)) => {
                        return Err(EgressError::Unresolved(format!(
                            "{name} does not resolve: {e}"
                        )));
                    }
                    Err(_) => {
                        return Err(EgressError::Unresolved(format!(
                            "resolving {name} took too long"
                        )));
                    }
                }
            }
        };
        if addrs.is_empty() {
            return Err(EgressError::Unresolved(format!(
                "{name} resolves to no address"
            )));
        }
        Ok(addrs)
    }

    /// Resolves `host` and checks every address: all of them, or a refusal.
    pub async fn resolve_checked(
        &self,
        host: &str,
        port: u16,
    ) -> Result<Vec<SocketAddr>, EgressError> {
        let name = host.trim_end_matches('.').to_ascii_lowercase();
        let literal = literal_ip(host).is_some();
        if !literal && !self.allow_own {
            let own = self.own.read().iter().find_map(|o| match &o.host {
                OwnHost::Name(n) if *n == name && o.port == port => Some(o.what.clone()),
                _ => None,
            });
            if let Some(what) = own {
                return Err(EgressError::Forbidden(Refusal {
                    kind: "own",
                    addr: format!("{name}:{port}"),
                    rule: what.to_string(),
                    name: None,
                }));
            }
        }
        let addrs = self.lookup(host, port).await?;
        for a in &addrs {
            self.check_addr(a.ip(), a.port()).map_err(|mut r| {
                if !literal {
                    r.name = Some(name.clone());
                }
                EgressError::Forbidden(r)
            })?;
        }
        Ok(addrs)
    }

    /// The check of a deployment's instance when it is created or rolled back:
    /// 400 `UPSTREAM_FORBIDDEN` naming the address and the rule, or 400
    /// `UPSTREAM_UNRESOLVABLE` for a name without addresses.
    pub async fn check_instance(&self, base: &str) -> Result<(), ApiError> {
        let Some((host, port)) = host_port(base) else {
            return Err(ApiError::new(
                Code::InvalidUpstream,
                format!("upstream {base:?} has no host"),
            ));
        };
        match self.resolve_checked(&host, port).await {
            Ok(_) => Ok(()),
            Err(EgressError::Forbidden(r)) => Err(forbidden_at_create(base, &r)),
            Err(EgressError::Unresolved(e)) => Err(ApiError::new(
                Code::UpstreamUnresolvable,
                format!(
                    "upstream {base}: {e}; every address an upstream name resolves to is checked, so it must resolve when it is deployed"
                ),
            )),
        }
    }
}

/// 400 `UPSTREAM_FORBIDDEN` for a refused instance.
pub fn forbidden_at_create(base: &str, r: &Refusal) -> ApiError {
    ApiError::new(
        Code::UpstreamForbidden,
        format!(
            "upstream {base} is refused by the egress policy: {r} (an operator opens ranges with [deploy] upstream_allow)"
        ),
    )
}

/// 502 `UPSTREAM_FORBIDDEN` when the proxy would connect to a refused address.
pub fn forbidden_at_connect(r: &Refusal) -> ApiError {
    ApiError::with_status(
        actix_web::http::StatusCode::BAD_GATEWAY,
        Code::UpstreamForbidden,
        format!("the egress policy forbids this upstream's address: {r}"),
    )
}

/// The addresses a hosts-format text gives `name`.
fn hosts_file_lookup(text: &str, name: &str) -> Vec<IpAddr> {
    let mut out = Vec::new();
    for line in text.lines() {
        let line = line.split('#').next().unwrap_or_default();
        let mut words = line.split_whitespace();
        let Some(ip) = words.next().and_then(|w| w.parse::<IpAddr>().ok()) else {
            continue;
        };
        if words.any(|w| w.trim_end_matches('.').eq_ignore_ascii_case(name)) {
            out.push(ip);
        }
    }
    out
}

/// Whether `ip` is one of this host's addresses: loopback, or one a socket
/// can be bound to (binding sends nothing).
fn is_local(ip: IpAddr) -> bool {
    ip.is_loopback() || std::net::UdpSocket::bind(SocketAddr::new(ip, 0)).is_ok()
}

/// The resolver of the proxy's client: every address a name resolves to is
/// checked, and only checked addresses are connected. (Hosts that are address
/// literals in Rust's own syntax never reach a resolver; the proxy checks
/// those itself before each attempt.)
pub(crate) struct CheckedResolver(pub Arc<EgressPolicy>);

impl actix_tls::connect::Resolve for CheckedResolver {
    fn lookup<'a>(
        &'a self,
        host: &'a str,
        port: u16,
    ) -> futures_util::future::LocalBoxFuture<'a, Result<Vec<SocketAddr>, Box<dyn std::error::Error>>>
    {
        Box::pin(async move {
            self.0
                .resolve_checked(host, port)
                .await
                .map_err(|e| Box::new(e) as Box<dyn std::error::Error>)
        })
    }
}

/// The refusal inside a failed connection attempt, if that is why it failed.
pub fn refusal_of(e: &awc::error::ConnectError) -> Option<&Refusal> {
    match e {
        awc::error::ConnectError::Resolver(inner) => match inner.downcast_ref::<EgressError>() {
            Some(EgressError::Forbidden(r)) => Some(r),
            _ => None,
        },
        _ => None,
    }
}

/// `/ip4/<a>/tcp/<port>` (or ip6, dns*, udp) as host and port.
pub fn multiaddr_host_port(s: &str) -> Option<(String, u16)> {
    let p: Vec<&str> = s.split('/').collect();
    if !matches!(*p.get(1)?, "ip4" | "ip6" | "dns" | "dns4" | "dns6")
        || !matches!(*p.get(3)?, "tcp" | "udp")
    {
        return None;
    }
    Some((p.get(2)?.to_string(), p.get(4)?.parse().ok()?))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A policy whose names resolve from `hosts` (a file in `dir`) only: no
    /// unit test ever asks DNS.
    fn policy(dir: &tempfile::TempDir, allow: &[&str], deny: &[&str]) -> EgressPolicy {
        let cfg = DeployConfig {
            upstream_allow: allow.iter().map(|s| s.to_string()).collect(),
            upstream_deny: deny.iter().map(|s| s.to_string()).collect(),
            ..DeployConfig::default()
        };
        EgressPolicy::from_config(&cfg).with_resolver(Resolver::HostsFile(dir.path().join("hosts")))
    }

    fn write_hosts(dir: &tempfile::TempDir, text: &str) {
        std::fs::write(dir.path().join("hosts"), text).unwrap();
    }

    async fn kind_of(p: &EgressPolicy, host: &str, port: u16) -> Option<&'static str> {
        match p.resolve_checked(host, port).await {
            Ok(_) => None,
            Err(EgressError::Forbidden(r)) => Some(r.kind),
            Err(EgressError::Unresolved(e)) => panic!("{host}: {e}"),
        }
    }

    /// Every spelling of every forbidden range is refused, with its rule.
    #[tokio::test]
    async fn every_spelling_of_a_forbidden_address_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let p = policy(&dir, &[], &[]);
        for (host, want) in [
            ("127.0.0.1", "loopback"),
            ("127.255.255.254", "loopback"),
            ("127.1", "loopback"),
            ("2130706433", "loopback"),
            ("0x7f.1", "loopback"),
            ("0X7F.0.0.1", "loopback"),
            ("0177.0.0.1", "loopback"),
            ("0x7f000001", "loopback"),
            ("017700000001", "loopback"),
            ("127.0.0.1.", "loopback"),
            ("[::1]", "loopback"),
            ("[0:0:0:0:0:0:0:1]", "loopback"),
            ("[::ffff:127.0.0.1]", "loopback"),
            ("[::ffff:7f00:1]", "loopback"),
            ("[::ffff:0:127.0.0.1]", "loopback"),
            ("[::127.0.0.1]", "loopback"),
            ("[64:ff9b::127.0.0.1]", "loopback"),
            ("[2002:7f00:1::]", "loopback"),
            ("localhost", "loopback"),
            ("LocalHost.", "loopback"),
            ("app.localhost", "loopback"),
            ("0.0.0.0", "unspecified"),
            ("0", "unspecified"),
            ("0.1.2.3", "unspecified"),
            ("[::]", "unspecified"),
            ("[::ffff:0.0.0.0]", "unspecified"),
            ("169.254.169.254", "link-local"),
            ("0xa9fea9fe", "link-local"),
            ("2852039166", "link-local"),
            ("[::ffff:169.254.169.254]", "link-local"),
            ("[fe80::1]", "link-local"),
            ("10.0.0.1", "private"),
            ("10.255.255.255", "private"),
            ("10.1", "private"),
            ("012.0.0.1", "private"),
            ("172.16.0.1", "private"),
            ("172.31.255.255", "private"),
            ("192.168.1.1", "private"),
            ("[::ffff:10.0.0.1]", "private"),
            ("[::ffff:a00:1]", "private"),
            ("[fc00::1]", "private"),
            ("[fd00:ec2::254]", "private"),
            ("[fec0::1]", "private"),
            ("[64:ff9b:1::a00:1]", "private"),
            ("100.64.0.1", "cgnat"),
            ("100.127.255.255", "cgnat"),
            ("[::ffff:100.100.100.200]", "cgnat"),
            ("224.0.0.1", "multicast"),
            ("239.255.255.250", "multicast"),
            ("[ff02::1]", "multicast"),
            ("255.255.255.255", "broadcast"),
            ("4294967295", "broadcast"),
            ("240.0.0.1", "reserved"),
        ] {
            assert_eq!(kind_of(&p, host, 80).await, Some(want), "{host}");
        }
    }

    /// Public addresses, and the edges just outside each range, pass (they
    /// are only classified here, never connected).
    #[tokio::test]
    async fn public_addresses_and_range_edges_pass() {
        let dir = tempfile::tempdir().unwrap();
        let p = policy(&dir, &[], &[]);
        for host in [
            "203.0.113.7",
            "198.51.100.1",
            "1.1",
            "11.0.0.0",
            "9.255.255.255",
            "126.255.255.255",
            "128.0.0.0",
            "169.253.255.255",
            "169.255.0.0",
            "172.15.255.255",
            "172.32.0.0",
            "192.167.255.255",
            "192.169.0.0",
            "100.63.255.255",
            "100.128.0.0",
            "223.255.255.255",
            "[2001:db8::1]",
            "[::ffff:203.0.113.7]",
            "[64:ff9b::203.0.113.7]",
            "[2002:cb00:7107::]",
        ] {
            assert_eq!(kind_of(&p, host, 80).await, None, "{host}");
        }
    }

    /// The IPv4 forms `inet_aton` reads, and what it refuses.
    #[test]
    fn inet_aton_forms() {
        let v4 = |a, b, c, d| Some(Ipv4Addr::new(a, b, c, d));
        assert_eq!(inet_aton("127.1"), v4(127, 0, 0, 1));
        assert_eq!(inet_aton("0x7f.1"), v4(127, 0, 0, 1));
        assert_eq!(inet_aton("0177.0.0.1"), v4(127, 0, 0, 1));
        assert_eq!(inet_aton("2130706433"), v4(127, 0, 0, 1));
        assert_eq!(inet_aton("1.2.3"), v4(1, 2, 0, 3));
        assert_eq!(inet_aton("1.2.65535"), v4(1, 2, 255, 255));
        assert_eq!(inet_aton("1.16777215"), v4(1, 255, 255, 255));
        assert_eq!(inet_aton("0x"), v4(0, 0, 0, 0));
        assert_eq!(inet_aton("00"), v4(0, 0, 0, 0));
        for bad in [
            "",
            "1.2.3.4.5",
            "256.1.1.1",
            "1.2.3.256",
            "1.2.65536",
            "4294967296",
            "08.1.1.1",
            "0x1g",
            "1..2",
            "a.b.c.d",
            "+1",
            "-1",
            "1.2.3.4 ",
            "example.test",
        ] {
            assert_eq!(inet_aton(bad), None, "{bad:?}");
        }
        assert_eq!(literal_ip("[::1]"), Some(IpAddr::V6(Ipv6Addr::LOCALHOST)));
        assert_eq!(literal_ip("::1"), Some(IpAddr::V6(Ipv6Addr::LOCALHOST)));
        assert_eq!(literal_ip("app.test"), None);
        assert_eq!(
            literal_addr("http://0x7f.1:2379"),
            Some("127.0.0.1:2379".parse().unwrap())
        );
        assert_eq!(
            literal_addr("https://[::1]"),
            Some("[::1]:443".parse().unwrap())
        );
        assert_eq!(literal_addr("http://app.test:80"), None);
    }

    /// `upstream_allow` opens a range in every spelling; `upstream_deny`
    /// closes one again and wins, public ranges included.
    #[tokio::test]
    async fn allow_opens_and_deny_wins() {
        let dir = tempfile::tempdir().unwrap();
        let p = policy(
            &dir,
            &["127.0.0.0/8", "fd00::/8"],
            &["127.0.0.5", "203.0.113.0/24"],
        );
        for open in [
            "127.0.0.1",
            "127.1",
            "[::ffff:127.0.0.1]",
            "localhost",
            "[fd00::1]",
        ] {
            assert_eq!(kind_of(&p, open, 80).await, None, "{open}");
        }
        for (host, want) in [
            ("[::1]", "loopback"),
            ("10.0.0.1", "private"),
            ("[fc00::1]", "private"),
            ("127.0.0.5", "deny"),
            ("[::ffff:127.0.0.5]", "deny"),
            ("203.0.113.7", "deny"),
            ("0.0.0.0", "unspecified"),
        ] {
            assert_eq!(kind_of(&p, host, 80).await, Some(want), "{host}");
        }
        let r = p
            .check_addr("203.0.113.7".parse().unwrap(), 80)
            .unwrap_err();
        assert_eq!(
            r.to_string(),
            "203.0.113.7:80 is in [deploy] upstream_deny (203.0.113.0/24)"
        );
        let r = policy(&dir, &[], &[])
            .check_addr("::ffff:169.254.169.254".parse().unwrap(), 80)
            .unwrap_err();
        assert_eq!(
            r.to_string(),
            "[::ffff:169.254.169.254]:80 is a link-local (cloud metadata) address (169.254.0.0/16, IPv4-mapped IPv6)"
        );
    }

    /// The node's own addresses (host and port) stay closed when an allow
    /// range covers them, even an entry naming the exact address; a node
    /// listening on every address is refused on each local one, and an own
    /// name is refused by name and by what it resolves to. Only
    /// `upstream_allow_own = true` opens them: then they are judged like any
    /// address (loopback stays closed without an allow range).
    #[tokio::test]
    async fn own_addresses_stay_closed_unless_allow_own() {
        let dir = tempfile::tempdir().unwrap();
        write_hosts(&dir, "10.1.2.3 etcd.test\n");
        let p = policy(&dir, &["127.0.0.0/8", "10.0.0.0/8"], &[]);
        p.note_own("listen address", "127.0.0.1", 8080).await;
        p.note_own("gossip address", "0.0.0.0", 4001).await;
        p.note_own("etcd endpoint", "etcd.test", 2379).await;
        for (host, port) in [
            ("127.0.0.1", 8080),
            ("127.1", 8080),
            ("[::ffff:127.0.0.1]", 8080),
            ("0.0.0.0", 8080),
            ("127.0.0.1", 4001),
            ("127.0.0.9", 4001),
            ("etcd.test", 2379),
            ("ETCD.test.", 2379),
            ("10.1.2.3", 2379),
        ] {
            assert_eq!(kind_of(&p, host, port).await, Some("own"), "{host}:{port}");
        }
        for (host, port) in [
            ("127.0.0.1", 8081),
            ("127.0.0.2", 8080),
            ("etcd.test", 2380),
        ] {
            assert_eq!(kind_of(&p, host, port).await, None, "{host}:{port}");
        }
        let r = p
            .check_addr("127.0.0.1".parse().unwrap(), 8080)
            .unwrap_err();
        assert_eq!(
            r.to_string(),
            "127.0.0.1:8080 is this node's own listen address"
        );
        // An allow entry naming the exact address opens nothing of the node's.
        for exact in ["127.0.0.1/32", "127.0.0.1"] {
            let p = policy(&dir, &[exact], &[]);
            p.note_own("listen address", "127.0.0.1", 8080).await;
            assert_eq!(kind_of(&p, "127.0.0.1", 8080).await, Some("own"), "{exact}");
        }
        // upstream_allow_own: judged like any address.
        let own = |allow: &[&str]| {
            let cfg = DeployConfig {
                upstream_allow: allow.iter().map(|s| s.to_string()).collect(),
                upstream_allow_own: true,
                ..DeployConfig::default()
            };
            EgressPolicy::from_config(&cfg)
                .with_resolver(Resolver::HostsFile(dir.path().join("hosts")))
        };
        let open = own(&["127.0.0.0/8", "10.0.0.0/8"]);
        let loopback_closed = own(&[]);
        for p in [&open, &loopback_closed] {
            p.note_own("listen address", "127.0.0.1", 8080).await;
            p.note_own("etcd endpoint", "etcd.test", 2379).await;
        }
        assert_eq!(kind_of(&open, "127.0.0.1", 8080).await, None);
        assert_eq!(kind_of(&open, "etcd.test", 2379).await, None);
        assert_eq!(
            kind_of(&loopback_closed, "127.0.0.1", 8080).await,
            Some("loopback")
        );
        assert_eq!(
            kind_of(&loopback_closed, "etcd.test", 2379).await,
            Some("private")
        );
    }

    /// The addresses the node refreshes (etcd's members, the cluster's
    /// members) only grow: a member that joins is refused on its port, one
    /// that left (its registry record deleted) is still refused, by name and
    /// by address, and another source's and the start-up addresses stay.
    #[tokio::test]
    async fn refreshed_own_addresses_only_grow() {
        let dir = tempfile::tempdir().unwrap();
        write_hosts(&dir, "127.0.0.7 node-b.test\n");
        let p = policy(&dir, &["127.0.0.0/8"], &[]);
        p.note_own("listen address", "127.0.0.1", 8080).await;
        let entry = |what: &str, host: &str, port| (what.to_string(), host.to_string(), port);
        p.set_own(
            "etcd members",
            &[entry("the etcd peer URL of member m1", "127.0.0.1", 2380)],
        )
        .await;
        p.set_own(
            "cluster members",
            &[
                entry("the API address of cluster member b", "node-b.test", 9002),
                entry("the gossip address of a cluster member", "127.0.0.1", 4002),
            ],
        )
        .await;
        for (host, port) in [
            ("127.0.0.1", 8080),
            ("127.0.0.1", 2380),
            ("node-b.test", 9002),
            ("127.0.0.7", 9002),
            ("127.0.0.1", 4002),
        ] {
            assert_eq!(kind_of(&p, host, port).await, Some("own"), "{host}:{port}");
        }
        let r = p
            .check_addr("127.0.0.7".parse().unwrap(), 9002)
            .unwrap_err();
        assert_eq!(
            r.to_string(),
            "127.0.0.7:9002 is the API address of cluster member b"
        );
        // Member b left, one on 9003 joined.
        p.set_own(
            "cluster members",
            &[entry(
                "the API address of cluster member c",
                "127.0.0.1",
                9003,
            )],
        )
        .await;
        assert_eq!(kind_of(&p, "127.0.0.7", 9002).await, Some("own"));
        assert_eq!(kind_of(&p, "node-b.test", 9002).await, Some("own"));
        assert_eq!(kind_of(&p, "127.0.0.1", 4002).await, Some("own"));
        let r = p
            .check_addr("127.0.0.7".parse().unwrap(), 9002)
            .unwrap_err();
        assert_eq!(
            r.to_string(),
            "127.0.0.7:9002 is the API address of cluster member b"
        );
        // An empty update (every record deleted) takes nothing away.
        p.set_own("cluster members", &[]).await;
        assert_eq!(kind_of(&p, "127.0.0.7", 9002).await, Some("own"));
        assert_eq!(kind_of(&p, "127.0.0.1", 9003).await, Some("own"));
        assert_eq!(kind_of(&p, "127.0.0.1", 2380).await, Some("own"));
        assert_eq!(kind_of(&p, "127.0.0.1", 8080).await, Some("own"));
    }

    /// The test resolver reads its file at every lookup: a name that
    /// resolved to a public address is refused once it resolves to loopback;
    /// one forbidden address among several refuses the name; a name the file
    /// lacks, or a missing file, does not resolve.
    #[tokio::test]
    async fn the_test_resolver_rereads_its_file() {
        let dir = tempfile::tempdir().unwrap();
        let p = policy(&dir, &[], &[]);
        write_hosts(
            &dir,
            "# comment\n203.0.113.7 rebind.test other.test # trailing\n",
        );
        let addrs = p.resolve_checked("rebind.test", 8000).await.unwrap();
        assert_eq!(addrs, ["203.0.113.7:8000".parse::<SocketAddr>().unwrap()]);
        write_hosts(&dir, "127.0.0.1 rebind.test\n");
        match p.resolve_checked("rebind.test", 8000).await {
            Err(EgressError::Forbidden(r)) => {
                assert_eq!(r.kind, "loopback");
                assert_eq!(
                    r.to_string(),
                    "rebind.test resolves to 127.0.0.1:8000, a loopback address (127.0.0.0/8)"
                );
            }
            other => panic!("{other:?}"),
        }
        write_hosts(&dir, "203.0.113.7 mixed.test\n169.254.169.254 mixed.test\n");
        assert_eq!(kind_of(&p, "mixed.test", 80).await, Some("link-local"));
        assert!(matches!(
            p.resolve_checked("absent.test", 80).await,
            Err(EgressError::Unresolved(_))
        ));
        std::fs::remove_file(dir.path().join("hosts")).unwrap();
        assert!(matches!(
            p.resolve_checked("rebind.test", 80).await,
            Err(EgressError::Unresolved(_))
        ));
        // Literal addresses never need the resolver.
        assert!(p.resolve_checked("203.0.113.7", 80).await.is_ok());
    }

    /// The create-time check answers 400 UPSTREAM_FORBIDDEN naming the
    /// instance, the address and the rule, and 400 UPSTREAM_UNRESOLVABLE.
    #[tokio::test]
    async fn create_time_errors() {
        let dir = tempfile::tempdir().unwrap();
        write_hosts(&dir, "169.254.169.254 meta.test\n");
        let p = policy(&dir, &[], &[]);
        let e = p.check_instance("http://meta.test:80").await.unwrap_err();
        assert_eq!(
            (e.status.as_u16(), e.code.as_str()),
            (400, "UPSTREAM_FORBIDDEN")
        );
        assert!(e.message.contains("http://meta.test:80"), "{}", e.message);
        assert!(e.message.contains("169.254.169.254:80"), "{}", e.message);
        assert!(e.message.contains("link-local"), "{}", e.message);
        let e = p
            .check_instance("http://nowhere.test:80")
            .await
            .unwrap_err();
        assert_eq!(
            (e.status.as_u16(), e.code.as_str()),
            (400, "UPSTREAM_UNRESOLVABLE")
        );
        p.check_instance("https://203.0.113.9").await.unwrap();
    }

    /// Ranges are CIDR or single addresses; a bad one fails the config load
    /// with the key and the value named.
    #[test]
    fn ranges_in_the_config() {
        assert_eq!(parse_range("10.0.0.0/8"), "10.0.0.0/8".parse().ok());
        assert_eq!(parse_range(" 127.0.0.1 "), "127.0.0.1/32".parse().ok());
        assert_eq!(parse_range("fc00::/7"), "fc00::/7".parse().ok());
        for bad in ["10.0.0.0/33", "10.0.0/8", "localhost", "", "[::1]"] {
            assert_eq!(parse_range(bad), None, "{bad:?}");
        }
        let env = |k: &str, v: &str| vec![(k.to_string(), v.to_string())];
        let load = |env: Vec<(String, String)>| {
            crate::config::Config::load(None, &env, &crate::config::Overrides::default())
        };
        let c = load(env("MESHGATE_DEPLOY_UPSTREAM_ALLOW", "127.0.0.0/8, ::1")).unwrap();
        assert_eq!(c.deploy.upstream_allow, ["127.0.0.0/8", "::1"]);
        let c = load(env("MESHGATE_DEPLOY_UPSTREAM_DENY", "[\"10.0.0.0/8\"]")).unwrap();
        assert_eq!(c.deploy.upstream_deny, ["10.0.0.0/8"]);
        assert!(!c.deploy.upstream_allow_own);
        let c = load(env("MESHGATE_DEPLOY_UPSTREAM_ALLOW_OWN", "true")).unwrap();
        assert!(c.deploy.upstream_allow_own);
        let err = load(env(
            "MESHGATE_DEPLOY_UPSTREAM_DENY",
            "10.0.0.0/8,10.0.0.0/33",
        ))
        .unwrap_err();
        assert_eq!(err.0.len(), 1, "{:?}", err.0);
        assert!(
            err.0[0].starts_with("deploy.upstream_deny") && err.0[0].contains("10.0.0.0/33"),
            "{:?}",
            err.0
        );
    }

    /// Gossip listen addresses name a host and a port.
    #[test]
    fn multiaddrs() {
        assert_eq!(
            multiaddr_host_port("/ip4/127.0.0.1/tcp/4001"),
            Some(("127.0.0.1".into(), 4001))
        );
        assert_eq!(
            multiaddr_host_port("/ip6/::1/tcp/4001/p2p/12D3"),
            Some(("::1".into(), 4001))
        );
        assert_eq!(multiaddr_host_port("/memory/1"), None);
    }
}
