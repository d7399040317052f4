//! The rendered dequant includes, run on the CPU: every format x variant's probe kernel (the very
//! `dequant.cuh` the kernel families render) is compiled with the host C++ compiler against
//! `tests/host/cuda_shim.h`, which stands in for the CUDA built-ins with their documented IEEE
//! semantics, and its output is compared bit for bit with the Rust dequantizer. This checks the
//! bit tricks (masks, shifts, byte permutes, magic numbers, nibble order, scale indexing) without
//! a GPU; `tests/gpu_formats.rs` checks the same on the device. The hardware FP4 decode is inline
//! PTX and is left to the GPU test.
//!
//! Skipped, with a message, when no C++ compiler is found (`$CXX`, else `c++`, else `g++`).

use moe_codegen::{render_dequant_probe, Arch, Codec, DequantVariant, WeightFormat};
use moe_runtime::testing::{fresh_seed, random_packed};
use std::path::Path;
use std::process::Command;

const TENSORS: usize = 2;
const ROWS: usize = 128;
const COLS: usize = 256;

fn compiler() -> Option<String> {
    let candidates = std::env::var("CXX").into_iter().chain(["c++".to_string(), "g++".to_string()]);
    candidates.into_iter().find(|c| Command::new(c).arg("--version").output().is_ok_and(|o| o.status.success()))
}

/// Every (format, variant) the host harness can run.
fn cases() -> Vec<(WeightFormat, DequantVariant)> {
    WeightFormat::ALL.into_iter().flat_map(|f| f.dequant_variants().iter().map(move |&d| (f, d))).collect()
}

/// The arch whose source the harness compiles: Blackwell's FP4 `hardware` decode is inline PTX
/// (`cvt.rn.f16x2.e2m1x2`), so FP4 `hardware` is taken as sm_90a renders it (through e4m3, whose
/// conversion the shim has).
fn host_arch(f: WeightFormat, d: DequantVariant) -> Arch {
    if f.codec() == Codec::E2m1 && d == DequantVariant::Hardware {
        Arch::Sm90a
    } else {
        Arch::Sm100a
    }
}

/// The probe source from the dequant include on, its entry point renamed into namespace `ns`.
fn host_source(f: WeightFormat, d: DequantVariant, ns: usize) -> String {
    let k = render_dequant_probe(f, Some(d), host_arch(f, d), TENSORS, ROWS, COLS).unwrap();
    let start = k.source.find("// Weight format").expect("dequant.cuh's first line");
    let body = k.source[start..].replace("extern \"C\" ", "");
    format!("namespace v{ns} {{\n{body}\n}}  // namespace v{ns}\n")
}

fn build(dir: &Path, cxx: &str) -> std::path::PathBuf {
    let mut src = String::from("#include \"cuda_shim.h\"\n#include <cstdio>\n#include <cstdlib>\n#include <vector>\n");
    let cases = cases();
    for (i, &(f, d)) in cases.iter().enumerate() {
        src += &host_source(f, d, i);
    }
    src += r#"
static std::vector<unsigned long long> slurp(const char* path) {
    FILE* f = std::fopen(path, "rb");
    if (!f) std::exit(2);
    std::fseek(f, 0, SEEK_END);
    const long n = std::ftell(f);
    std::fseek(f, 0, SEEK_SET);
    std::vector<unsigned long long> v((n + 7) / 8 + 2, 0);
    if (n && std::fread(v.data(), 1, n, f) != (size_t)n) std::exit(3);
    std::fclose(f);
    return v;
}
int main(int argc, char** argv) {
    if (argc != 5) return 1;
    const int which = std::atoi(argv[1]);
    const std::vector<unsigned long long> w = slurp(argv[2]);
    const std::vector<unsigned long long> s = slurp(argv[3]);
    std::vector<float> out((size_t)TOTAL_ELEMS);
    switch (which) {
"#;
    for i in 0..cases.len() {
        src += &format!(
            "    case {i}: v{i}::dequant_probe(reinterpret_cast<const uint4*>(w.data()), s.data(), out.data()); break;\n"
        );
    }
    src += r#"    default: return 1;
    }
    FILE* o = std::fopen(argv[4], "wb");
    if (!o || std::fwrite(out.data(), 4, out.size(), o) != out.size()) return 4;
    std::fclose(o);
    return 0;
}
"#;
    let src = src.replace("TOTAL_ELEMS", &(TENSORS * ROWS * COLS).to_string());
    let cpp = dir.join("probes.cpp");
    std::fs::write(&cpp, src).unwrap();
    let shim = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/host");
    let exe = dir.join("probes");
    let out = Command::new(cxx)
        .args(["-std=c++17", "-O1", "-ffp-contract=off", "-fno-strict-aliasing", "-w", "-I"])
        .arg(&shim)
        .arg(&cpp)
        .arg("-o")
        .arg(&exe)
        .output()
        .unwrap();
    assert!(out.status.success(), "{cxx} failed:\n{}", String::from_utf8_lossy(&out.stderr));
    exe
}

#[test]
fn rendered_dequant_matches_the_rust_dequantizer_bit_for_bit() {
    let Some(cxx) = compiler() else {
        println!("skipped: no C++ compiler (set CXX)");
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let exe = build(dir.path(), &cxx);
    let seed = fresh_seed();
    let mut failures = Vec::new();
    for (i, (f, d)) in cases().into_iter().enumerate() {
        for wide in [false, true] {
            let p = random_packed(f, TENSORS, ROWS, COLS, seed.wrapping_add(i as u64), wide);
            let (wp, sp, op) = (dir.path().join("w.bin"), dir.path().join("s.bin"), dir.path().join("o.bin"));
            std::fs::write(&wp, &p.data).unwrap();
            std::fs::write(&sp, &p.scales).unwrap();
            let st = Command::new(&exe).arg(i.to_string()).arg(&wp).arg(&sp).arg(&op).status().unwrap();
            assert!(st.success(), "{f} {d}: the probe exited with {st}");
            let got: Vec<f32> = std::fs::read(&op)
                .unwrap()
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
                .collect();
            let want = f.dequantize(&p);
            assert_eq!(got.len(), want.len());
            if let Some(j) = (0..got.len()).find(|&j| got[j].to_bits() != want[j].to_bits()) {
                let mismatches = (0..got.len()).filter(|&j| got[j].to_bits() != want[j].to_bits()).count();
                failures.push(format!(
                    "{f} {d} wide={wide}: {mismatches} mismatches, first at row {} col {}: host {} ({:#010x}) vs rust {} ({:#010x})",
                    j / COLS,
                    j % COLS,
                    got[j],
                    got[j].to_bits(),
                    want[j],
                    want[j].to_bits()
                ));
            }
        }
    }
    assert!(failures.is_empty(), "seed {seed}\n{}", failures.join("\n"));
    println!("{} format x variant probes agree bit for bit (seed {seed})", cases().len());
}
