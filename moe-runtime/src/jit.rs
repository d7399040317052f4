//! NVRTC: rendered source -> CUBIN for one arch, with the program log kept and compile errors
//! turned into a typed error that quotes the offending source lines; the kernels a CUBIN defines
//! (read from the binary, so that a cached one can be checked without NVRTC's log); and the set of
//! modules every check compiles ([`reference_variants`]).

use crate::error::{Result, RuntimeError};
use crate::toolkit::{toolkit, Toolkit};
use cudarc::nvrtc::{result as nvrtc, sys};
use moe_codegen::{
    dequant_variants, variants, Activation, Arch, GroupLimited, KernelFamily, KernelSource, MoeSpec, Router,
    WeightFormat, REFERENCE_GEOMETRIES,
};
use std::ffi::CString;

/// Everything that changes the binary, and therefore the cache key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CompileOptions {
    /// The arch compiled for.
    pub arch: Arch,
    /// NVRTC's command-line options.
    pub options: Vec<String>,
    /// The NVRTC version `(major, minor)`, since another NVRTC may emit another binary.
    pub nvrtc_version: (i32, i32),
}

impl CompileOptions {
    /// The options for a whole source on `arch` with the toolkit `tk`: C++17, ptxas's resource
    /// report, and the toolkit's headers.
    pub fn for_arch(tk: &Toolkit, arch: Arch) -> CompileOptions {
        let options = vec![
            format!("--gpu-architecture={}", arch.name()),
            "-std=c++17".to_string(),
            "--ptxas-options=-v".to_string(),
            format!("--include-path={}", tk.include.display()),
        ];
        CompileOptions { arch, options, nvrtc_version: tk.nvrtc_version }
    }

    /// These options for a module of one entry point of a source: the templates guard each
    /// kernel with `#if !defined(MOE_ONLY) || defined(MOE_ONLY_<entry>)`, so a layer's kernels
    /// compile as separate modules, in parallel.
    pub fn for_entry(&self, entry: &str) -> CompileOptions {
        let mut o = self.clone();
        o.options.push("-DMOE_ONLY".into());
        o.options.push(format!("-DMOE_ONLY_{entry}"));
        o
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
    /// The binary, loadable with the CUDA driver.
    pub cubin: Vec<u8>,
    /// NVRTC's program log.
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

/// The kernel modules every NVRTC check compiles, for each arch: `moe-jit check`'s default and
/// the `every_variant_compiles_for_every_arch` test, one set so that one run compiles each once
/// (through the disk cache). As (reference geometry, spec, family), in a stable order:
/// - on every reference geometry, every (spec, family) [`variants`] accepts: each weight format
///   the geometry takes, with its default dequant variant, in each family that renders it;
/// - on Qwen3-30B-A3B the decode family in every dequant variant of every format instead of the
///   defaults ([`dequant_variants`]; a spec naming its arch's default dequant renders the same
///   source as one naming none, so the defaults are among them);
/// - the group-limited (DeepSeek-V3) router in one module of each family (both render it);
/// - gpt-oss's computation (per-expert biases, the clamped SwiGLU): MXFP4 as it ships (warp
///   decode) and bf16 (the grouped family);
/// - shared experts: DeepSeek-V3's (one, weight 1; block fp8, scaled down, both families) and
///   Qwen2-MoE's (four, gated; bf16, warp decode).
pub fn reference_variants() -> Vec<(&'static str, MoeSpec, KernelFamily)> {
    let mut out = Vec::new();
    for (geo, h, i, e, k) in REFERENCE_GEOMETRIES {
        if geo == "qwen3-30b-a3b" {
            out.extend(dequant_variants(h, i, e, k).into_iter().map(|(s, f)| (geo, s, f)));
            out.extend(
                variants(h, i, e, k)
                    .into_iter()
                    .filter(|(_, f)| *f != KernelFamily::WarpDecode)
                    .map(|(s, f)| (geo, s, f)),
            );
        } else {
            out.extend(variants(h, i, e, k).into_iter().map(|(s, f)| (geo, s, f)));
        }
    }
    let grouped_router = MoeSpec::builder(2048, 768, 128, 8)
        .build()
        .and_then(|s| s.with_router(Router::GroupLimited(GroupLimited::new(8, 4, true, 2.5))))
        .expect("a valid spec");
    out.push(("qwen3-30b-a3b", grouped_router, KernelFamily::GroupedGemm));
    out.push(("qwen3-30b-a3b", grouped_router, KernelFamily::WarpDecode));
    let oai = |f| MoeSpec::builder(2880, 2880, 32, 4).weight_format(f).activation(Activation::SwigluOai);
    let gpt_oss = oai(WeightFormat::Mxfp4).bias(true).build().expect("a valid spec");
    out.push(("gpt-oss-20b", gpt_oss, KernelFamily::WarpDecode));
    out.push((
        "gpt-oss-20b",
        oai(WeightFormat::Bf16).bias(true).build().expect("a valid spec"),
        KernelFamily::GroupedGemm,
    ));
    let deepseek = MoeSpec::builder(1024, 256, 64, 6)
        .weight_format(WeightFormat::Fp8E4m3B128)
        .build()
        .and_then(|s| s.with_shared_experts(1, false))
        .expect("a valid spec");
    out.push(("deepseek-v3-small", deepseek, KernelFamily::WarpDecode));
    out.push(("deepseek-v3-small", deepseek, KernelFamily::GroupedGemm));
    let qwen2 =
        MoeSpec::builder(2048, 1408, 60, 4).build().and_then(|s| s.with_shared_experts(4, true)).expect("a valid spec");
    out.push(("qwen2-57b-a14b", qwen2, KernelFamily::WarpDecode));
    out
}

/// A 64-bit little-endian ELF image's section headers, read in place.
struct Elf<'a> {
    image: &'a [u8],
}

/// One section header: its name's offset in the section-name table, type, and the bytes it spans.
struct Section {
    name: usize,
    kind: u32,
    offset: usize,
    size: usize,
    link: usize,
    entry_size: usize,
}

type ElfResult<T> = std::result::Result<T, String>;

impl<'a> Elf<'a> {
    fn new(image: &'a [u8]) -> ElfResult<Self> {
        if !image.starts_with(b"\x7fELF\x02\x01") {
            return Err("not a 64-bit little-endian ELF image".into());
        }
        Ok(Elf { image })
    }

