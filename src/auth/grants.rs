//! Grants (`domain:action:resource-glob`) and the fixed role table.
//!
//! `*` as a whole domain or action matches any; in the resource, `*`
//! matches any run of characters (also none) and `?` exactly one. The
//! resource is everything after the second `:`, so it may itself contain
//! `:` (`kv:read:user:*`).

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use super::error::AuthError;

/// Domains the node checks grants for.
pub const DOMAINS: &[&str] = &[
    "keys",
    "functions",
    "pubsub",
    "kv",
    "db",
    "deployments",
    "namespace",
];

/// Actions the node checks grants for.
pub const ACTIONS: &[&str] = &[
    "read",
    "write",
    "invoke",
    "publish",
    "subscribe",
    "admin",
    "deploy",
];

/// Longest accepted resource glob, in bytes.
const MAX_RESOURCE_LEN: usize = 256;

/// One permission: `domain:action:resource-glob`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct Grant {
    /// One of [`DOMAINS`], or `*`.
    domain: String,
    /// One of [`ACTIONS`], or `*`.
    action: String,
    /// A glob over the resource's name (`*` any run, `?` one character), at
    /// most 256 bytes.
    resource: String,
}

impl Grant {
    /// The domain (`kv`, or `*`).
    pub fn domain(&self) -> &str {
        &self.domain
    }

    /// The action (`read`, or `*`).
    pub fn action(&self) -> &str {
        &self.action
    }

    /// The resource glob (`chat.*`).
    pub fn resource(&self) -> &str {
        &self.resource
    }

    /// Whether this grant permits `action` in `domain` on `resource`.
    pub fn allows(&self, domain: &str, action: &str, resource: &str) -> bool {
        self.allows_action(domain, action) && glob_match(&self.resource, resource)
    }

    /// Whether this grant permits `action` in `domain` on some resource.
    pub fn allows_action(&self, domain: &str, action: &str) -> bool {
        (self.domain == "*" || self.domain == domain)
            && (self.action == "*" || self.action == action)
    }

    /// Whether everything `other` permits is also permitted by `self`.
    /// Conservative: may answer `false` for some covered globs, never
    /// `true` for an uncovered one. Used so a key can only mint keys with
    /// grants it holds itself.
    pub fn covers(&self, other: &Grant) -> bool {
        let part = |mine: &str, theirs: &str| mine == "*" || mine == theirs;
        if !part(&self.domain, &other.domain) || !part(&self.action, &other.action) {
            return false;
        }
        let (mine, theirs) = (self.resource.as_str(), other.resource.as_str());
        if mine == "*" || mine == theirs {
            return true;
        }
        if !theirs.contains(['*', '?']) {
            return glob_match(mine, theirs);
        }
        // `prefix*` covers any glob that starts with that literal prefix.
        match mine.strip_suffix('*') {
            Some(prefix) if !prefix.contains(['*', '?']) => theirs.starts_with(prefix),
            _ => false,
        }
    }
}

impl fmt::Display for Grant {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}:{}", self.domain, self.action, self.resource)
    }
}

impl FromStr for Grant {
    type Err = AuthError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = |reason| AuthError::InvalidGrant {
            grant: s.chars().take(64).collect(),
            reason,
        };
        let mut parts = s.splitn(3, ':');
        let (Some(domain), Some(action), Some(resource)) =
            (parts.next(), parts.next(), parts.next())
        else {
            return Err(bad("expected domain:action:resource"));
        };
        if domain != "*" && !DOMAINS.contains(&domain) {
            return Err(bad(
                "unknown domain (keys, functions, pubsub, kv, db, deployments, namespace or *)",
            ));
        }
        if action != "*" && !ACTIONS.contains(&action) {
            return Err(bad(
                "unknown action (read, write, invoke, publish, subscribe, admin, deploy or *)",
            ));
        }
        if resource.is_empty() {
            return Err(bad("empty resource (use * for any)"));
        }
        if resource.len() > MAX_RESOURCE_LEN {
            return Err(bad("resource longer than 256 bytes"));
        }
        // Commas separate grants in the hop headers; whitespace and
        // control characters have no place in a resource name.
        if resource
            .chars()
            .any(|c| c == ',' || c.is_whitespace() || c.is_control())
        {
            return Err(bad(
                "resource contains a comma, whitespace or control character",
            ));
        }
        Ok(Grant {
            domain: domain.to_owned(),
            action: action.to_owned(),
            resource: resource.to_owned(),
        })
    }
}

