//! Which hosts no deployment may take (docs/deployments.md, "Hosts the node
//! keeps"). A request reaches the node by its address or by one of its own
//! names whenever a client, an operator or another node calls its API; a
//! tenant holding such a host would receive those requests, credentials
//! included. So these are refused at creation and at import (400
//! `HOST_RESERVED`), and never routed to a deployment even when a record
//! stored before this rule claims one:
//!
//! - IP addresses in any spelling: dotted IPv4 and the `inet_aton` forms
//!   resolvers accept (`2130706433`, `0x7f.1`, `127.1`), IPv6 with or without
//!   brackets (IPv4-mapped too), and any name whose last label is a number
//!   (a browser reads it as an IPv4 address);
//! - `localhost` and every name under it (RFC 6761), and `localdomain`,
//!   `localdomain4`, `localdomain6` and every name under them
//!   (`localhost.localdomain`, `localhost4.localdomain4`,
//!   `localhost6.localdomain6`: the loopback names many systems'
//!   `/etc/hosts` give);
//! - single-label names (a resolver completes them with its search domains);
//! - the gateway's own hosts: `base_domain` and every name under it
//!   (`ns-<name>.<base_domain>` and its subdomains, which a cookie set for a
//!   namespace's host reaches);
//! - the node's own names: its listen and advertise names, the host of
//!   `[server] public_url`, the DNS names on its TLS certificate (a wildcard
//!   name `*.example.com` reserves every name under `example.com`) and, in a
//!   cluster, every member's advertise name (kept current from the node
//!   registry).
//!
//! Names are compared lower-cased and without a trailing dot.

use super::egress::literal_ip;
use crate::error::{ApiError, Code};
use parking_lot::RwLock;
use std::collections::BTreeMap;
use std::fmt;
use std::net::IpAddr;
use std::sync::atomic::{AtomicU64, Ordering};

/// Why a host is reserved.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reserved {
    /// An IP address, in whatever spelling.
    Address(IpAddr),
    /// A name whose last label is a number: read as an IPv4 address by browsers.
    NumericLabel,
    /// `localhost` or a name under it.
    Localhost,
    /// A name of one label.
    SingleLabel,
    /// `base_domain` or a name under it (`ns-<name>.<base_domain>`, ...).
    Gateway,
    /// One of the node's (or a cluster member's) own names; says which.
    OwnName(String),
}

impl fmt::Display for Reserved {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Reserved::Address(ip) => write!(f, "an IP address ({ip})"),
            Reserved::NumericLabel => {
                write!(f, "spelled as an IP address (its last label is a number)")
            }
            Reserved::Localhost => write!(
                f,
                "a localhost name (loopback: localhost, localdomain, localdomain4, localdomain6 and the names under them)"
            ),
            Reserved::SingleLabel => write!(f, "a single-label name"),
            Reserved::Gateway => write!(f, "one of the gateway's own hosts"),
            Reserved::OwnName(what) => write!(f, "{what}"),
        }
    }
}

/// 400 `HOST_RESERVED` for a host a deployment may not take.
pub fn refusal(host: &str, why: &Reserved) -> ApiError {
    ApiError::new(
        Code::HostReserved,
        format!(
            "{host} is {why}: requests for it always go to the node itself, so no deployment may take it"
        ),
    )
}

/// `host` lower-cased, trimmed, without trailing dots.
fn canonical(host: &str) -> String {
    host.trim().trim_end_matches('.').to_ascii_lowercase()
}

/// The address `host` spells, in any spelling: `[v6]`, bare v6 (a zone
/// `%eth0` ignored), dotted or `inet_aton` IPv4.
pub fn address_spelled(host: &str) -> Option<IpAddr> {
    let h = canonical(host);
    let inner = h
        .strip_prefix('[')
        .and_then(|i| i.strip_suffix(']'))
        .unwrap_or(&h);
    let no_zone = inner.split('%').next().unwrap_or(inner);
    if no_zone.contains(':') {
        return no_zone.parse::<IpAddr>().ok();
    }
    literal_ip(no_zone)
}

