//! Whether, and as what, a namespace lets wallets sign in: the owner's
//! choice, kept in the namespace record (`wallet_sign_in`).
//!
//! Off by default: a namespace that never opted in refuses every challenge
//! (`WALLET_SIGN_IN_DISABLED`). Its owner enables it with a role of its own
//! (a label, never a built-in role name, `wallet` by default), that role's
//! grants (none by default) and the wallets allowed (`"any"` or a list). A
//! grant's resource may name `{sub}`, replaced by the signing wallet's
//! address when a token is issued, so each wallet user gets its own corner
//! (`kv:read:users/{sub}/*`). Grants on the namespace's keys, settings or
//! database (`keys`, `namespace`, `db`, `*`) are never given to a wallet:
//! a wallet user cannot mint keys or change who signs in.

use serde::de::Error as _;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use super::error::{AuthError, Result};
use super::grants::{Grant, Role};
use super::siwe::normalize_evm_address;
use super::wallet::normalize_wallet;

/// The role a wallet sign-in gets when the owner names none.
pub const DEFAULT_WALLET_ROLE: &str = "wallet";
/// Most grants a wallet role holds.
pub const MAX_WALLET_GRANTS: usize = 32;
/// Most wallets an allow list names (the record is read at every sign-in).
pub const MAX_WALLET_ALLOW: usize = 1000;
/// Longest wallet role name, in bytes.
const MAX_ROLE_LEN: usize = 32;
/// Replaced in a grant's resource by the wallet's address (64 hex for an
/// Ed25519 key, `0x` and 40 lower-case hex for an EVM account).
pub const SUBJECT_PLACEHOLDER: &str = "{sub}";
/// Domains a wallet grant may not name: the namespace's keys, its settings
/// (wallet sign-in among them) and its whole database, or all of them.
const FORBIDDEN_DOMAINS: &[&str] = &["*", "keys", "namespace", "db"];

/// A namespace's wallet sign-in, as its owner set it (`PUT
/// /v1/namespaces/{ns}/wallet-sign-in`); checked by [`WalletSignIn::new`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WalletSignIn {
    /// Whether wallets may sign in at all.
    pub enabled: bool,
    /// The role's name, shown in the tokens (`role` claim) and the sign-in answer.
    pub role: String,
    /// The role's grants; a resource may hold `{sub}`.
    pub grants: Vec<String>,
    /// Which wallets may sign in.
    pub allow: WalletAllow,
}

/// The wallets a namespace lets sign in.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WalletAllow {
    /// Every wallet (`"any"`).
    Any,
    /// Only these (normalized, distinct) addresses.
    Only(Vec<String>),
}

impl Serialize for WalletAllow {
    fn serialize<S: Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        match self {
            WalletAllow::Any => s.serialize_str("any"),
            WalletAllow::Only(list) => list.serialize(s),
        }
    }
}

impl<'de> Deserialize<'de> for WalletAllow {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Repr {
            Word(String),
            List(Vec<String>),
        }
        match Repr::deserialize(d)? {
            Repr::Word(w) if w == "any" => Ok(WalletAllow::Any),
            Repr::Word(_) => Err(D::Error::custom(
                "allow is \"any\" or a list of wallet addresses",
            )),
            Repr::List(l) => Ok(WalletAllow::Only(l)),
        }
    }
}

impl WalletSignIn {
    /// The setting of a namespace whose owner never set one: off, the
    /// default role, no grants, no wallet allowed.
    pub fn off() -> WalletSignIn {
        WalletSignIn {
            enabled: false,
            role: DEFAULT_WALLET_ROLE.to_string(),
            grants: Vec::new(),
            allow: WalletAllow::Only(Vec::new()),
        }
    }

    /// The setting an owner asked for, checked: the role a label of 1-32 of
    /// `a-z0-9-_` that is no built-in role, at most [`MAX_WALLET_GRANTS`]
    /// grants that parse (also with `{sub}` replaced) and name no forbidden
    /// domain, an allow list of at most [`MAX_WALLET_ALLOW`] wallets
    /// (normalized, duplicates dropped), and an allow when enabled.
    pub fn new(
        enabled: bool,
        role: Option<String>,
        grants: Vec<String>,
        allow: Option<WalletAllow>,
    ) -> Result<WalletSignIn> {
        let bad = |m: String| AuthError::InvalidWalletSignIn(m);
        let role = role.unwrap_or_else(|| DEFAULT_WALLET_ROLE.to_string());
        let label = !role.is_empty()
            && role.len() <= MAX_ROLE_LEN
            && role
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_');
        if !label {
            return Err(bad(format!(
                "the role is 1-{MAX_ROLE_LEN} of a-z, 0-9, '-' and '_'"
            )));
        }
        if role.parse::<Role>().is_ok() {
            return Err(bad(format!(
                "{role:?} is a built-in role; a wallet role is one of the namespace's own"
            )));
        }
        if grants.len() > MAX_WALLET_GRANTS {
            return Err(bad(format!("at most {MAX_WALLET_GRANTS} grants")));
        }
        let mut kept: Vec<String> = Vec::with_capacity(grants.len());
        for g in grants {
            check_grant(&g)?;
            if !kept.contains(&g) {
                kept.push(g);
            }
        }
        let allow = match allow {
            Some(WalletAllow::Any) => WalletAllow::Any,
            Some(WalletAllow::Only(list)) => {
                if list.len() > MAX_WALLET_ALLOW {
                    return Err(bad(format!("at most {MAX_WALLET_ALLOW} allowed wallets")));
                }
                let mut out: Vec<String> = Vec::with_capacity(list.len());
                for w in list {
                    let w = normalize_any_wallet(&w)?;
                    if !out.contains(&w) {
                        out.push(w);
                    }
                }
                WalletAllow::Only(out)
            }
            None if enabled => {
                return Err(bad(
                    "name the wallets allowed: \"allow\": \"any\" or a list of addresses".into(),
                ));
            }
            None => WalletAllow::Only(Vec::new()),
        };
        Ok(WalletSignIn {
            enabled,
            role,
            grants: kept,
            allow,
        })
    }

