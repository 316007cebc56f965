//! Static sites: a `.tar.gz` unpacked in memory and checked whole before
//! anything is stored. Paths that climb out of the site (`..`, absolute paths)
//! and links that point out of it are refused; links inside it serve their
//! target's bytes. Other entry kinds (devices, fifos) are refused.

use super::model::SiteFile;
use crate::error::ApiError;
use crate::error::Code;
use std::collections::BTreeMap;
use std::io::Read;

/// Limits of one site.
#[derive(Debug, Clone, Copy)]
pub struct SiteLimits {
    /// Most bytes the regular files may add up to (`max_site_unpacked_bytes`
    /// in the config); past it the upload is refused with 413.
    pub max_unpacked_bytes: u64,
    /// Most file and link entries (directories not counted; `max_site_files`).
    pub max_files: usize,
}

/// An unpacked site: its manifest and the distinct contents to store.
pub struct Site {
    /// Every file (links resolved to their target's contents) by site path.
    pub files: BTreeMap<String, SiteFile>,
    /// Distinct file contents by sha256 (hex).
    pub blobs: BTreeMap<String, Vec<u8>>,
    /// Sum of the regular files' sizes, in bytes (at most `max_unpacked_bytes`).
    pub total_bytes: u64,
}

fn unsafe_tar(msg: String) -> ApiError {
    ApiError::new(Code::UnsafeTarball, msg)
}

/// The path of an entry inside the site (`a/b.html`), or why it is refused.
/// Leading `./` is allowed; `..`, absolute paths and empty names are not.
fn site_path(raw: &[u8]) -> Result<Option<String>, ApiError> {
    let s = std::str::from_utf8(raw)
        .map_err(|_| ApiError::new(Code::InvalidTarball, "an entry name is not UTF-8"))?;
    if s.starts_with('/') {
        return Err(unsafe_tar(format!("entry {s:?} is an absolute path")));
    }
    let mut parts = Vec::new();
    for seg in s.split('/') {
        match seg {
            "" | "." => {}
            ".." => return Err(unsafe_tar(format!("entry {s:?} climbs out of the site"))),
            seg if seg.contains('\\') || seg.bytes().any(|b| b < 0x20) => {
                return Err(unsafe_tar(format!("entry {s:?} has a forbidden character")));
            }
            seg => parts.push(seg),
        }
    }
    Ok((!parts.is_empty()).then(|| parts.join("/")))
}

/// Resolves a link target relative to the link's folder; None when it leaves the site.
fn resolve_link(link_path: &str, target: &str, hard: bool) -> Option<String> {
    if target.starts_with('/') {
        return None;
    }
    // Hard-link targets are archive paths; symlink targets are relative to the link.
    let mut parts: Vec<&str> = if hard {
        Vec::new()
    } else {
        let mut p: Vec<&str> = link_path.split('/').collect();
        p.pop();
        p
    };
    for seg in target.split('/') {
        match seg {
            "" | "." => {}
            ".." => {
                parts.pop()?;
            }
            s => parts.push(s),
        }
    }
    (!parts.is_empty()).then(|| parts.join("/"))
}

/// The content type served for a path.
pub fn content_type(path: &str) -> String {
    let m = mime_guess::from_path(path).first_or_octet_stream();
    let s = m.essence_str().to_string();
    if m.type_() == mime_guess::mime::TEXT
        || s == "application/javascript"
        || s == "application/json"
        || s == "image/svg+xml"
    {
        format!("{s}; charset=utf-8")
    } else {
        s
    }
}

fn sha256_hex(b: &[u8]) -> String {
    hex::encode(ring::digest::digest(&ring::digest::SHA256, b).as_ref())
}

