//! The on-disk kernel cache: one file per key, `<key>.cubin`, written to a temporary file and
//! renamed into place (so readers never see a partial entry), checked against a blake3 digest on
//! load. A corrupted or truncated entry is reported, removed and rebuilt.
//!
//! How a rebuild is reported (docs/cache.md): one line on stderr, whether or not the program set up
//! logging (`moeforge: kernel cache entry <key> at <path> is corrupt (<why>); recompiling it`), a
//! `tracing` warning with the same fields, [`Outcome::Rebuilt`] from
//! [`DiskCache::get_or_compile`], and the `rebuilt` count of [`DiskCache::counts`].

use crate::error::{Result, RuntimeError};
use crate::jit::{cache_key, compile, CompileOptions};
use dashmap::DashMap;
use moe_codegen::KernelSource;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, LazyLock, Mutex};

const MAGIC: &[u8; 8] = b"MOEFCUB1";
const HEADER: usize = 8 + 8 + 32;

/// The cache directory: `$MOEFORGE_CACHE_DIR`, else `<XDG cache dir>/moeforge`.
pub fn default_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("MOEFORGE_CACHE_DIR").filter(|d| !d.is_empty()) {
        return PathBuf::from(d);
    }
    dirs::cache_dir().unwrap_or_else(std::env::temp_dir).join("moeforge")
}

/// What a lookup found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// A valid entry was on disk.
    Hit,
    /// No entry: compiled and stored.
    Miss,
    /// The entry failed its check and was rebuilt.
    Rebuilt,
}

/// How many lookups of one [`DiskCache`] (and its clones) ended each way.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counts {
    /// Lookups that found a valid entry.
    pub hits: u64,
    /// Lookups that found no entry and compiled one.
    pub misses: u64,
    /// Corrupt or truncated entries found, removed and compiled again.
    pub rebuilt: u64,
}

#[derive(Debug, Default)]
struct Counters {
    hits: AtomicU64,
    misses: AtomicU64,
    rebuilt: AtomicU64,
}

/// The on-disk kernel cache in one folder (see the module docs). Clones share their counts.
#[derive(Debug, Clone)]
pub struct DiskCache {
    dir: PathBuf,
    counters: Arc<Counters>,
}

/// One entry as `moe-jit cache list` shows it.
#[derive(Debug, Clone)]
pub struct Entry {
    /// The cache key (the file name without `.cubin`).
    pub key: String,
    /// The file's size.
    pub bytes: u64,
    /// Whether the entry passes its header and digest check.
    pub valid: bool,
    /// Why the entry fails its check (`None` when valid).
    pub problem: Option<String>,
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> RuntimeError + '_ {
    move |source| RuntimeError::CacheIo { path: path.display().to_string(), source }
}

/// Per-key locks so that threads of one process compile a kernel once; processes may race,
/// and the atomic rename keeps whichever entry lands last, each one whole.
static KEY_LOCKS: LazyLock<DashMap<String, Arc<Mutex<()>>>> = LazyLock::new(DashMap::new);

impl DiskCache {
    /// A cache in `dir`, created on the first write.
    pub fn new(dir: impl Into<PathBuf>) -> DiskCache {
        DiskCache { dir: dir.into(), counters: Arc::default() }
    }
    /// A cache in [`default_dir`].
    pub fn open_default() -> DiskCache {
        DiskCache::new(default_dir())
    }
    /// The cache's folder.
    pub fn dir(&self) -> &Path {
        &self.dir
    }
    /// The file that holds (or would hold) the entry for `key`.
    pub fn path_of(&self, key: &str) -> PathBuf {
        self.dir.join(format!("{key}.cubin"))
    }

    /// Hits, misses and rebuilt entries of this cache's lookups so far.
    pub fn counts(&self) -> Counts {
        Counts {
            hits: self.counters.hits.load(Ordering::Relaxed),
            misses: self.counters.misses.load(Ordering::Relaxed),
            rebuilt: self.counters.rebuilt.load(Ordering::Relaxed),
        }
    }

