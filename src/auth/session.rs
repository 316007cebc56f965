//! Sessions: the device id a client names at sign-in and the session id
//! the node mints for it (the `did` and `sid` claims).

use ring::rand::{SecureRandom, SystemRandom};

use super::error::{AuthError, Result};

/// Longest `device_id`, in characters.
pub const MAX_DEVICE_ID: usize = 64;

/// Checks a client-chosen device id: 1 to [`MAX_DEVICE_ID`] characters of
/// `A-Z a-z 0-9 . _ : -` (safe in a store key, a header and a log line).
pub fn check_device_id(id: &str) -> Result<()> {
    if id.is_empty() {
        return Err(AuthError::InvalidDeviceId("it is empty"));
    }
    if id.len() > MAX_DEVICE_ID {
        return Err(AuthError::InvalidDeviceId(
            "it is longer than 64 characters",
        ));
    }
    if !id
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b':' | b'-'))
    {
        return Err(AuthError::InvalidDeviceId(
            "only A-Z a-z 0-9 . _ : - are allowed",
        ));
    }
    Ok(())
}

/// A fresh session id: `s_` + 16 random bytes in hex.
pub fn new_session_id() -> Result<String> {
    let mut b = [0u8; 16];
    SystemRandom::new()
        .fill(&mut b)
        .map_err(|_| AuthError::Random)?;
    Ok(format!("s_{}", hex::encode(b)))
}

/// Whether `sid` has the shape [`new_session_id`] gives (checked before
/// any lookup).
pub fn is_session_id_shaped(sid: &str) -> bool {
    sid.strip_prefix("s_")
        .is_some_and(|h| h.len() == 32 && h.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Safe ids pass; empty, long, spaced or odd-character ids do not.
    #[test]
    fn device_ids() {
        for ok in ["a", "phone-1", "ios:ABC.def_9", &"x".repeat(64)] {
            assert!(check_device_id(ok).is_ok(), "{ok}");
        }
        for bad in ["", "my phone", &"x".repeat(65), "a/b", "é", "a\nb"] {
            assert!(
                matches!(check_device_id(bad), Err(AuthError::InvalidDeviceId(_))),
                "{bad:?}"
            );
        }
    }

    /// Session ids are fresh and shaped.
    #[test]
    fn session_ids() {
        let a = new_session_id().unwrap();
        assert!(is_session_id_shaped(&a));
        assert_ne!(a, new_session_id().unwrap());
        assert!(!is_session_id_shaped("s_xyz"));
        assert!(!is_session_id_shaped(&a.to_uppercase()));
    }
}