    /// Whether `wallet` (normalized) may sign in now: refused when the
    /// setting is off or the wallet is not on the allow list.
    pub fn admits(&self, wallet: &str) -> Result<()> {
        if !self.enabled {
            return Err(AuthError::WalletSignInDisabled);
        }
        match &self.allow {
            WalletAllow::Any => Ok(()),
            WalletAllow::Only(list) if list.iter().any(|w| w == wallet) => Ok(()),
            WalletAllow::Only(_) => Err(AuthError::WalletNotAllowed),
        }
    }

    /// The grant strings of a token issued to `wallet`: the role's, with
    /// `{sub}` replaced by the address (each was checked to parse so).
    pub fn grants_for(&self, wallet: &str) -> Vec<String> {
        self.grants
            .iter()
            .map(|g| g.replace(SUBJECT_PLACEHOLDER, wallet))
            .collect()
    }

    /// The grants as a bound on what any wallet gets (`{sub}` as `*`): what
    /// a non-operator setting them must itself hold (`GRANT_ESCALATION`).
    pub fn grant_bound(&self) -> Result<Vec<Grant>> {
        self.grants
            .iter()
            .map(|g| g.replace(SUBJECT_PLACEHOLDER, "*").parse())
            .collect()
    }
}

/// A wallet of either kind as the node keys and compares it: an Ed25519
/// key as [`normalize_wallet`] has it, or an EVM address (`0x` and 40 hex,
/// EIP-55 checked when mixed case) in lower case with its `0x`.
pub fn normalize_any_wallet(wallet: &str) -> Result<String> {
    let w = wallet.trim();
    if w.len() == 42 && w.starts_with("0x") {
        return normalize_evm_address(w);
    }
    normalize_wallet(w)
}

