//! Finding NVRTC and the CUDA headers: `$CUDA_HOME`, `$CUDA_PATH`, the project's pinned install
//! (`.cuda/nvidia/cu13`, made by `scripts/setup-cuda.sh`), then `/usr/local/cuda`.

use crate::error::{Result, RuntimeError};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// A CUDA toolkit root with the headers NVRTC needs and, where found, its libnvrtc.
#[derive(Debug, Clone)]
pub struct Toolkit {
    pub include: PathBuf,
    /// libnvrtc found beside the headers; `None` when it comes from the loader's search path.
    pub nvrtc_lib: Option<PathBuf>,
    pub nvrtc_version: (i32, i32),
}

/// The project's pinned install, relative to the workspace the binary was built from.
pub fn pinned_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../.cuda/nvidia/cu13")
}

fn candidates() -> Vec<PathBuf> {
    let mut c: Vec<PathBuf> =
        ["CUDA_HOME", "CUDA_PATH"].iter().filter_map(std::env::var_os).map(PathBuf::from).collect();
    c.push(pinned_root());
    c.push(PathBuf::from("/usr/local/cuda"));
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