/// Whether the last label of `h` is a number (decimal, or `0x` hex).
fn numeric_last_label(h: &str) -> bool {
    let last = h.rsplit('.').next().unwrap_or(h);
    let (digits, radix) = match last.strip_prefix("0x") {
        Some(hex) => (hex, 16),
        None => (last, 10),
    };
    !last.is_empty() && digits.chars().all(|c| c.is_digit(radix))
}

/// Whether `host` is an address (in any spelling) or spelled like one. Checked
/// before a host's DNS syntax, so `[::1]` is refused as reserved, not as junk.
pub fn address_like(host: &str) -> Option<Reserved> {
    if let Some(ip) = address_spelled(host) {
        return Some(Reserved::Address(ip));
    }
    numeric_last_label(&canonical(host)).then_some(Reserved::NumericLabel)
}

/// The reasons that hold on every node: an address, `localhost`, one label.
pub fn reserved_everywhere(host: &str) -> Option<Reserved> {
    if let Some(r) = address_like(host) {
        return Some(r);
    }
    let h = canonical(host);
    let loopback = ["localhost", "localdomain", "localdomain4", "localdomain6"]
        .iter()
        .any(|d| h == *d || h.strip_suffix(d).is_some_and(|l| l.ends_with('.')));
    if loopback {
        return Some(Reserved::Localhost);
    }
    (!h.contains('.')).then_some(Reserved::SingleLabel)
}

/// Whether `h` is `domain` or a name under it (both canonical).
fn is_under(h: &str, domain: &str) -> bool {
    h == domain
        || h.strip_suffix(domain)
            .is_some_and(|l| l.ends_with('.') && l.len() > 1)
}

/// The host of a URL such as `[server] public_url`
/// (`https://gw.example.com:8443/base`), without its port; `None` when it
/// has no `scheme://host`.
pub fn url_host(url: &str) -> Option<String> {
    let (_, rest) = url.trim().split_once("://")?;
    let authority = rest.split(['/', '?', '#']).next()?;
    let host_port = authority.rsplit('@').next()?;
    let host = match host_port.strip_prefix('[') {
        Some(v6) => v6.split(']').next()?,
        None => host_port.split(':').next()?,
    };
    (!host.is_empty()).then(|| canonical(host))
}

/// The node's own names: the gateway's hosts, its listen and advertise names,
/// the host of its public URL, its TLS certificate's names, and (in a
/// cluster) every member's advertise name.
pub struct OwnNames {
    /// `[server] base_domain`, canonical.
    base_domain: String,
    /// Names noted (listen, advertise, public URL, certificate), with what
    /// each is.
    fixed: RwLock<BTreeMap<String, String>>,
    /// Domains every name under which is the node's (a certificate's
    /// wildcard name `*.d` noted as `d`), with what each is.
    under: RwLock<BTreeMap<String, String>>,
    /// The cluster members' advertise names as last read from the registry.
    members: RwLock<BTreeMap<String, String>>,
    /// Moves each time a name is added: a routing index built at one
    /// generation left out every host reserved then, so a request needs the
    /// check only when the generation moved since (`super::Deployments::route`).
    generation: AtomicU64,
}

impl OwnNames {
    pub fn new(base_domain: &str) -> OwnNames {
        OwnNames {
            base_domain: canonical(base_domain),
            fixed: RwLock::new(BTreeMap::new()),
            under: RwLock::new(BTreeMap::new()),
            members: RwLock::new(BTreeMap::new()),
            generation: AtomicU64::new(0),
        }
    }

    /// How many times a name was added (see the field).
    pub fn generation(&self) -> u64 {
        self.generation.load(Ordering::Acquire)
    }

    /// Notes one of the node's own names (`what`: "this node's advertise
    /// name", ...); an address is reserved anyway and not noted. A wildcard
    /// name `*.example.com` notes every name under `example.com`.
    pub fn note(&self, name: &str, what: &str) {
        let name = canonical(name);
        if let Some(domain) = name.strip_prefix("*.") {
            if domain.is_empty() || address_spelled(domain).is_some() {
                return;
            }
            let mut under = self.under.write();
            if !under.contains_key(domain) {
                under.insert(domain.to_string(), what.into());
                self.generation.fetch_add(1, Ordering::AcqRel);
            }
            return;
        }
        if name.is_empty() || address_spelled(&name).is_some() {
            return;
        }
        let mut fixed = self.fixed.write();
        if !fixed.contains_key(&name) {
            fixed.insert(name, what.into());
            self.generation.fetch_add(1, Ordering::AcqRel);
        }
    }

