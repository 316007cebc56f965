//! The node's mesh identity: an Ed25519 libp2p keypair kept in
//! `<data_dir>/mesh.key`, so the node's PeerId (its name in the mesh
//! registry) survives restarts.

use super::{MeshError, MeshResult};
use libp2p::identity::Keypair;
use std::io::Write;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::Path;

/// The key file's name inside the data folder.
pub const KEY_FILE: &str = "mesh.key";

/// Loads the node's mesh keypair from `<data_dir>/mesh.key`, generating and
/// saving one (mode 0600) on first start. The file holds the 32-byte Ed25519
/// secret, raw.
pub fn load_or_create_keypair(data_dir: &Path) -> MeshResult<Keypair> {
    let path = data_dir.join(KEY_FILE);
    let bad = |reason: String| MeshError::Key {
        path: path.display().to_string(),
        reason,
    };
    match std::fs::read(&path) {
        Ok(bytes) => {
            let mode = std::fs::metadata(&path)
                .map_err(|e| bad(e.to_string()))?
                .permissions()
                .mode();
            if mode & 0o077 != 0 {
                return Err(bad(format!(
                    "readable by others (mode {:o}); chmod 600 it",
                    mode & 0o777
                )));
            }
            if bytes.len() != 32 {
                return Err(bad(format!("{} bytes, expected 32", bytes.len())));
            }
            Keypair::ed25519_from_bytes(bytes).map_err(|e| bad(e.to_string()))
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            std::fs::create_dir_all(data_dir).map_err(|e| bad(e.to_string()))?;
            let keypair = Keypair::generate_ed25519();
            let secret = keypair
                .clone()
                .try_into_ed25519()
                .expect("generated as ed25519")
                .secret();
            // Written to a temporary file first so a crash never leaves a
            // truncated key behind; created 0600 so it is never readable by others.
            let tmp = data_dir.join(format!("{KEY_FILE}.tmp"));
            let _ = std::fs::remove_file(&tmp);
            let mut f = std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o600)
                .open(&tmp)
                .map_err(|e| bad(e.to_string()))?;
            f.write_all(secret.as_ref())
                .and_then(|_| f.sync_all())
                .map_err(|e| bad(e.to_string()))?;
            std::fs::rename(&tmp, &path).map_err(|e| bad(e.to_string()))?;
            tracing::info!(peer_id = %keypair.public().to_peer_id(), "Mesh identity created.");
            Ok(keypair)
        }
        Err(e) => Err(bad(e.to_string())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The key is created 0600 on first start and gives the same PeerId after.
    #[test]
    fn keypair_is_created_private_and_stable() {
        let dir = tempfile::tempdir().unwrap();
        let first = load_or_create_keypair(dir.path()).unwrap();
        let mode = std::fs::metadata(dir.path().join(KEY_FILE))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
        let second = load_or_create_keypair(dir.path()).unwrap();
        assert_eq!(first.public().to_peer_id(), second.public().to_peer_id());
    }

    /// A key file others can read, or of the wrong size, is refused.
    #[test]
    fn bad_key_file_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        load_or_create_keypair(dir.path()).unwrap();
        let path = dir.path().join(KEY_FILE);
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        assert!(matches!(
            load_or_create_keypair(dir.path()),
            Err(MeshError::Key { .. })
        ));
        std::fs::write(&path, b"short").unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
        assert!(matches!(
            load_or_create_keypair(dir.path()),
            Err(MeshError::Key { .. })
        ));
    }
}