/// Unpacks and checks a gzip-compressed tarball.
pub fn unpack(gz: &[u8], limits: SiteLimits) -> Result<Site, ApiError> {
    let bad = |e: std::io::Error| {
        ApiError::new(
            Code::InvalidTarball,
            format!("the tarball does not read as .tar.gz: {e}"),
        )
    };
    let mut archive = tar::Archive::new(flate2::read::GzDecoder::new(gz));
    let mut contents: BTreeMap<String, Vec<u8>> = BTreeMap::new();
    let mut links: Vec<(String, String, bool)> = Vec::new();
    let mut total: u64 = 0;
    for entry in archive.entries().map_err(bad)? {
        let mut entry = entry.map_err(bad)?;
        let raw_path = entry.path_bytes().into_owned();
        let kind = entry.header().entry_type();
        let path = site_path(&raw_path)?;
        if contents.len() + links.len() >= limits.max_files {
            return Err(ApiError::new(
                Code::SiteTooLarge,
                format!("a site has at most {} files", limits.max_files),
            ));
        }
        use tar::EntryType as E;
        match kind {
            E::Directory => {}
            E::Regular | E::Continuous | E::GNUSparse => {
                let Some(path) = path else {
                    return Err(unsafe_tar("a file entry has no name".into()));
                };
                let size = entry.size();
                total = total.saturating_add(size);
                if total > limits.max_unpacked_bytes {
                    return Err(ApiError::new(
                        Code::SiteTooLarge,
                        format!(
                            "the site unpacks to more than {} bytes",
                            limits.max_unpacked_bytes
                        ),
                    ));
                }
                let mut buf = Vec::with_capacity(size.min(1 << 20) as usize);
                entry
                    .by_ref()
                    .take(size)
                    .read_to_end(&mut buf)
                    .map_err(bad)?;
                contents.insert(path, buf);
            }
            E::Symlink | E::Link => {
                let Some(path) = path else {
                    return Err(unsafe_tar("a link entry has no name".into()));
                };
                let target = entry
                    .link_name_bytes()
                    .map(|b| String::from_utf8_lossy(&b).into_owned())
                    .unwrap_or_default();
                let resolved = resolve_link(&path, &target, kind == E::Link).ok_or_else(|| {
                    unsafe_tar(format!(
                        "link {path:?} -> {target:?} points out of the site"
                    ))
                })?;
                links.push((path, resolved, kind == E::Link));
            }
            // pax and GNU long-name headers are consumed by the tar reader itself.
            E::XGlobalHeader | E::XHeader | E::GNULongName | E::GNULongLink => {}
            other => {
                return Err(unsafe_tar(format!(
                    "entry {:?} is a {other:?}, not a file, folder or link",
                    String::from_utf8_lossy(&raw_path)
                )));
            }
        }
    }
    // Links resolve to files of the site (following link chains a bounded number of times).
    let link_map: BTreeMap<String, String> = links
        .iter()
        .map(|(p, t, _)| (p.clone(), t.clone()))
        .collect();
    for (path, target, _) in &links {
        let mut t = target.clone();
        let mut hops = 0;
        while let Some(next) = link_map.get(&t) {
            hops += 1;
            if hops > 8 {
                return Err(unsafe_tar(format!("link {path:?} is part of a loop")));
            }
            t = next.clone();
        }
        let Some(bytes) = contents.get(&t).cloned() else {
            return Err(unsafe_tar(format!(
                "link {path:?} points to {target:?}, which is not a file of the site"
            )));
        };
        contents.insert(path.clone(), bytes);
    }
    let mut files = BTreeMap::new();
    let mut blobs = BTreeMap::new();
    for (path, bytes) in contents {
        let sha = sha256_hex(&bytes);
        files.insert(
            path.clone(),
            SiteFile {
                sha256: sha.clone(),
                size: bytes.len() as u64,
                content_type: content_type(&path),
            },
        );
        blobs.entry(sha).or_insert(bytes);
    }
    if files.is_empty() {
        return Err(ApiError::new(
            Code::InvalidTarball,
            "the tarball holds no files",
        ));
    }
    Ok(Site {
        files,
        blobs,
        total_bytes: total,
    })
}

/// Packs a folder into a `.tar.gz` (the CLI's `deploy static`). Symlinks are
/// stored as links, so the node's checks apply to them.
pub fn pack_dir(dir: &std::path::Path) -> std::io::Result<Vec<u8>> {
    let gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    let mut b = tar::Builder::new(gz);
    b.follow_symlinks(false);
    b.append_dir_all(".", dir)?;
    b.into_inner()?.finish()
}

#[cfg(test)]
pub mod tests {
    use super::*;

    const LIMITS: SiteLimits = SiteLimits {
        max_unpacked_bytes: 1 << 20,
        max_files: 100,
    };

