//! Finding NVRTC and the CUDA headers. Roots are searched in this order:
//!
//! 1. `$CUDA_HOME`, then `$CUDA_PATH`;
//! 2. `/usr/local/cuda`;
//! 3. the pinned install in the user's cache ([`pinned_dir`]: `$MOEFORGE_CUDA_DIR`, else
//!    `moeforge/cuda` in the XDG cache dir, `~/.cache/moeforge/cuda`), where
//!    `scripts/setup-cuda.sh` puts the pinned NVRTC and CUDA header wheels from PyPI.
//!
//! Nothing depends on the source tree or the working directory: a binary built from the
//! workspace, a published crate and a copied test binary all search the same places. The first
//! root with `include/cuda_bf16.h` wins; its own libnvrtc (`lib64/`, `lib/`) is loaded if there
//! is one, else libnvrtc comes from the loader's search path.

use crate::error::{Result, RuntimeError};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// A CUDA toolkit root with the headers NVRTC needs and, where found, its libnvrtc.
#[derive(Debug, Clone)]
pub struct Toolkit {
    /// The include directory handed to NVRTC (`<root>/include`).
    pub include: PathBuf,
    /// libnvrtc found beside the headers; `None` when it comes from the loader's search path.
    pub nvrtc_lib: Option<PathBuf>,
    /// NVRTC's (major, minor) version, as `nvrtcVersion` reports it.
    pub nvrtc_version: (i32, i32),
}

/// Where `scripts/setup-cuda.sh` installs the pinned wheels (their `pip --target` directory):
/// `$MOEFORGE_CUDA_DIR` if set and non-empty, else `moeforge/cuda` in the user's cache directory
/// (`$XDG_CACHE_HOME` if absolute, else `~/.cache`). `None` if neither variable is set and there is
/// no home directory.
pub fn pinned_dir() -> Option<PathBuf> {
    match std::env::var_os("MOEFORGE_CUDA_DIR").filter(|d| !d.is_empty()) {
        Some(d) => Some(PathBuf::from(d)),
        None => dirs::cache_dir().map(|c| c.join("moeforge").join("cuda")),
    }
}

/// The toolkit root of the pinned install: `<pinned_dir>/nvidia/cu13` (the CUDA 13 wheels' layout).
pub fn pinned_root() -> Option<PathBuf> {
    pinned_dir().map(|d| d.join("nvidia").join("cu13"))
}

/// The roots searched, in order (see the module docs).
pub fn candidates() -> Vec<PathBuf> {
    let mut c: Vec<PathBuf> = ["CUDA_HOME", "CUDA_PATH"]
        .iter()
        .filter_map(std::env::var_os)
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .collect();
    c.push(PathBuf::from("/usr/local/cuda"));
    c.extend(pinned_root());
    c
}

fn find_nvrtc(root: &Path) -> Option<PathBuf> {
    ["lib64", "lib", "lib/x64"]
        .iter()
        .map(|d| root.join(d))
        .find_map(|d| ["libnvrtc.so.13", "libnvrtc.so"].iter().map(|n| d.join(n)).find(|p| p.exists()))
}

/// Load libnvrtc by path (and its builtins beside it) so that cudarc's load by name finds this
/// copy already resident.
fn preload(lib: &Path) -> bool {
    use libloading::os::unix::{Library, RTLD_GLOBAL, RTLD_NOW};
    if let Some(dir) = lib.parent() {
        if let Ok(entries) = std::fs::read_dir(dir) {
            for e in entries.flatten() {
                let name = e.file_name();
                let name = name.to_string_lossy();
                if name.starts_with("libnvrtc-builtins.so") {
                    if let Ok(l) = unsafe { Library::open(Some(e.path()), RTLD_NOW | RTLD_GLOBAL) } {
                        std::mem::forget(l);
                    }
                }
            }
        }
    }
    match unsafe { Library::open(Some(lib), RTLD_NOW | RTLD_GLOBAL) } {
        Ok(l) => {
            std::mem::forget(l);
            true
        }
        Err(_) => false,
    }
}

fn discover() -> std::result::Result<Toolkit, String> {
    let cands = candidates();
    let searched = cands.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(", ");
    let root = cands.iter().find(|r| r.join("include/cuda_bf16.h").exists());
    let Some(root) = root else { return Err(searched) };
    // Prefer the libnvrtc that ships with the headers; fall back to any on the loader path.
    let nvrtc_lib = find_nvrtc(root).filter(|l| preload(l));
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return Err(format!("{searched}; headers found in {}, libnvrtc nowhere", root.display()));
    }
    let (mut major, mut minor) = (0, 0);
    unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor) }
        .result()
        .map_err(|e| format!("{searched}; nvrtcVersion failed: {e:?}"))?;
    tracing::debug!(include = %root.display(), ?nvrtc_lib, major, minor, "CUDA toolkit found");
    Ok(Toolkit { include: root.join("include"), nvrtc_lib, nvrtc_version: (major, minor) })
}

/// The toolkit, found once per process.
pub fn toolkit() -> Result<&'static Toolkit> {
    static TK: OnceLock<std::result::Result<Toolkit, String>> = OnceLock::new();
    match TK.get_or_init(discover) {
        Ok(t) => Ok(t),
        Err(e) => Err(RuntimeError::ToolkitNotFound { searched: e.clone() }),
    }
}