    fn bytes(&self, at: usize, n: usize) -> ElfResult<&'a [u8]> {
        at.checked_add(n).and_then(|end| self.image.get(at..end)).ok_or_else(|| format!("ELF image cut short at {at}"))
    }

    fn u16_at(&self, at: usize) -> ElfResult<usize> {
        Ok(u16::from_le_bytes(self.bytes(at, 2)?.try_into().expect("2 bytes")) as usize)
    }

    fn u32_at(&self, at: usize) -> ElfResult<u32> {
        Ok(u32::from_le_bytes(self.bytes(at, 4)?.try_into().expect("4 bytes")))
    }

    fn u64_at(&self, at: usize) -> ElfResult<usize> {
        Ok(u64::from_le_bytes(self.bytes(at, 8)?.try_into().expect("8 bytes")) as usize)
    }

    /// Section header `i`.
    fn section(&self, i: usize) -> ElfResult<Section> {
        let at = i
            .checked_mul(self.u16_at(0x3a)?)
            .and_then(|o| o.checked_add(self.u64_at(0x28).ok()?))
            .ok_or("a section header past the address space")?;
        Ok(Section {
            name: self.u32_at(at)? as usize,
            kind: self.u32_at(at + 4)?,
            offset: self.u64_at(at + 24)?,
            size: self.u64_at(at + 32)?,
            link: self.u32_at(at + 40)? as usize,
            entry_size: self.u64_at(at + 56)?,
        })
    }

    fn sections(&self) -> ElfResult<Vec<Section>> {
        (0..self.u16_at(0x3c)?).map(|i| self.section(i)).collect()
    }

    /// The NUL-terminated string at `at` of string-table section `table`.
    fn string(&self, table: &Section, at: usize) -> ElfResult<String> {
        let tail = self.bytes(table.offset, table.size)?.get(at..).ok_or("a name outside its string table")?;
        let end = tail.iter().position(|&c| c == 0).ok_or("an unterminated name")?;
        Ok(String::from_utf8_lossy(&tail[..end]).into_owned())
    }
}

/// The kernels a CUBIN defines: the ELF symbols of type FUNC marked as CUDA entry points
/// (`STO_CUDA_ENTRY` in `st_other`), sorted. `Err` when the bytes are no 64-bit little-endian ELF
/// image with a symbol table.
pub fn cubin_entry_points(cubin: &[u8]) -> std::result::Result<Vec<String>, String> {
    const STO_CUDA_ENTRY: u8 = 0x10;
    const SHT_SYMTAB: u32 = 2;
    const STT_FUNC: u8 = 2;
    let elf = Elf::new(cubin)?;
    let mut names = Vec::new();
    let mut found_symtab = false;
    for sym in elf.sections()?.iter().filter(|s| s.kind == SHT_SYMTAB) {
        found_symtab = true;
        let strtab = elf.section(sym.link)?;
        for j in 0..sym.size / sym.entry_size.max(1) {
            let at = j
                .checked_mul(sym.entry_size)
                .and_then(|o| o.checked_add(sym.offset))
                .ok_or("a symbol past the address space")?;
            let (name, info, other) = (elf.u32_at(at)? as usize, elf.bytes(at + 4, 1)?[0], elf.bytes(at + 5, 1)?[0]);
            if info & 0xf == STT_FUNC && other & STO_CUDA_ENTRY != 0 {
                names.push(elf.string(&strtab, name)?);
            }
        }
    }
    if !found_symtab {
        return Err("no symbol table".into());
    }
    names.sort();
    Ok(names)
}

/// Each kernel's machine code in a CUBIN, in bytes (its `.text.<name>` section), sorted by name.
/// The code a step launches is a cost of its own: a step that launched more of it ran its GEMMs
/// slower (docs/dispatch.md, "The code a step launches").
pub fn cubin_code_sizes(cubin: &[u8]) -> std::result::Result<Vec<(String, usize)>, String> {
    let elf = Elf::new(cubin)?;
    let names = elf.section(elf.u16_at(0x3e)?)?;
    let mut sizes = Vec::new();
    for s in elf.sections()? {
        if let Some(kernel) = elf.string(&names, s.name)?.strip_prefix(".text.") {
            sizes.push((kernel.to_string(), s.size));
        }
    }
    sizes.sort();
    Ok(sizes)
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
    fn corrupt_section_headers_are_errors_not_panics() {
        // A 64-byte ELF header whose section table lies past the address space or the image.
        let header = |shoff: u64, shentsize: u16, shnum: u16| {
            let mut h = vec![0u8; 64];
            h[..6].copy_from_slice(b"\x7fELF\x02\x01");
            h[0x28..0x30].copy_from_slice(&shoff.to_le_bytes());
            h[0x3a..0x3c].copy_from_slice(&shentsize.to_le_bytes());
            h[0x3c..0x3e].copy_from_slice(&shnum.to_le_bytes());
            h
        };
        for h in [header(u64::MAX - 8, 64, 3), header(1 << 40, 64, 3), header(0, u16::MAX, u16::MAX)] {
            assert!(cubin_code_sizes(&h).is_err());
            assert!(cubin_entry_points(&h).is_err());
        }
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