    /// The CUBIN for `src` under `opts`: from disk, or compiled and stored. A corrupt entry is
    /// removed, compiled again and reported on stderr (see the module docs).
    pub fn get_or_compile(&self, src: &KernelSource, opts: &CompileOptions) -> Result<(Vec<u8>, Outcome)> {
        let key = cache_key(src, opts);
        let lock = KEY_LOCKS.entry(key.clone()).or_default().clone();
        let _guard = lock.lock().unwrap_or_else(|p| p.into_inner());
        let path = self.path_of(&key);
        let mut outcome = Outcome::Miss;
        match self.read(&key) {
            Ok(Some(bin)) => {
                self.counters.hits.fetch_add(1, Ordering::Relaxed);
                return Ok((bin, Outcome::Hit));
            }
            Ok(None) => {}
            Err(why) => {
                tracing::warn!(key, path = %path.display(), %why, "corrupted kernel cache entry; recompiling");
                eprintln!(
                    "moeforge: kernel cache entry {key} at {} is corrupt ({why}); recompiling `{}` for {}",
                    path.display(),
                    src.name,
                    opts.arch
                );
                let _ = std::fs::remove_file(&path);
                outcome = Outcome::Rebuilt;
            }
        }
        let compiled = compile(src, opts)?;
        tracing::debug!(name = %src.name, key, "compiled");
        self.write(&key, &compiled.cubin)?;
        let counter = if outcome == Outcome::Rebuilt { &self.counters.rebuilt } else { &self.counters.misses };
        counter.fetch_add(1, Ordering::Relaxed);
        Ok((compiled.cubin, outcome))
    }

    /// [`get_or_compile`](Self::get_or_compile) for each item on `jobs` threads (each takes the
    /// next item as it finishes one); results in the order of `items`.
    pub fn get_or_compile_all(
        &self,
        items: &[(KernelSource, CompileOptions)],
        jobs: usize,
    ) -> Vec<Result<(Vec<u8>, Outcome)>> {
        type Slot = Mutex<Option<Result<(Vec<u8>, Outcome)>>>;
        let slots: Vec<Slot> = items.iter().map(|_| Mutex::new(None)).collect();
        let next = AtomicUsize::new(0);
        std::thread::scope(|sc| {
            for _ in 0..jobs.clamp(1, items.len().max(1)) {
                sc.spawn(|| loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    let Some((src, opts)) = items.get(i) else { break };
                    let r = self.get_or_compile(src, opts);
                    *slots[i].lock().unwrap_or_else(|p| p.into_inner()) = Some(r);
                });
            }
        });
        slots
            .into_iter()
            .map(|s| s.into_inner().unwrap_or_else(|p| p.into_inner()).expect("every item was compiled"))
            .collect()
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

    /// Store `payload` under `key` with its header and digest, through a temporary file renamed
    /// into place so that readers never see a partial entry. No fsync: it sits on the cold
    /// start's critical path (tens of ms per entry on a cloud disk, serialised in the journal),
    /// and an entry a crash leaves torn fails its digest on read and is recompiled.
    pub fn write(&self, key: &str, payload: &[u8]) -> Result<()> {
        std::fs::create_dir_all(&self.dir).map_err(io_err(&self.dir))?;
        let mut tmp = tempfile::NamedTempFile::new_in(&self.dir).map_err(io_err(&self.dir))?;
        let mut buf = Vec::with_capacity(HEADER + payload.len());
        buf.extend_from_slice(MAGIC);
        buf.extend_from_slice(&(payload.len() as u64).to_le_bytes());
        buf.extend_from_slice(blake3::hash(payload).as_bytes());
        buf.extend_from_slice(payload);
        tmp.write_all(&buf).map_err(io_err(tmp.path()))?;
        let path = self.path_of(key);
        tmp.persist(&path).map_err(|e| RuntimeError::CacheIo { path: path.display().to_string(), source: e.error })?;
        Ok(())
    }

    /// Every entry, each read whole and checked against its digest, sorted by key.
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
            let problem = self.read(key).err();
            out.push(Entry { key: key.to_string(), bytes, valid: problem.is_none(), problem });
        }
        out.sort_by(|a, b| a.key.cmp(&b.key));
        Ok(out)
    }

    /// Remove the entries that fail their check, and only those; returns them.
    pub fn prune_corrupt(&self) -> Result<Vec<Entry>> {
        let bad: Vec<Entry> = self.list()?.into_iter().filter(|e| !e.valid).collect();
        for e in &bad {
            let path = self.path_of(&e.key);
            match std::fs::remove_file(&path) {
                Ok(()) => {}
                // Rebuilt and removed by a process that found it first.
                Err(err) if err.kind() == std::io::ErrorKind::NotFound => {}
                Err(err) => return Err(io_err(&path)(err)),
            }
        }
        Ok(bad)
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
