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
//! - `localhost` and every name under it (RFC 6761), and `localdomain` and
//!   every name under it (`localhost.localdomain`: the loopback name many
//!   systems' `/etc/hosts` give);
//! - single-label names (a resolver completes them with its search domains);
//! - the gateway's own hosts: `base_domain` and `ns-<name>.<base_domain>`;
//! - the node's own names: its listen and advertise names and, in a cluster,
//!   every member's advertise name (kept current from the node registry).
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
    /// `base_domain` or `ns-<name>.<base_domain>`.
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
                "a localhost name (loopback: localhost, localdomain and the names under them)"
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
    if h == "localhost"
        || h.ends_with(".localhost")
        || h == "localdomain"
        || h.ends_with(".localdomain")
    {
        return Some(Reserved::Localhost);
    }
    (!h.contains('.')).then_some(Reserved::SingleLabel)
}

/// The node's own names: the gateway's hosts, its listen and advertise names,
/// and (in a cluster) every member's advertise name.
pub struct OwnNames {
    /// `[server] base_domain`, canonical.
    base_domain: String,
    /// Names noted at start (listen, advertise), with what each is.
    fixed: RwLock<BTreeMap<String, String>>,
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
            members: RwLock::new(BTreeMap::new()),
            generation: AtomicU64::new(0),
        }
    }

    /// How many times a name was added (see the field).
    pub fn generation(&self) -> u64 {
        self.generation.load(Ordering::Acquire)
    }

    /// Notes one of the node's own names (`what`: "this node's advertise
    /// name", ...); an address is reserved anyway and not noted.
    pub fn note(&self, name: &str, what: &str) {
        let name = canonical(name);
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
        let gateway = h == self.base_domain
            || h.strip_suffix(&self.base_domain)
                .and_then(|l| l.strip_suffix('.'))
                .is_some_and(|l| l.starts_with("ns-") && !l.contains('.'));
        if gateway {
            return Some(Reserved::Gateway);
        }
        let own = |m: &RwLock<BTreeMap<String, String>>| m.read().get(&h).cloned();
        own(&self.fixed)
            .or_else(|| own(&self.members))
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
            ("www.gateway.test", None),
            ("x.ns-acme.gateway.test", None),
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
        let e = refusal("node-a.internal", &own.classify("node-a.internal").unwrap());
        assert_eq!((e.status.as_u16(), e.code.as_str()), (400, "HOST_RESERVED"));
        assert!(e.message.contains("advertise name"), "{}", e.message);
    }
}
