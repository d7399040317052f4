//! The on-disk kernel cache: one file per key, `<key>.cubin`, written to a temporary file and
//! renamed into place (so readers never see a partial entry), checked against a blake3 digest on
//! load. A corrupted or truncated entry is reported, removed and rebuilt.

use crate::error::{Result, RuntimeError};
use crate::jit::{cache_key, compile, CompileOptions};
use dashmap::DashMap;
use moe_codegen::KernelSource;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::{Arc, LazyLock, Mutex};

const MAGIC: &[u8; 8] = b"MOEFCUB1";
const HEADER: usize = 8 + 8 + 32;

/// The cache directory: `$MOEFORGE_CACHE_DIR`, else `<XDG cache dir>/moeforge`.
pub fn default_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("MOEFORGE_CACHE_DIR") {
        return PathBuf::from(d);
    }
    dirs::cache_dir().unwrap_or_else(std::env::temp_dir).join("moeforge")
}

/// What a lookup found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    Hit,
    Miss,
    /// The entry failed its check and was rebuilt.
    Rebuilt,
}

#[derive(Debug, Clone)]
pub struct DiskCache {
    dir: PathBuf,
}

/// One entry as `moe-jit cache list` shows it.
#[derive(Debug, Clone)]
pub struct Entry {
    pub key: String,
    pub bytes: u64,
    pub valid: bool,
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> RuntimeError + '_ {
    move |source| RuntimeError::CacheIo { path: path.display().to_string(), source }
}

/// Per-key locks so that threads of one process compile a kernel once; processes may race,
/// and the atomic rename keeps whichever entry lands last, each one whole.
static KEY_LOCKS: LazyLock<DashMap<String, Arc<Mutex<()>>>> = LazyLock::new(DashMap::new);

impl DiskCache {
    pub fn new(dir: impl Into<PathBuf>) -> DiskCache {
        DiskCache { dir: dir.into() }
    }
    pub fn open_default() -> DiskCache {
        DiskCache::new(default_dir())
    }
    pub fn dir(&self) -> &Path {
        &self.dir
    }
    pub fn path_of(&self, key: &str) -> PathBuf {
        self.dir.join(format!("{key}.cubin"))
    }

    /// The CUBIN for `src` under `opts`: from disk, or compiled and stored.
    pub fn get_or_compile(&self, src: &KernelSource, opts: &CompileOptions) -> Result<(Vec<u8>, Outcome)> {
        let key = cache_key(src, opts);
        let lock = KEY_LOCKS.entry(key.clone()).or_default().clone();
        let _guard = lock.lock().unwrap_or_else(|p| p.into_inner());
        let path = self.path_of(&key);
        let mut outcome = Outcome::Miss;
        match self.read(&key) {
            Ok(Some(bin)) => return Ok((bin, Outcome::Hit)),
            Ok(None) => {}
            Err(why) => {
                tracing::warn!(path = %path.display(), %why, "corrupted kernel cache entry; recompiling");
                let _ = std::fs::remove_file(&path);
                outcome = Outcome::Rebuilt;
            }
        }
        let compiled = compile(src, opts)?;
        tracing::debug!(name = %src.name, key, "compiled");
        self.write(&key, &compiled.cubin)?;
        Ok((compiled.cubin, outcome))
    }

    /// `Ok(None)`: no entry. `Err(why)`: an entry that fails its check.
    pub fn read(&self, key: &str) -> std::result::Result<Option<Vec<u8>>, String> {
        let path = self.path_of(key);
        let data = match std::fs::read(&path) {
            Ok(d) => d,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(e.to_string()),
        };
        decode(&data).map(Some)
    }

    pub fn write(&self, key: &str, payload: &[u8]) -> Result<()> {
        std::fs::create_dir_all(&self.dir).map_err(io_err(&self.dir))?;
        let mut tmp = tempfile::NamedTempFile::new_in(&self.dir).map_err(io_err(&self.dir))?;
        let mut buf = Vec::with_capacity(HEADER + payload.len());
        buf.extend_from_slice(MAGIC);
        buf.extend_from_slice(&(payload.len() as u64).to_le_bytes());
        buf.extend_from_slice(blake3::hash(payload).as_bytes());
        buf.extend_from_slice(payload);
        tmp.write_all(&buf).map_err(io_err(tmp.path()))?;
        tmp.as_file().sync_all().map_err(io_err(&self.dir))?;
        let path = self.path_of(key);
        tmp.persist(&path).map_err(|e| RuntimeError::CacheIo { path: path.display().to_string(), source: e.error })?;
        Ok(())
    }

    pub fn list(&self) -> Result<Vec<Entry>> {
        let mut out = Vec::new();
        let rd = match std::fs::read_dir(&self.dir) {
            Ok(rd) => rd,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(out),
            Err(e) => return Err(io_err(&self.dir)(e)),
        };
        for e in rd.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            let Some(key) = name.strip_suffix(".cubin") else { continue };
            let bytes = e.metadata().map(|m| m.len()).unwrap_or(0);
            let valid = matches!(self.read(key), Ok(Some(_)));
            out.push(Entry { key: key.to_string(), bytes, valid });
        }
        out.sort_by(|a, b| a.key.cmp(&b.key));
        Ok(out)
    }

    /// Remove every entry (and stray temporary files); returns how many files went.
    pub fn clear(&self) -> Result<usize> {
        let mut n = 0;
        let rd = match std::fs::read_dir(&self.dir) {
            Ok(rd) => rd,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(0),
            Err(e) => return Err(io_err(&self.dir)(e)),
        };
        for e in rd.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if name.ends_with(".cubin") || name.starts_with(".tmp") {
                std::fs::remove_file(e.path()).map_err(io_err(&e.path()))?;
                n += 1;
            }
        }
        Ok(n)
    }
}

fn decode(data: &[u8]) -> std::result::Result<Vec<u8>, String> {
    if data.len() < HEADER || &data[..8] != MAGIC {
        return Err(format!("bad header ({} bytes)", data.len()));
    }
    let len = u64::from_le_bytes(data[8..16].try_into().expect("8 bytes")) as usize;
    let payload = &data[HEADER..];
    if payload.len() != len {
        return Err(format!("truncated: header says {len} bytes, file holds {}", payload.len()));
    }
    if blake3::hash(payload).as_bytes() != &data[16..48] {
        return Err("checksum mismatch".to_string());
    }
    Ok(payload.to_vec())
}