    /// Builds a tarball from (path, kind, data-or-link-target) entries, writing the
    /// names raw so that hostile names can be made.
    pub fn tarball(entries: &[(&str, char, &[u8])]) -> Vec<u8> {
        let gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        let mut b = tar::Builder::new(gz);
        for (path, kind, data) in entries {
            let mut h = tar::Header::new_gnu();
            let name = h.as_gnu_mut().unwrap();
            name.name[..path.len()].copy_from_slice(path.as_bytes());
            h.set_mode(0o644);
            match kind {
                'f' => {
                    h.set_entry_type(tar::EntryType::Regular);
                    h.set_size(data.len() as u64);
                    h.set_cksum();
                    b.append(&h, *data).unwrap();
                }
                'd' => {
                    h.set_entry_type(tar::EntryType::Directory);
                    h.set_size(0);
                    h.set_cksum();
                    b.append(&h, &[][..]).unwrap();
                }
                's' | 'h' => {
                    h.set_entry_type(if *kind == 's' {
                        tar::EntryType::Symlink
                    } else {
                        tar::EntryType::Link
                    });
                    h.set_size(0);
                    h.set_link_name_literal(std::str::from_utf8(data).unwrap())
                        .unwrap();
                    h.set_cksum();
                    b.append(&h, &[][..]).unwrap();
                }
                'c' => {
                    h.set_entry_type(tar::EntryType::Char);
                    h.set_size(0);
                    h.set_cksum();
                    b.append(&h, &[][..]).unwrap();
                }
                _ => unreachable!(),
            }
        }
        b.into_inner().unwrap().finish().unwrap()
    }

    /// Files, folders and an inside link unpack with their types and hashes.
    #[test]
    fn unpacks_a_site() {
        let t = tarball(&[
            ("./", 'd', b""),
            ("./index.html", 'f', b"<h1>hi</h1>"),
            ("./css/app.css", 'f', b"body{}"),
            ("./home.html", 's', b"index.html"),
        ]);
        let s = unpack(&t, LIMITS).unwrap();
        assert_eq!(
            s.files.keys().collect::<Vec<_>>(),
            ["css/app.css", "home.html", "index.html"]
        );
        assert_eq!(
            s.files["index.html"].content_type,
            "text/html; charset=utf-8"
        );
        assert_eq!(
            s.files["css/app.css"].content_type,
            "text/css; charset=utf-8"
        );
        assert_eq!(s.files["home.html"].sha256, s.files["index.html"].sha256);
        assert_eq!(s.blobs.len(), 2);
    }

    /// `..`, absolute paths, links out of the site and devices are refused.
    #[test]
    fn refuses_escapes() {
        let cases: Vec<Vec<u8>> = vec![
            tarball(&[("../evil", 'f', b"x")]),
            tarball(&[("a/../../evil", 'f', b"x")]),
            tarball(&[("/etc/passwd", 'f', b"x")]),
            tarball(&[("index.html", 'f', b"x"), ("up", 's', b"../../etc/passwd")]),
            tarball(&[("index.html", 'f', b"x"), ("abs", 's', b"/etc/passwd")]),
            tarball(&[("index.html", 'f', b"x"), ("hard", 'h', b"../x")]),
            tarball(&[("dev", 'c', b"")]),
        ];
        for (i, t) in cases.iter().enumerate() {
            let e = unpack(t, LIMITS)
                .err()
                .unwrap_or_else(|| panic!("case {i} passed"));
            assert_eq!(e.code, "UNSAFE_TARBALL", "case {i}: {e}");
        }
    }

    /// Size and count limits, garbage and empty archives give their own codes.
    #[test]
    fn limits_and_garbage() {
        let big = vec![b'x'; 2 << 20];
        let e = unpack(&tarball(&[("big", 'f', &big)]), LIMITS)
            .err()
            .unwrap();
        assert_eq!(e.code, "SITE_TOO_LARGE");
        let e = unpack(b"not a tarball", LIMITS).err().unwrap();
        assert_eq!(e.code, "INVALID_TARBALL");
        let e = unpack(&tarball(&[("d/", 'd', b"")]), LIMITS).err().unwrap();
        assert_eq!(e.code, "INVALID_TARBALL");
        let many: Vec<(String, char, &[u8])> = (0..101)
            .map(|i| (format!("f{i}"), 'f', &b"x"[..]))
            .collect();
        let refs: Vec<(&str, char, &[u8])> =
            many.iter().map(|(p, k, d)| (p.as_str(), *k, *d)).collect();
        let e = unpack(&tarball(&refs), LIMITS).err().unwrap();
        assert_eq!(e.code, "SITE_TOO_LARGE");
    }

    /// A packed folder unpacks to the same files.
    #[test]
    fn pack_dir_round_trips() {
        let d = tempfile::tempdir().unwrap();
        std::fs::create_dir(d.path().join("sub")).unwrap();
        std::fs::write(d.path().join("index.html"), "i").unwrap();
        std::fs::write(d.path().join("sub/a.js"), "a").unwrap();
        let s = unpack(&pack_dir(d.path()).unwrap(), LIMITS).unwrap();
        assert_eq!(
            s.files.keys().collect::<Vec<_>>(),
            ["index.html", "sub/a.js"]
        );
        assert_eq!(
            s.files["sub/a.js"].content_type,
            "text/javascript; charset=utf-8"
        );
    }
}
