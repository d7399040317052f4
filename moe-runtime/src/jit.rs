//! NVRTC: rendered source -> CUBIN for one arch, with the program log kept and compile errors
//! turned into a typed error that quotes the offending source lines.

use crate::error::{Result, RuntimeError};
use crate::toolkit::{toolkit, Toolkit};
use cudarc::nvrtc::{result as nvrtc, sys};
use moe_codegen::{Arch, KernelSource};
use std::ffi::CString;

/// Everything that changes the binary, and therefore the cache key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CompileOptions {
    pub arch: Arch,
    pub options: Vec<String>,
    pub nvrtc_version: (i32, i32),
}

impl CompileOptions {
    pub fn for_arch(tk: &Toolkit, arch: Arch) -> CompileOptions {
        let options = vec![
            format!("--gpu-architecture={}", arch.name()),
            "-std=c++17".to_string(),
            "--ptxas-options=-v".to_string(),
            format!("--include-path={}", tk.include.display()),
        ];
        CompileOptions { arch, options, nvrtc_version: tk.nvrtc_version }
    }
}

/// The cache key: blake3 of (rendered source, NVRTC version, every option, arch).
pub fn cache_key(src: &KernelSource, opts: &CompileOptions) -> String {
    let mut h = blake3::Hasher::new();
    h.update(b"moeforge-kernel-v1\0");
    h.update(src.source.as_bytes());
    h.update(&[0]);
    h.update(format!("nvrtc {}.{}", opts.nvrtc_version.0, opts.nvrtc_version.1).as_bytes());
    for o in &opts.options {
        h.update(&[0]);
        h.update(o.as_bytes());
    }
    h.update(&[0]);
    h.update(opts.arch.name().as_bytes());
    h.finalize().to_hex()[..32].to_string()
}

/// A compiled module: the CUBIN and NVRTC's log (ptxas register / spill report included).
#[derive(Debug, Clone)]
pub struct Compiled {
    pub cubin: Vec<u8>,
    pub log: String,
}

/// Compile `src` for `opts.arch`. Needs NVRTC and the headers, not a GPU.
pub fn compile(src: &KernelSource, opts: &CompileOptions) -> Result<Compiled> {
    toolkit()?;
    let nvrtc_err = |what: &str, e: nvrtc::NvrtcError| RuntimeError::Nvrtc(format!("{what}: {e:?}"));
    let code = CString::new(src.source.as_str()).map_err(|_| RuntimeError::Nvrtc("source holds a NUL byte".into()))?;
    let file = CString::new(format!("{}.cu", src.name)).expect("module names are ASCII");
    let prog = nvrtc::create_program(&code, Some(&file)).map_err(|e| nvrtc_err("nvrtcCreateProgram", e))?;
    let compiled = unsafe { nvrtc::compile_program(prog, &opts.options) };
    let log = unsafe { nvrtc::get_program_log(prog) }
        .map(|l| {
            let bytes: Vec<u8> = l.iter().map(|&c| c as u8).take_while(|&c| c != 0).collect();
            String::from_utf8_lossy(&bytes).into_owned()
        })
        .unwrap_or_default();
    let result = match compiled {
        Err(_) => Err(RuntimeError::Compile {
            name: src.name.clone(),
            arch: opts.arch,
            excerpt: offending_lines(&src.source, &log, &format!("{}.cu", src.name)),
            log,
        }),
        Ok(()) => unsafe {
            let mut size = 0usize;
            sys::nvrtcGetCUBINSize(prog, &mut size).result().map_err(|e| nvrtc_err("nvrtcGetCUBINSize", e))?;
            let mut cubin = vec![0u8; size];
            sys::nvrtcGetCUBIN(prog, cubin.as_mut_ptr() as *mut _)
                .result()
                .map_err(|e| nvrtc_err("nvrtcGetCUBIN", e))?;
            Ok(Compiled { cubin, log })
        },
    };
    unsafe { nvrtc::destroy_program(prog) }.map_err(|e| nvrtc_err("nvrtcDestroyProgram", e))?;
    result
}

/// The source lines the log's `file(LINE): error` messages point at, two lines of context each.
pub fn offending_lines(source: &str, log: &str, file: &str) -> String {
    let lines: Vec<&str> = source.lines().collect();
    let mut out = String::new();
    let mut seen = std::collections::BTreeSet::new();
    for l in log.lines().filter(|l| l.contains("error")) {
        let Some(rest) = l.strip_prefix(file).and_then(|r| r.strip_prefix('(')) else { continue };
        let Some(n) = rest.split(')').next().and_then(|n| n.parse::<usize>().ok()) else { continue };
        if !seen.insert(n) {
            continue;
        }
        for i in n.saturating_sub(2).max(1)..=(n + 2).min(lines.len()) {
            out.push_str(&format!("{}{:>5} | {}\n", if i == n { ">" } else { " " }, i, lines[i - 1]));
        }
        out.push_str("      ...\n");
    }
    if out.is_empty() {
        out.push_str("(the log names no source line)\n");
    }
    out
}

/// Registers, spill bytes and stack frame per entry point, read from the ptxas report in the log.
pub fn resource_report(log: &str) -> Vec<(String, u32, u32, u32)> {
    let mut out = Vec::new();
    let mut func = String::new();
    let mut spill = 0;
    let mut stack = 0;
    for l in log.lines() {
        if let Some(i) = l.find("Compiling entry function '") {
            func = l[i + 26..].split('\'').next().unwrap_or("").to_string();
        } else if l.contains("bytes stack frame") {
            let nums: Vec<u32> = l.split(|c: char| !c.is_ascii_digit()).filter_map(|n| n.parse().ok()).collect();
            stack = nums.first().copied().unwrap_or(0);
            spill = nums.get(1).copied().unwrap_or(0) + nums.get(2).copied().unwrap_or(0);
        } else if let Some(i) = l.find("Used ") {
            let regs = l[i + 5..].split_whitespace().next().and_then(|n| n.parse().ok()).unwrap_or(0);
            out.push((std::mem::take(&mut func), regs, spill, stack));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn offending_lines_quotes_the_source() {
        let src = "a\nb\nc\nd\ne\nf\n";
        let log = "k.cu(4): error: identifier \"x\" is undefined\n1 error detected";
        let ex = offending_lines(src, log, "k.cu");
        assert!(ex.contains(">    4 | d"), "{ex}");
        assert!(ex.contains("    2 | b"));
        assert!(ex.contains("    6 | f"));
        assert!(offending_lines(src, "fatal", "k.cu").contains("names no source line"));
    }

    #[test]
    fn resource_report_parses_ptxas() {
        let log = "ptxas info    : Compiling entry function 'moe_down_t1' for 'sm_90a'\n\
                   ptxas info    : Function properties for moe_down_t1\n\
                   \x20   8 bytes stack frame, 4 bytes spill stores, 4 bytes spill loads\n\
                   ptxas info    : Used 72 registers, used 0 barriers";
        assert_eq!(resource_report(log), vec![("moe_down_t1".to_string(), 72, 8, 8)]);
    }
}