    /// Adds the cluster members' names: (name, what) pairs, as the registry
    /// holds them now. A name once noted stays reserved for the life of the
    /// process (a member whose record is gone keeps it; docs/cluster.md).
    pub fn set_members(&self, names: impl IntoIterator<Item = (String, String)>) {
        let names: Vec<(String, String)> = names
            .into_iter()
            .map(|(n, w)| (canonical(&n), w))
            .filter(|(n, _)| !n.is_empty() && address_spelled(n).is_none())
            .collect();
        // Only grows, like the egress policy's member addresses: a member
        // whose registry record is gone keeps its name reserved.
        let mut members = self.members.write();
        let before = members.len();
        members.extend(names);
        if members.len() != before {
            self.generation.fetch_add(1, Ordering::AcqRel);
        }
    }

    /// Why `host` is reserved on this node, if it is.
    pub fn classify(&self, host: &str) -> Option<Reserved> {
        if let Some(r) = reserved_everywhere(host) {
            return Some(r);
        }
        let h = canonical(host);
        if is_under(&h, &self.base_domain) {
            return Some(Reserved::Gateway);
        }
        let own = |m: &RwLock<BTreeMap<String, String>>| m.read().get(&h).cloned();
        let under = || {
            let under = self.under.read();
            under
                .iter()
                .find(|(d, _)| h.len() > d.len() && is_under(&h, d))
                .map(|(_, what)| what.clone())
        };
        own(&self.fixed)
            .or_else(|| own(&self.members))
            .or_else(under)
            .map(Reserved::OwnName)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every spelling of an address is reserved as one (or as a name spelled
    /// like one), in any case and with a trailing dot.
    #[test]
    fn every_address_spelling_is_reserved() {
        let v4 = |s: &str| Some(Reserved::Address(s.parse().unwrap()));
        for (host, want) in [
            ("127.0.0.1", v4("127.0.0.1")),
            ("127.0.0.1.", v4("127.0.0.1")),
            ("2130706433", v4("127.0.0.1")),
            ("0x7f.1", v4("127.0.0.1")),
            ("0X7F.0.0.1", v4("127.0.0.1")),
            ("0x7f000001", v4("127.0.0.1")),
            ("0177.0.0.1", v4("127.0.0.1")),
            ("127.1", v4("127.0.0.1")),
            ("10.0.0.1", v4("10.0.0.1")),
            ("203.0.113.7", v4("203.0.113.7")),
            ("[::1]", v4("::1")),
            ("::1", v4("::1")),
            ("[0:0:0:0:0:0:0:1]", v4("::1")),
            ("[::ffff:127.0.0.1]", v4("::ffff:127.0.0.1")),
            ("::FFFF:7F00:1", v4("::ffff:127.0.0.1")),
            ("[::ffff:7f00:1].", v4("::ffff:127.0.0.1")),
            ("[FE80::1%25eth0]", v4("fe80::1")),
            ("[2001:DB8::1]", v4("2001:db8::1")),
            ("1.2.3.4.5", Some(Reserved::NumericLabel)),
            ("256.1.1.1", Some(Reserved::NumericLabel)),
            ("app.test.123", Some(Reserved::NumericLabel)),
            ("app.0x1f", Some(Reserved::NumericLabel)),
        ] {
            assert_eq!(reserved_everywhere(host), want, "{host}");
            assert_eq!(address_like(host), want, "{host}");
        }
    }

    /// `localhost` and its subdomains, and single-label names, are reserved
    /// on every node; ordinary names are not.
    #[test]
    fn localhost_and_single_labels_are_reserved() {
        for host in [
            "localhost",
            "LOCALHOST.",
            "app.localhost",
            "a.b.LocalHost",
            "localhost.localdomain",
            "x.localdomain",
            "LocalDomain",
            "localhost4.localdomain4",
            "localhost6.localdomain6.",
            "a.b.LocalDomain4",
            "x.localdomain6",
            "localdomain4",
        ] {
            assert_eq!(
                reserved_everywhere(host),
                Some(Reserved::Localhost),
                "{host}"
            );
        }
        for host in ["intranet", "Bank.", "com", "0x7fg"] {
            assert_eq!(
                reserved_everywhere(host),
                Some(Reserved::SingleLabel),
                "{host}"
            );
        }
        for host in [
            "www.example.com",
            "api.bank.test",
            "127-0-0-1.nip.example",
            "x1.test",
            "1.example",
            "localhost.example",
            "ns-acme.example.com",
            "localdomain4.example",
            "xlocaldomain4.test",
        ] {
            assert_eq!(reserved_everywhere(host), None, "{host}");
        }
    }

    /// The gateway's hosts and the node's own names are reserved on that
    /// node; members' names follow the registry (replaced whole).
    #[test]
    fn own_names_are_reserved() {
        let own = OwnNames::new("Gateway.Test.");
        own.note("node-a.internal", "this node's advertise name");
        own.note("127.0.0.1", "this node's listen name");
        for (host, want) in [
            ("gateway.test", Some(Reserved::Gateway)),
            ("GATEWAY.test.", Some(Reserved::Gateway)),
            ("ns-acme.gateway.test", Some(Reserved::Gateway)),
            (
                "node-a.internal.",
                Some(Reserved::OwnName("this node's advertise name".into())),
            ),
            ("node-b.internal", None),
            ("www.gateway.test", Some(Reserved::Gateway)),
            ("x.ns-acme.gateway.test", Some(Reserved::Gateway)),
            ("xgateway.test", None),
            ("gateway.test.example", None),
            (
                "127.0.0.1",
                Some(Reserved::Address("127.0.0.1".parse().unwrap())),
            ),
        ] {
            assert_eq!(own.classify(host), want, "{host}");
        }
        own.set_members([(
            "Node-B.internal".to_string(),
            "cluster member b's advertise name".to_string(),
        )]);
        assert_eq!(
            own.classify("node-b.internal"),
            Some(Reserved::OwnName(
                "cluster member b's advertise name".into()
            ))
        );
        // A later update without b (its record deleted) keeps its name.
        own.set_members([]);
        assert_eq!(
            own.classify("node-b.internal"),
            Some(Reserved::OwnName(
                "cluster member b's advertise name".into()
            ))
        );
        // A wildcard certificate name: every name under its domain, not the
        // domain itself (unless noted too).
        own.note(
            "*.Wild.Example",
            "a DNS name on this node's TLS certificate",
        );
        for host in ["a.wild.example", "b.c.wild.example."] {
            assert_eq!(
                own.classify(host),
                Some(Reserved::OwnName(
                    "a DNS name on this node's TLS certificate".into()
                )),
                "{host}"
            );
        }
        for host in ["wild.example", "awild.example", "a.example"] {
            assert_eq!(own.classify(host), None, "{host}");
        }
        let e = refusal("node-a.internal", &own.classify("node-a.internal").unwrap());
        assert_eq!((e.status.as_u16(), e.code.as_str()), (400, "HOST_RESERVED"));
        assert!(e.message.contains("advertise name"), "{}", e.message);
    }

    /// The host of a public URL: without scheme, port, path or user; none
    /// for a value that is not a URL.
    #[test]
    fn a_urls_host() {
        for (url, want) in [
            (
                "https://GW.example.com:8443/base?x#y",
                Some("gw.example.com"),
            ),
            ("http://gw.example.com.", Some("gw.example.com")),
            ("https://user:pw@gw.example.com/", Some("gw.example.com")),
            ("https://[::1]:8443/", Some("::1")),
            ("meshgate", None),
            ("https://", None),
        ] {
            assert_eq!(url_host(url).as_deref(), want, "{url}");
        }
    }

    /// Noting a name moves the generation; noting it again does not.
    #[test]
    fn noting_moves_the_generation_once() {
        let own = OwnNames::new("gateway.test");
        let g = own.generation();
        own.note("*.w.example", "cert");
        own.note("*.W.example.", "cert");
        own.note("pub.example", "public url");
        own.note("pub.example", "public url");
        assert_eq!(own.generation(), g + 2);
    }
}
