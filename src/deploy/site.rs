//! Static sites: a `.tar.gz` unpacked streaming, entry by entry, into a
//! temporary folder under the data folder, and checked whole before
//! anything is stored. Paths that climb out of the site (`..`, absolute
//! paths) and links that point out of it are refused; links inside it serve
//! their target's bytes. Other entry kinds (devices, fifos, sparse files)
//! are refused.
//!
//! Memory stays flat whatever the archive's shape: the gzip stream is read
//! through one bounded buffer, each file's bytes go to its own temporary file
//! as they arrive (hashed on the way), and the running totals are checked
//! against the limits before each entry's bytes are read, from its header,
//! and again as they arrive. The decompressed stream as a whole is bounded
//! too (data, headers and metadata entries), so a bomb of folders or of
//! skipped bytes is cut as early as one of files. The tar reader's own
//! handling of GNU long names and pax headers reads them whole into memory,
//! so entries are read raw and those are read here, each bounded.

use super::model::SiteFile;
use crate::error::ApiError;
use crate::error::Code;
use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

/// Limits of one site.
#[derive(Debug, Clone, Copy)]
pub struct SiteLimits {
    /// Most bytes the regular files may add up to (`max_site_unpacked_bytes`
    /// in the config); past it the upload is refused with 413.
    pub max_unpacked_bytes: u64,
    /// Most file and link entries (directories not counted; `max_site_files`).
    pub max_files: usize,
    /// Largest single file (`max_site_file_bytes`); past it 413.
    pub max_file_bytes: u64,
}

/// Longest GNU long name or long link name read, in bytes.
const MAX_LONG_NAME: u64 = 4096;
/// Largest pax extended header read, in bytes.
const MAX_PAX_HEADER: u64 = 64 << 10;
/// Bytes read from the gzip stream at a time, and written to a file.
const CHUNK: usize = 64 << 10;

/// An unpacked site: its manifest and the distinct contents to store, in
/// files of its [`SiteDir`].
pub struct Site {
    /// Every file (links resolved to their target's contents) by site path.
    pub files: BTreeMap<String, SiteFile>,
    /// Distinct file contents by sha256 (hex): the temporary file holding them.
    pub blobs: BTreeMap<String, PathBuf>,
    /// Sum of the regular files' sizes, in bytes (at most `max_unpacked_bytes`).
    pub total_bytes: u64,
}

/// A temporary folder of one site deploy under `<data_dir>/tmp/`: the
/// uploaded tarball and the unpacked files. Removed with everything in it
/// when dropped, on every path (refusal, failure or success); a node that
/// stopped mid-deploy removes what is left at its next start
/// ([`clear_leftovers`]).
pub struct SiteDir {
    /// The folder, created by [`SiteDir::create`].
    path: PathBuf,
}

/// The folder of the temporary site folders.
fn tmp_root(data_dir: &Path) -> PathBuf {
    data_dir.join("tmp")
}

impl SiteDir {
    /// A new empty folder `<data_dir>/tmp/site-<random>`.
    pub fn create(data_dir: &Path) -> std::io::Result<SiteDir> {
        let path = tmp_root(data_dir).join(format!(
            "site-{}",
            hex::encode(crate::util::random_bytes::<8>())
        ));
        std::fs::create_dir_all(&path)?;
        Ok(SiteDir { path })
    }

    /// The folder.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Where the uploaded tarball is written.
    pub fn upload_path(&self) -> PathBuf {
        self.path.join("upload.tar.gz")
    }
}

impl Drop for SiteDir {
    /// Removes the folder: on a blocking thread when dropped on a runtime
    /// (a site may hold thousands of files), else here.
    fn drop(&mut self) {
        let path = std::mem::take(&mut self.path);
        let remove = move || {
            if let Err(e) = std::fs::remove_dir_all(&path)
                && e.kind() != std::io::ErrorKind::NotFound
            {
                tracing::warn!(path = %path.display(), error = %e, "Temporary site folder not removed.");
            }
        };
        match tokio::runtime::Handle::try_current() {
            Ok(rt) => drop(rt.spawn_blocking(remove)),
            Err(_) => remove(),
        }
    }
}