impl TryFrom<String> for Grant {
    type Error = AuthError;

    fn try_from(s: String) -> Result<Self, Self::Error> {
        s.parse()
    }
}

impl From<Grant> for String {
    fn from(g: Grant) -> Self {
        g.to_string()
    }
}

/// Whether some grant permits `action` in `domain` on `resource`.
pub fn allows(grants: &[Grant], domain: &str, action: &str, resource: &str) -> bool {
    grants.iter().any(|g| g.allows(domain, action, resource))
}

/// Whether some grant permits `action` in `domain` on any resource (the
/// route-level scope gate; the handler then checks the resource).
pub fn allows_action(grants: &[Grant], domain: &str, action: &str) -> bool {
    grants.iter().any(|g| g.allows_action(domain, action))
}

/// Whether every grant in `requested` is covered by one in `held`.
pub fn grants_cover(held: &[Grant], requested: &[Grant]) -> bool {
    requested.iter().all(|r| held.iter().any(|h| h.covers(r)))
}

/// Parses a list of grant strings, failing on the first bad one.
pub fn parse_grants<S: AsRef<str>>(grants: &[S]) -> Result<Vec<Grant>, AuthError> {
    grants.iter().map(|g| g.as_ref().parse()).collect()
}

/// `*` = any run (also empty), `?` = one character; everything else literal.
/// Iterative with one backtrack point: O(len(pattern) * len(text)) worst case.
pub fn glob_match(pattern: &str, text: &str) -> bool {
    if pattern == "*" {
        return true;
    }
    let p: Vec<char> = pattern.chars().collect();
    let t: Vec<char> = text.chars().collect();
    let (mut pi, mut ti) = (0, 0);
    let mut star: Option<(usize, usize)> = None;
    while ti < t.len() {
        if pi < p.len() && (p[pi] == '?' || (p[pi] != '*' && p[pi] == t[ti])) {
            pi += 1;
            ti += 1;
        } else if pi < p.len() && p[pi] == '*' {
            star = Some((pi, ti));
            pi += 1;
        } else if let Some((sp, st)) = star {
            pi = sp + 1;
            ti = st + 1;
            star = Some((sp, st + 1));
        } else {
            return false;
        }
    }
    p[pi..].iter().all(|&c| c == '*')
}

/// The fixed roles a key or token can be issued with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// Everything in the namespace: `*:*:*`.
    Owner,
    /// Everything but the namespace itself (no `namespace:write/admin`),
    /// so an admin cannot mint an owner key.
    Admin,
    /// Builds: functions, KV, pub/sub, deployments; reads keys.
    Developer,
    /// What a deployed app needs at run time: publish/subscribe/read,
    /// invoke, KV read/write.
    Runtime,
    /// Reads everything and may subscribe.
    Reader,
}

impl Role {
    /// All roles, most powerful first.
    pub const ALL: [Role; 5] = [
        Role::Owner,
        Role::Admin,
        Role::Developer,
        Role::Runtime,
        Role::Reader,
    ];