/// A wallet grant: a grant that parses, `{sub}` only as the placeholder and
/// only in its resource, still valid with an address in its place, and no
/// forbidden domain.
fn check_grant(g: &str) -> Result<()> {
    let parsed: Grant = g.parse()?;
    let invalid = |reason| AuthError::InvalidGrant {
        grant: g.chars().take(64).collect(),
        reason,
    };
    if FORBIDDEN_DOMAINS.contains(&parsed.domain()) {
        return Err(invalid(
            "a wallet role may not hold keys, namespace, db or * grants",
        ));
    }
    if parsed
        .resource()
        .replace(SUBJECT_PLACEHOLDER, "")
        .contains(['{', '}'])
    {
        return Err(invalid("{sub} is the only placeholder"));
    }
    // The longest a resource gets once an address replaces each `{sub}`.
    let sample = g.replace(SUBJECT_PLACEHOLDER, &"0".repeat(64));
    sample.parse::<Grant>()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const W1: &str = "3b6a27bcceb6a42d62a3a8d02a6f0d73653215771de243a63ac048a18b59da29";
    const W2: &str = "d75a980182b10ab7d54bfed3c964073a0ee172f3daa62325af021a68f707511a";

    fn owned(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    /// The default role is `wallet` with no grants; an enabled setting must
    /// name its wallets; a disabled one admits nobody.
    #[test]
    fn defaults_and_the_allow_choice() {
        let s = WalletSignIn::new(true, None, Vec::new(), Some(WalletAllow::Any)).unwrap();
        assert_eq!((s.role.as_str(), s.grants.len()), ("wallet", 0));
        assert!(s.admits(W1).is_ok());
        assert!(matches!(
            WalletSignIn::new(true, None, Vec::new(), None),
            Err(AuthError::InvalidWalletSignIn(_))
        ));
        let off = WalletSignIn::new(false, None, Vec::new(), None).unwrap();
        assert!(matches!(
            off.admits(W1),
            Err(AuthError::WalletSignInDisabled)
        ));
    }

    /// An allow list admits exactly its (normalized) wallets.
    #[test]
    fn allow_list_admits_only_its_wallets() {
        let list = WalletAllow::Only(vec![format!("0x{}", W1.to_uppercase()), W1.into()]);
        let s = WalletSignIn::new(true, None, Vec::new(), Some(list)).unwrap();
        assert_eq!(s.allow, WalletAllow::Only(vec![W1.into()]));
        assert!(s.admits(W1).is_ok());
        assert!(matches!(s.admits(W2), Err(AuthError::WalletNotAllowed)));
        let bad = WalletAllow::Only(vec!["abc".into()]);
        assert!(matches!(
            WalletSignIn::new(true, None, Vec::new(), Some(bad)),
            Err(AuthError::InvalidWallet(_))
        ));
        let many = WalletAllow::Only(vec![W1.to_string(); MAX_WALLET_ALLOW + 1]);
        assert!(matches!(
            WalletSignIn::new(true, None, Vec::new(), Some(many)),
            Err(AuthError::InvalidWalletSignIn(_))
        ));
    }

    /// Built-in role names and non-labels are refused as wallet roles.
    #[test]
    fn role_is_a_label_never_a_built_in_role() {
        for r in [
            "owner",
            "Admin",
            "developer",
            "runtime",
            "reader",
            "",
            "a b",
            "ÿ",
        ] {
            assert!(
                WalletSignIn::new(true, Some(r.into()), Vec::new(), Some(WalletAllow::Any))
                    .is_err(),
                "{r:?}"
            );
        }
        let long = "x".repeat(33);
        assert!(WalletSignIn::new(true, Some(long), Vec::new(), Some(WalletAllow::Any)).is_err());
        let s = WalletSignIn::new(
            true,
            Some("app-user_2".into()),
            Vec::new(),
            Some(WalletAllow::Any),
        );
        assert_eq!(s.unwrap().role, "app-user_2");
    }

    /// `{sub}` becomes the wallet's address in its grants, and `*` in the
    /// bound a setter must hold.
    #[test]
    fn sub_is_substituted() {
        let g = owned(&["kv:read:users/{sub}/*", "pubsub:subscribe:user.{sub}.*"]);
        let s = WalletSignIn::new(true, None, g, Some(WalletAllow::Any)).unwrap();
        assert_eq!(
            s.grants_for(W1),
            vec![
                format!("kv:read:users/{W1}/*"),
                format!("pubsub:subscribe:user.{W1}.*")
            ]
        );
        let bound: Vec<String> = s
            .grant_bound()
            .unwrap()
            .iter()
            .map(|g| g.to_string())
            .collect();
        assert_eq!(bound, ["kv:read:users/*/*", "pubsub:subscribe:user.*.*"]);
        let granted: Vec<Grant> = crate::auth::parse_grants(&s.grants_for(W1)).unwrap();
        assert!(crate::auth::allows(
            &granted,
            "kv",
            "read",
            &format!("users/{W1}/a")
        ));
        assert!(!crate::auth::allows(
            &granted,
            "kv",
            "read",
            &format!("users/{W2}/a")
        ));
        assert!(!crate::auth::allows(
            &granted,
            "kv",
            "write",
            &format!("users/{W1}/a")
        ));
    }

    /// Bad grants: unparseable, a forbidden domain, a stray placeholder, or
    /// too long once an address replaces `{sub}`.
    #[test]
    fn bad_grants_are_refused() {
        let too_long = format!("kv:read:{}{{sub}}", "a".repeat(200));
        for g in [
            "kv:read",
            "nope:read:*",
            "*:read:*",
            "keys:write:*",
            "namespace:admin:*",
            "db:admin:*",
            "kv:read:{user}/*",
            "kv:read:{sub",
            too_long.as_str(),
        ] {
            let r = WalletSignIn::new(true, None, owned(&[g]), Some(WalletAllow::Any));
            assert!(
                matches!(r, Err(AuthError::InvalidGrant { .. })),
                "{g}: {r:?}"
            );
        }
        let many = vec!["kv:read:*".to_string(); MAX_WALLET_GRANTS + 1];
        assert!(WalletSignIn::new(true, None, many, Some(WalletAllow::Any)).is_err());
    }

    /// `allow` reads `"any"` or a list, nothing else, and writes back the same.
    #[test]
    fn allow_serde() {
        let any: WalletAllow = serde_json::from_str("\"any\"").unwrap();
        assert_eq!(any, WalletAllow::Any);
        assert_eq!(serde_json::to_string(&any).unwrap(), "\"any\"");
        let list: WalletAllow = serde_json::from_str(&format!("[\"{W1}\"]")).unwrap();
        assert_eq!(serde_json::to_string(&list).unwrap(), format!("[\"{W1}\"]"));
        assert!(serde_json::from_str::<WalletAllow>("\"all\"").is_err());
        assert!(serde_json::from_str::<WalletAllow>("7").is_err());
    }
}