/// Removes the temporary site folders a previous run left (it stopped in
/// the middle of a deploy); called at start, before any deploy.
pub fn clear_leftovers(data_dir: &Path) {
    let root = tmp_root(data_dir);
    let Ok(entries) = std::fs::read_dir(&root) else {
        return;
    };
    for e in entries.flatten() {
        if e.file_name().to_string_lossy().starts_with("site-") {
            let _ = std::fs::remove_dir_all(e.path());
        }
    }
}

/// The decompressed stream, counted: past `cap` bytes it fails, and says so.
struct Capped<R> {
    /// The gzip decoder.
    inner: R,
    /// Bytes read so far.
    read: u64,
    /// Most bytes it gives.
    cap: u64,
    /// Set when a read went past `cap` (shared with [`unpack`]).
    over: std::rc::Rc<std::cell::Cell<bool>>,
}

impl<R: Read> Read for Capped<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.read += n as u64;
        if self.read > self.cap {
            self.over.set(true);
            return Err(std::io::Error::other(
                "the decompressed tarball is too large",
            ));
        }
        Ok(n)
    }
}

fn too_large(msg: String) -> ApiError {
    ApiError::new(Code::SiteTooLarge, msg)
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

/// Reads a metadata entry (long name, pax header) of at most `max` bytes.
fn read_meta(entry: &mut impl Read, size: u64, max: u64, what: &str) -> Result<Vec<u8>, ApiError> {
    if size > max {
        return Err(ApiError::new(
            Code::InvalidTarball,
            format!("a {what} entry of {size} bytes (at most {max})"),
        ));
    }
    let mut buf = Vec::with_capacity(size as usize);
    entry.take(size).read_to_end(&mut buf).map_err(|e| {
        ApiError::new(
            Code::InvalidTarball,
            format!("the tarball does not read as .tar.gz: {e}"),
        )
    })?;
    while buf.last() == Some(&0) {
        buf.pop();
    }
    Ok(buf)
}

/// One regular file unpacked into the site folder.
struct Unpacked {
    /// SHA-256 (hex) of its bytes.
    sha256: String,
    /// Its size.
    size: u64,
}

/// Unpacks and checks a gzip-compressed tarball read from `gz` into `dir`
/// (the caller's [`SiteDir`], which removes what is written on every path).
pub fn unpack(gz: impl Read, dir: &Path, limits: SiteLimits) -> Result<Site, ApiError> {
    let over = std::rc::Rc::new(std::cell::Cell::new(false));
    // Everything the archive may hold: the files, and a header, padding
    // and a bounded metadata entry or two for each entry.
    let max_entries = limits.max_files.saturating_mul(4).saturating_add(64);
    let cap = limits
        .max_unpacked_bytes
        .saturating_add((max_entries as u64).saturating_mul(1024))
        .saturating_add(MAX_PAX_HEADER)
        .saturating_add(1 << 20);
    let capped = Capped {
        inner: flate2::read::GzDecoder::new(std::io::BufReader::with_capacity(CHUNK, gz)),
        read: 0,
        cap,
        over: over.clone(),
    };
    let stream_over = || {
        too_large(format!(
            "the tarball decompresses to more than {cap} bytes (files, headers and metadata)"
        ))
    };
    let bad = |e: std::io::Error| {
        ApiError::new(
            Code::InvalidTarball,
            format!("the tarball does not read as .tar.gz: {e}"),
        )
    };
    let mut archive = tar::Archive::new(capped);
    let mut contents: BTreeMap<String, Unpacked> = BTreeMap::new();
    let mut blobs: BTreeMap<String, PathBuf> = BTreeMap::new();
    let mut links: Vec<(String, String, bool)> = Vec::new();
    let mut total: u64 = 0;
    let mut raw_entries = 0usize;
    // What the metadata entries say of the next entry.
    let (mut long_name, mut long_link): (Option<Vec<u8>>, Option<Vec<u8>>) = (None, None);
    let (mut pax_path, mut pax_link): (Option<Vec<u8>>, Option<Vec<u8>>) = (None, None);
    let mut buf = vec![0u8; CHUNK];
    let entries = archive.entries().map_err(bad)?.raw(true);
    for entry in entries {
        let mut entry = match entry {
            Ok(e) => e,
            Err(_) if over.get() => return Err(stream_over()),
            Err(e) => return Err(bad(e)),
        };
        raw_entries += 1;
        if raw_entries > max_entries {
            return Err(too_large(format!(
                "the tarball has more than {max_entries} entries"
            )));
        }
        let kind = entry.header().entry_type();
        let size = entry.header().entry_size().map_err(bad)?;
        use tar::EntryType as E;
        let meta = |r: Result<Vec<u8>, ApiError>| match r {
            Err(_) if over.get() => Err(stream_over()),
            other => other,
        };
        match kind {
            E::GNULongName => {
                long_name = Some(meta(read_meta(
                    &mut entry,
                    size,
                    MAX_LONG_NAME,
                    "long name",
                ))?);
                continue;
            }
            E::GNULongLink => {
                long_link = Some(meta(read_meta(
                    &mut entry,
                    size,
                    MAX_LONG_NAME,
                    "long link",
                ))?);
                continue;
            }
            E::XHeader => {
                let data = meta(read_meta(&mut entry, size, MAX_PAX_HEADER, "pax header"))?;
                for ext in tar::PaxExtensions::new(&data) {
                    let ext = ext.map_err(bad)?;
                    match ext.key_bytes() {
                        b"path" => pax_path = Some(ext.value_bytes().to_vec()),
                        b"linkpath" => pax_link = Some(ext.value_bytes().to_vec()),
                        // The raw reader skips by the header's size: another
                        // size would read the archive out of step.
                        b"size" => {
                            return Err(ApiError::new(
                                Code::InvalidTarball,
                                "pax size records are not supported (files over 8 GiB)",
                            ));
                        }
                        _ => {}
                    }
                }
                continue;
            }
            // Its bytes are skipped through the capped stream.
            E::XGlobalHeader => continue,
            _ => {}
        }
        let raw_path = pax_path
            .take()
            .or_else(|| long_name.take())
            .unwrap_or_else(|| entry.header().path_bytes().into_owned());
        let link_target = pax_link
            .take()
            .or_else(|| long_link.take())
            .or_else(|| entry.header().link_name_bytes().map(|b| b.into_owned()));
        (long_name, long_link) = (None, None);
        let path = site_path(&raw_path)?;
        if contents.len() + links.len() >= limits.max_files {
            return Err(too_large(format!(
                "a site has at most {} files",
                limits.max_files
            )));
        }
        match kind {
            E::Directory => {}
            E::Regular | E::Continuous => {
                let Some(path) = path else {
                    return Err(unsafe_tar("a file entry has no name".into()));
                };
                if size > limits.max_file_bytes {
                    return Err(too_large(format!(
                        "file {path:?} is {size} bytes; a site file is at most {}",
                        limits.max_file_bytes
                    )));
                }
                total = total.saturating_add(size);
                if total > limits.max_unpacked_bytes {
                    return Err(too_large(format!(
                        "the site unpacks to more than {} bytes",
                        limits.max_unpacked_bytes
                    )));
                }
                let tmp = dir.join(format!("f{raw_entries}"));
                let mut out = std::fs::File::create(&tmp)
                    .map_err(|e| ApiError::internal(format!("cannot write a site file: {e}")))?;
                let mut hash = ring::digest::Context::new(&ring::digest::SHA256);
                let mut left = size;
                while left > 0 {
                    let want = (left as usize).min(CHUNK);
                    let n = match entry.read(&mut buf[..want]) {
                        Ok(0) => {
                            return Err(ApiError::new(
                                Code::InvalidTarball,
                                format!("file {path:?} ends before its {size} bytes"),
                            ));
                        }
                        Ok(n) => n,
                        Err(_) if over.get() => return Err(stream_over()),
                        Err(e) => return Err(bad(e)),
                    };
                    hash.update(&buf[..n]);
                    out.write_all(&buf[..n]).map_err(|e| {
                        ApiError::internal(format!("cannot write a site file: {e}"))
                    })?;
                    left -= n as u64;
                }
                drop(out);
                let sha256 = hex::encode(hash.finish().as_ref());
                if blobs.contains_key(&sha256) {
                    let _ = std::fs::remove_file(&tmp);
                } else {
                    blobs.insert(sha256.clone(), tmp);
                }
                contents.insert(path, Unpacked { sha256, size });
            }
            E::Symlink | E::Link => {
                let Some(path) = path else {
                    return Err(unsafe_tar("a link entry has no name".into()));
                };
                let target = link_target
                    .map(|b| String::from_utf8_lossy(&b).into_owned())
                    .unwrap_or_default();
                let resolved = resolve_link(&path, &target, kind == E::Link).ok_or_else(|| {
                    unsafe_tar(format!(
                        "link {path:?} -> {target:?} points out of the site"
                    ))
                })?;
                links.push((path, resolved, kind == E::Link));
            }
            E::GNUSparse => {
                return Err(ApiError::new(
                    Code::InvalidTarball,
                    format!(
                        "entry {:?} is a sparse file; pack the site without --sparse",
                        String::from_utf8_lossy(&raw_path)
                    ),
                ));
            }
            other => {
                return Err(unsafe_tar(format!(
                    "entry {:?} is a {other:?}, not a file, folder or link",
                    String::from_utf8_lossy(&raw_path)
                )));
            }
        }
    }
    if over.get() {
        return Err(stream_over());
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
        let Some(file) = contents.get(&t) else {
            return Err(unsafe_tar(format!(
                "link {path:?} points to {target:?}, which is not a file of the site"
            )));
        };
        let file = Unpacked {
            sha256: file.sha256.clone(),
            size: file.size,
        };
        contents.insert(path.clone(), file);
    }
    let mut files = BTreeMap::new();
    for (path, f) in contents {
        files.insert(
            path.clone(),
            SiteFile {
                sha256: f.sha256,
                size: f.size,
                content_type: content_type(&path),
            },
        );
    }
    if files.is_empty() {
        return Err(ApiError::new(
            Code::InvalidTarball,
            "the tarball holds no files",
        ));
    }
    // Files overwritten by a later entry of the same path are not stored.
    let used: std::collections::BTreeSet<&str> =
        files.values().map(|f| f.sha256.as_str()).collect();
    blobs.retain(|sha, _| used.contains(sha.as_str()));
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
        max_file_bytes: 1 << 20,
    };

    /// Unpacks `t` into a fresh folder (gone when the test ends).
    fn unpack_in(t: &[u8], limits: SiteLimits) -> Result<Site, ApiError> {
        let d = tempfile::tempdir().unwrap();
        unpack(t, d.path(), limits)
    }

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
        let s = unpack_in(&t, LIMITS).unwrap();
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
            let e = unpack_in(t, LIMITS)
                .err()
                .unwrap_or_else(|| panic!("case {i} passed"));
            assert_eq!(e.code, "UNSAFE_TARBALL", "case {i}: {e}");
        }
    }

    /// Size and count limits, garbage and empty archives give their own codes.
    #[test]
    fn limits_and_garbage() {
        let big = vec![b'x'; 2 << 20];
        let e = unpack_in(&tarball(&[("big", 'f', &big)]), LIMITS)
            .err()
            .unwrap();
        assert_eq!(e.code, "SITE_TOO_LARGE");
        let e = unpack_in(b"not a tarball", LIMITS).err().unwrap();
        assert_eq!(e.code, "INVALID_TARBALL");
        let e = unpack_in(&tarball(&[("d/", 'd', b"")]), LIMITS)
            .err()
            .unwrap();
        assert_eq!(e.code, "INVALID_TARBALL");
        let many: Vec<(String, char, &[u8])> = (0..101)
            .map(|i| (format!("f{i}"), 'f', &b"x"[..]))
            .collect();
        let refs: Vec<(&str, char, &[u8])> =
            many.iter().map(|(p, k, d)| (p.as_str(), *k, *d)).collect();
        let e = unpack_in(&tarball(&refs), LIMITS).err().unwrap();
        assert_eq!(e.code, "SITE_TOO_LARGE");
    }

    /// A packed folder unpacks to the same files.
    #[test]
    fn pack_dir_round_trips() {
        let d = tempfile::tempdir().unwrap();
        std::fs::create_dir(d.path().join("sub")).unwrap();
        std::fs::write(d.path().join("index.html"), "i").unwrap();
        std::fs::write(d.path().join("sub/a.js"), "a").unwrap();
        let s = unpack_in(&pack_dir(d.path()).unwrap(), LIMITS).unwrap();
        assert_eq!(
            s.files.keys().collect::<Vec<_>>(),
            ["index.html", "sub/a.js"]
        );
        assert_eq!(
            s.files["sub/a.js"].content_type,
            "text/javascript; charset=utf-8"
        );
    }

    /// A raw entry of `kind` with `data`, for the bomb tests.
    fn raw_tarball(entries: &[(&str, tar::EntryType, Vec<u8>)]) -> Vec<u8> {
        let gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        let mut b = tar::Builder::new(gz);
        for (path, kind, data) in entries {
            let mut h = tar::Header::new_gnu();
            h.as_gnu_mut().unwrap().name[..path.len()].copy_from_slice(path.as_bytes());
            h.set_mode(0o644);
            h.set_entry_type(*kind);
            h.set_size(data.len() as u64);
            h.set_cksum();
            b.append(&h, &data[..]).unwrap();
        }
        b.into_inner().unwrap().finish().unwrap()
    }

    /// Distinct bytes of `n` (a compressible run, distinct by its first byte).
    fn filler(n: usize, tag: u8) -> Vec<u8> {
        let mut v = vec![0u8; n];
        v[0] = tag;
        v
    }

    /// Obeyed: a site exactly at the total and per-file limits, with a long
    /// (GNU long name) path, unpacks; each distinct content is one file in
    /// the folder with the bytes and hash of the entry.
    #[test]
    fn site_bounds_obeyed() {
        let d = tempfile::tempdir().unwrap();
        let long = format!("{}/page.html", "a".repeat(150));
        let gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        let mut b = tar::Builder::new(gz);
        for (path, data) in [
            ("one.bin", filler(512 << 10, 1)),
            (long.as_str(), filler(512 << 10, 2)),
        ] {
            let mut h = tar::Header::new_gnu();
            h.set_size(data.len() as u64);
            h.set_mode(0o644);
            b.append_data(&mut h, path, &data[..]).unwrap();
        }
        let t = b.into_inner().unwrap().finish().unwrap();
        let s = unpack(&t[..], d.path(), LIMITS).unwrap();
        assert_eq!(s.total_bytes, 1 << 20);
        assert!(s.files.contains_key(&long), "{:?}", s.files.keys());
        assert_eq!(s.blobs.len(), 2);
        for (sha, path) in &s.blobs {
            let bytes = std::fs::read(path).unwrap();
            assert!(path.starts_with(d.path()));
            assert_eq!(
                &hex::encode(ring::digest::digest(&ring::digest::SHA256, &bytes).as_ref()),
                sha
            );
        }
    }

    /// Violated: a file over the per-file limit, files over the total, a
    /// 1 MiB long-name entry, and folders carrying megabytes of skipped
    /// bytes are each refused with their code.
    #[test]
    fn site_bombs_violated() {
        use tar::EntryType as E;
        let cases = [
            (
                raw_tarball(&[("bomb.bin", E::Regular, filler(8 << 20, 1))]),
                "SITE_TOO_LARGE",
            ),
            (
                raw_tarball(&[
                    ("a", E::Regular, filler(512 << 10, 1)),
                    ("b", E::Regular, filler(512 << 10, 2)),
                    ("c", E::Regular, filler(512 << 10, 3)),
                ]),
                "SITE_TOO_LARGE",
            ),
            (
                raw_tarball(&[
                    ("././@LongLink", E::GNULongName, vec![b'a'; 1 << 20]),
                    ("x", E::Regular, b"x".to_vec()),
                ]),
                "INVALID_TARBALL",
            ),
            (
                raw_tarball(&[
                    ("d1/", E::Directory, filler(1 << 20, 1)),
                    ("d2/", E::Directory, filler(1 << 20, 2)),
                    ("d3/", E::Directory, filler(1 << 20, 3)),
                    ("d4/", E::Directory, filler(1 << 20, 4)),
                    ("x", E::Regular, b"x".to_vec()),
                ]),
                "SITE_TOO_LARGE",
            ),
        ];
        for (i, (t, want)) in cases.iter().enumerate() {
            let e = unpack_in(t, LIMITS)
                .err()
                .unwrap_or_else(|| panic!("case {i} passed"));
            assert_eq!(e.code, *want, "case {i}: {e}");
        }
    }

    // -----------------------------------------------------------------
    // Property tests: generated archives of hostile shapes (climbing and
    // absolute paths, links in and out, hard links, devices, GNU long names
    // and pax paths, sizes about the limits, cut short anywhere) unpack into
    // a folder of their own or are refused with one of the documented codes;
    // nothing is ever written outside that folder, nothing unpacked is a
    // link, and what unpacks keeps the limits.

    use proptest::prelude::*;

    /// One generated entry.
    #[derive(Debug, Clone)]
    struct Gen {
        path: String,
        kind: char,
        /// A file's bytes, or a link's target.
        data: Vec<u8>,
        /// How the name is carried: 0 the header, 1 a GNU long name, 2 a pax path.
        carrier: u8,
    }

    fn segment() -> impl Strategy<Value = String> {
        prop_oneof![
            6 => "[a-c]{1,3}".prop_map(|s| s),
            1 => Just("..".to_string()),
            1 => Just(".".to_string()),
            1 => Just(String::new()),
            1 => Just("a\\b".to_string()),
            1 => Just("x\u{1}".to_string()),
        ]
    }

    fn gen_path() -> impl Strategy<Value = String> {
        (any::<bool>(), proptest::collection::vec(segment(), 1..4)).prop_map(|(abs, segs)| {
            let p = segs.join("/");
            if abs { format!("/{p}") } else { p }
        })
    }

    fn gen_entry() -> impl Strategy<Value = Gen> {
        (
            prop_oneof![6 => Just('f'), 2 => Just('d'), 2 => Just('s'), 2 => Just('h'), 1 => Just('c'), 1 => Just('p')],
            gen_path(),
            proptest::collection::vec(any::<u8>(), 0..48),
            gen_path(),
            prop_oneof![6 => Just(0u8), 1 => Just(1), 1 => Just(2)],
        )
            .prop_map(|(kind, path, bytes, target, carrier)| Gen {
                data: if matches!(kind, 's' | 'h') { target.into_bytes() } else { bytes },
                path,
                kind,
                carrier,
            })
    }

    /// A pax record `<len> <key>=<value>\n`, its length counting itself.
    fn pax_record(key: &str, value: &[u8]) -> Vec<u8> {
        let rest = key.len() + value.len() + 3;
        let mut n = rest + 1;
        while n.to_string().len() + rest != n {
            n += 1;
        }
        let mut out = format!("{n} {key}=").into_bytes();
        out.extend_from_slice(value);
        out.push(b'\n');
        out
    }

    fn build(entries: &[Gen]) -> Vec<u8> {
        use tar::EntryType as E;
        let gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
        let mut b = tar::Builder::new(gz);
        let raw = |b: &mut tar::Builder<_>, name: &[u8], kind: E, link: &[u8], data: &[u8]| {
            let mut h = tar::Header::new_gnu();
            let g = h.as_gnu_mut().unwrap();
            let n = name.len().min(100);
            g.name[..n].copy_from_slice(&name[..n]);
            let l = link.len().min(100);
            g.linkname[..l].copy_from_slice(&link[..l]);
            h.set_mode(0o644);
            h.set_entry_type(kind);
            h.set_size(data.len() as u64);
            h.set_cksum();
            b.append(&h, data).unwrap();
        };
        for e in entries {
            let (kind, link, data): (E, &[u8], &[u8]) = match e.kind {
                'f' => (E::Regular, b"", &e.data),
                'd' => (E::Directory, b"", b""),
                's' => (E::Symlink, &e.data, b""),
                'h' => (E::Link, &e.data, b""),
                'c' => (E::Char, b"", b""),
                _ => (E::Fifo, b"", b""),
            };
            let name = match e.carrier {
                1 => {
                    let mut long = e.path.as_bytes().to_vec();
                    long.push(0);
                    raw(&mut b, b"././@LongLink", E::GNULongName, b"", &long);
                    b"ignored".as_slice()
                }
                2 => {
                    let rec = pax_record("path", e.path.as_bytes());
                    raw(&mut b, b"pax", E::XHeader, b"", &rec);
                    b"ignored".as_slice()
                }
                _ => e.path.as_bytes(),
            };
            raw(&mut b, name, kind, link, data);
        }
        b.into_inner().unwrap().finish().unwrap()
    }

    /// Whether `p` names a place inside the site (no climbing, not absolute).
    fn stays_inside(p: &str) -> bool {
        !p.starts_with('/') && p.split('/').all(|s| s != "..")
    }

    /// Everything under `root`, relative, with whether it is a symlink.
    fn walk(root: &Path, out: &mut Vec<(PathBuf, bool)>) {
        for e in std::fs::read_dir(root).unwrap() {
            let e = e.unwrap();
            let t = e.file_type().unwrap();
            out.push((e.path(), t.is_symlink()));
            if t.is_dir() {
                walk(&e.path(), out);
            }
        }
    }

    const CODES: &[&str] = &["UNSAFE_TARBALL", "INVALID_TARBALL", "SITE_TOO_LARGE"];

    proptest! {
        // Each case gzips a small archive and unpacks it into a folder of its
        // own on disk (the file system is the cost: 1000 cases, a few seconds).
        #![proptest_config(ProptestConfig::with_cases(1000))]

        #[test]
        fn archives_unpack_inside_their_folder_or_are_refused(
            entries in proptest::collection::vec(gen_entry(), 0..7),
            max_files in 1usize..6,
            max_file_bytes in 0u64..64,
            max_unpacked_bytes in 0u64..160,
            cut in proptest::option::weighted(0.2, any::<usize>()),
        ) {
            let limits = SiteLimits { max_unpacked_bytes, max_files, max_file_bytes };
            let mut t = build(&entries);
            if let Some(c) = cut {
                t.truncate(c % (t.len() + 1));
            }
            // A folder of its own for each case, under one folder of the thread.
            thread_local!(static ROOT: (tempfile::TempDir, std::cell::Cell<u64>) =
                (tempfile::tempdir().unwrap(), std::cell::Cell::new(0)));
            let root = ROOT.with(|(d, n)| {
                n.set(n.get() + 1);
                d.path().join(format!("case{}", n.get()))
            });
            let dir = root.join("site");
            std::fs::create_dir_all(&dir).unwrap();
            let r = unpack(&t[..], &dir, limits);
            // Nothing but the site folder beside it, and no link anywhere in it.
            let mut all = Vec::new();
            walk(&root, &mut all);
            struct Gone(PathBuf);
            impl Drop for Gone {
                fn drop(&mut self) {
                    let _ = std::fs::remove_dir_all(&self.0);
                }
            }
            let _gone = Gone(root.clone());
            for (p, link) in &all {
                prop_assert!(p.starts_with(&dir), "{p:?} outside the site folder");
                prop_assert!(!link, "{p:?} is a link");
            }
            match r {
                Err(e) => prop_assert!(CODES.contains(&e.code.as_str()), "{e}"),
                Ok(site) => {
                    prop_assert!(cut.is_none() || !site.files.is_empty());
                    // Every entry that named a place climbed nowhere.
                    for e in &entries {
                        prop_assert!(stays_inside(&e.path), "{:?} unpacked", e.path);
                        if e.kind == 's' {
                            prop_assert!(!e.data.starts_with(b"/"));
                        }
                    }
                    prop_assert!(site.total_bytes <= max_unpacked_bytes);
                    prop_assert!(site.files.len() <= max_files);
                    prop_assert!(!site.files.is_empty());
                    for (path, f) in &site.files {
                        prop_assert!(stays_inside(path) && !path.is_empty() && !path.contains("//"));
                        prop_assert!(f.size <= max_file_bytes);
                        let blob = site.blobs.get(&f.sha256);
                        prop_assert!(blob.is_some(), "{path}: no blob");
                        let bytes = std::fs::read(blob.unwrap()).unwrap();
                        prop_assert_eq!(bytes.len() as u64, f.size);
                        prop_assert_eq!(
                            hex::encode(ring::digest::digest(&ring::digest::SHA256, &bytes).as_ref()),
                            f.sha256.clone()
                        );
                    }
                    for p in site.blobs.values() {
                        prop_assert!(p.starts_with(&dir));
                    }
                }
            }
        }

    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(3000))]

        /// Any bytes, gzipped or not: refused with a documented code, never a panic.
        #[test]
        fn any_bytes_are_refused_with_a_documented_code(
            bytes in proptest::collection::vec(any::<u8>(), 0..2048),
            gzip in any::<bool>(),
        ) {
            let t = if gzip {
                let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
                gz.write_all(&bytes).unwrap();
                gz.finish().unwrap()
            } else {
                bytes
            };
            thread_local!(static ROOT: tempfile::TempDir = tempfile::tempdir().unwrap());
            let r = ROOT.with(|root| unpack(&t[..], root.path(), LIMITS));
            if let Err(e) = r {
                prop_assert!(CODES.contains(&e.code.as_str()), "{e}");
            }
        }
    }
}