    /// The lower-case name.
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Owner => "owner",
            Role::Admin => "admin",
            Role::Developer => "developer",
            Role::Runtime => "runtime",
            Role::Reader => "reader",
        }
    }

    /// The grant strings of the role (the table in `docs/auth.md`).
    pub fn grant_strs(self) -> &'static [&'static str] {
        match self {
            Role::Owner => &["*:*:*"],
            Role::Admin => &[
                "keys:*:*",
                "functions:*:*",
                "pubsub:*:*",
                "kv:*:*",
                "db:*:*",
                "deployments:*:*",
                "namespace:read:*",
            ],
            Role::Developer => &[
                "functions:*:*",
                "kv:*:*",
                "pubsub:*:*",
                "deployments:*:*",
                "keys:read:*",
            ],
            Role::Runtime => &[
                "pubsub:publish:*",
                "pubsub:subscribe:*",
                "pubsub:read:*",
                "functions:invoke:*",
                "kv:read:*",
                "kv:write:*",
            ],
            Role::Reader => &["*:read:*", "pubsub:subscribe:*"],
        }
    }

    /// The grants of the role.
    pub fn grants(self) -> Vec<Grant> {
        self.grant_strs()
            .iter()
            .map(|g| g.parse().expect("role table grants are valid"))
            .collect()
    }
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Role {
    type Err = AuthError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Role::ALL
            .into_iter()
            .find(|r| r.as_str().eq_ignore_ascii_case(s.trim()))
            .ok_or_else(|| AuthError::UnknownRole(s.chars().take(32).collect()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn g(s: &str) -> Grant {
        s.parse().unwrap()
    }

    /// Parsing and printing round-trip; serde uses the string form.
    #[test]
    fn parse_display_serde() {
        for s in [
            "pubsub:publish:chat.*",
            "functions:invoke:*",
            "kv:read:user:42",
            "*:*:*",
        ] {
            let grant = g(s);
            assert_eq!(grant.to_string(), s);
            let json = serde_json::to_string(&grant).unwrap();
            assert_eq!(json, format!("\"{s}\""));
            assert_eq!(serde_json::from_str::<Grant>(&json).unwrap(), grant);
        }
        assert_eq!(g("kv:read:user:42").resource(), "user:42");
        assert!(serde_json::from_str::<Grant>("\"kv:read\"").is_err());
    }

    /// Each malformed grant is refused with a reason.
    #[test]
    fn bad_grants() {
        for s in [
            "",
            "kv",
            "kv:read",
            "kv:read:",
            "kvv:read:*",
            "kv:reed:*",
            "KV:read:*",
            "kv:read:a b",
            "kv:read:a,b",
            ":read:*",
        ] {
            match s.parse::<Grant>() {
                Err(AuthError::InvalidGrant { .. }) => {}
                other => panic!("{s:?} -> {other:?}"),
            }
        }
        assert!(
            format!("kv:read:{}", "a".repeat(300))
                .parse::<Grant>()
                .is_err()
        );
    }

    /// Wildcards in each part.
    #[test]
    fn matching() {
        let grants = vec![
            g("pubsub:publish:chat.*"),
            g("functions:invoke:*"),
            g("kv:read:user-?"),
        ];
        assert!(allows(&grants, "pubsub", "publish", "chat.room1"));
        assert!(allows(&grants, "pubsub", "publish", "chat."));
        assert!(!allows(&grants, "pubsub", "publish", "chat"));
        assert!(!allows(&grants, "pubsub", "subscribe", "chat.room1"));
        assert!(allows(&grants, "functions", "invoke", "anything"));
        assert!(allows(&grants, "kv", "read", "user-1"));
        assert!(!allows(&grants, "kv", "read", "user-12"));
        assert!(!allows(&grants, "kv", "write", "user-1"));
        assert!(allows_action(&grants, "pubsub", "publish"));
        assert!(!allows_action(&grants, "kv", "write"));
        assert!(allows(&[g("*:*:*")], "db", "admin", "x"));
        assert!(allows(&[g("*:read:*")], "keys", "read", "x"));
        assert!(!allows(&[], "kv", "read", "x"));
    }

    /// The glob matcher on tricky patterns.
    #[test]
    fn glob_cases() {
        assert!(glob_match("a*b*c", "aXXbYYc"));
        assert!(glob_match("a*b*c", "abc"));
        assert!(!glob_match("a*b*c", "abcd"));
        assert!(glob_match("*.*", "x.y"));
        assert!(glob_match("**", ""));
        assert!(!glob_match("?", ""));
        assert!(glob_match("é?", "éà"));
        assert!(!glob_match("chat.*", "chat"));
        assert!(glob_match(&"*a".repeat(50), &"a".repeat(200)));
    }

    /// Roles parse case-insensitively and expand to the table.
    #[test]
    fn roles() {
        for r in Role::ALL {
            assert_eq!(r.as_str().parse::<Role>().unwrap(), r);
            assert_eq!(r.grants().len(), r.grant_strs().len());
        }
        assert_eq!(" Owner ".parse::<Role>().unwrap(), Role::Owner);
        assert!(matches!(
            "root".parse::<Role>(),
            Err(AuthError::UnknownRole(_))
        ));

        let admin = Role::Admin.grants();
        assert!(allows(&admin, "keys", "write", "x"));
        assert!(!allows(&admin, "namespace", "admin", "x"));
        let dev = Role::Developer.grants();
        assert!(allows(&dev, "deployments", "deploy", "site"));
        assert!(allows(&dev, "keys", "read", "x"));
        assert!(!allows(&dev, "keys", "write", "x"));
        assert!(!allows(&dev, "db", "admin", "x"));
        let rt = Role::Runtime.grants();
        assert!(allows(&rt, "kv", "write", "x"));
        assert!(!allows(&rt, "functions", "deploy", "x"));
        assert!(!allows(&rt, "kv", "admin", "x"));
        let reader = Role::Reader.grants();
        assert!(allows(&reader, "kv", "read", "x"));
        assert!(allows(&reader, "pubsub", "subscribe", "t"));
        assert!(!allows(&reader, "pubsub", "publish", "t"));
    }

    /// A role covers the roles below it; an admin cannot mint an owner.
    #[test]
    fn coverage() {
        let owner = Role::Owner.grants();
        for r in Role::ALL {
            assert!(grants_cover(&owner, &r.grants()), "{r}");
        }
        let admin = Role::Admin.grants();
        assert!(!grants_cover(&admin, &owner));
        assert!(grants_cover(&admin, &Role::Developer.grants()));
        assert!(grants_cover(&admin, &Role::Runtime.grants()));
        assert!(!grants_cover(&Role::Developer.grants(), &admin));
        assert!(!grants_cover(
            &Role::Runtime.grants(),
            &Role::Reader.grants()
        ));
        assert!(g("pubsub:publish:chat.*").covers(&g("pubsub:publish:chat.room.*")));
        assert!(g("pubsub:publish:chat.*").covers(&g("pubsub:publish:chat.x")));
        assert!(!g("pubsub:publish:chat.*").covers(&g("pubsub:publish:*")));
        assert!(!g("pubsub:publish:c?at.*").covers(&g("pubsub:publish:chat.*")));
    }

    proptest! {
        // Parsers of untrusted bytes: thousands of generated inputs each.
        #![proptest_config(ProptestConfig::with_cases(3000))]
        /// `Grant::from_str` never panics; what parses prints back the same.
        #[test]
        fn from_str_never_panics(s in ".{0,300}") {
            if let Ok(g) = s.parse::<Grant>() {
                prop_assert_eq!(g.to_string(), s);
            }
        }

        /// Near-grants exercise the resource checks.
        #[test]
        fn near_grants(s in "(kv|pubsub|\\*):(read|\\*):[a-z.*?:, é\t]{0,20}") {
            let _ = s.parse::<Grant>();
        }

        /// The matcher never panics and a literal pattern matches itself.
        #[test]
        fn glob_total(p in "[a*?]{0,12}", t in "[ab]{0,12}") {
            let _ = glob_match(&p, &t);
            prop_assert!(glob_match(&t, &t));
        }
    }
}
