//! The moe-jit command line: `check --tiles` compiles the grouped family with the tiles given
//! (NVRTC, no GPU), and a malformed tile list is refused before anything is compiled; `check`
//! takes a spec of the user's own, refuses an invalid or incomplete one and an empty selection;
//! `cache` finds, reports and prunes corrupt entries, and exits non-zero while any is left;
//! `warm` fills the cache with exactly the modules a layer loads, then finds them all there, and
//! refuses an invalid spec.

use moe_codegen::{family_supports, render, Arch, KernelFamily, MoeSpec};
use moe_runtime::cache::DiskCache;
use moe_runtime::{cache_key, toolkit::toolkit, CompileOptions};
use std::collections::BTreeSet;
use std::path::Path;
use std::process::{Command, Output};

fn moe_jit(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_moe-jit")).args(args).output().expect("moe-jit runs")
}

fn text(out: &Output) -> (String, String) {
    (String::from_utf8_lossy(&out.stdout).into_owned(), String::from_utf8_lossy(&out.stderr).into_owned())
}

#[test]
fn check_refuses_a_malformed_tile_list() {
    for bad in ["256,256", "256,256,4,1,2", "a,b,c,d"] {
        let out = moe_jit(&["check", "--family", "grouped_gemm", "--tiles", bad]);
        assert!(!out.status.success(), "--tiles {bad} accepted");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("expected bn1,bn2,stages,blocks_per_sm"), "--tiles {bad}: {err}");
    }
}

#[test]
fn check_compiles_the_grouped_family_with_the_tiles_given() {
    // Extended items for per-channel fp8 (off by default) on the warp-specialised sm_90a kernels,
    // on Qwen3-30B-A3B (gpt-oss's fp8 takes the mixed-input GEMMs, which these tiles do not fit).
    let out = moe_jit(&[
        "check",
        "--arch",
        "sm_90a",
        "--hidden",
        "2048",
        "--intermediate",
        "768",
        "--experts",
        "128",
        "--top-k",
        "8",
        "--format",
        "fp8_e4m3",
        "--family",
        "grouped_gemm",
        "--tiles",
        "256,256,4,1,1,1,0,16",
        "--resources",
    ]);
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    let compiled: Vec<&str> = stdout.lines().filter(|l| l.starts_with("ok ")).collect();
    assert!(!compiled.is_empty(), "{stdout}");
    for l in &compiled {
        assert!(l.contains("grouped_gemm_") && l.contains("_wgmma_wst16 "), "not the tiles given: {l}");
    }
    assert!(stdout.contains("moe_gemm1") && stdout.contains("regs"), "no resource report: {stdout}");
    assert!(!stdout.contains("warp_decode_"), "--family grouped_gemm compiled decode kernels: {stdout}");
}

#[test]
fn check_refuses_a_selection_of_nothing() {
    // No grouped GEMM takes the lut variant, nor bf16 weights with fp16 activations: the filters
    // leave nothing.
    let lut = ["--hidden", "2048", "--intermediate", "768", "--experts", "8", "--top-k", "2", "--format", "int4"];
    let mixed = ["--hidden", "2048", "--intermediate", "768", "--experts", "8", "--top-k", "2", "--act-dtype", "fp16"];
    let cases: [&[&str]; 3] = [
        &[&["check", "--dequant", "lut", "--family", "grouped_gemm"][..], &lut].concat(),
        &[&["check", "--dequant", "lut", "--family", "grouped_gemm", "--list"][..], &lut].concat(),
        &[&["check", "--family", "grouped_gemm"][..], &mixed].concat(),
    ];
    for args in cases {
        let out = moe_jit(args);
        let (stdout, stderr) = text(&out);
        assert!(!out.status.success(), "{args:?} succeeded: {stdout}");
        assert!(stderr.contains("select no kernel module"), "{args:?}: {stderr}");
        assert!(!stdout.contains("variants ok"), "{args:?} compiled: {stdout}");
    }
}

#[test]
fn check_takes_a_spec_of_ones_own() {
    // gpt-oss-20b's geometry in MXFP4: the decode family in each of the format's dequant variants
    // and the grouped family (weights decoded by its loader, mma.sync), on each arch asked for,
    // and on sm_90a the grouped family's large-step module.
    let spec = ["--hidden", "2880", "--intermediate", "2880", "--experts", "32", "--top-k", "4", "--format", "mxfp4"];
    let out = moe_jit(&[&["check", "--list", "--arch", "sm_90a,sm_120a"][..], &spec].concat());
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    for variant in ["lut", "bits", "hardware"] {
        for arch in ["sm_90a", "sm_120a"] {
            let name = format!("warp_decode_h2880_i2880_e32_k4_mxfp4_bf16_silu_{variant} ");
            assert!(stdout.lines().any(|l| l.contains(&name) && l.ends_with(arch)), "no {name}for {arch}: {stdout}");
        }
    }
    for arch in ["sm_90a", "sm_120a"] {
        let grouped = |l: &str| l.contains("grouped_gemm_h2880_i2880_e32_k4_mxfp4_bf16_silu_") && l.contains("_mma");
        assert!(stdout.lines().any(|l| grouped(l) && l.ends_with(arch)), "no grouped module for {arch}: {stdout}");
    }
    // On sm_90a also the grouped family's large-step module (the producer warpgroup decodes).
    let large = |l: &str| l.contains("grouped_gemm_h2880_i2880_e32_k4_mxfp4_bf16_silu_") && l.contains("_wgmma_ws");
    assert!(stdout.lines().any(|l| large(l) && l.ends_with("sm_90a")), "no large-step module: {stdout}");
    assert!(!stdout.lines().any(|l| large(l) && l.ends_with("sm_120a")), "{stdout}");
    assert!(stdout.contains("9 modules to compile"), "{stdout}");
    // And the decode module compiled, through the cache (the reference set holds this one: a hit
    // after `moe-jit check` in scripts/test.sh). The flags override the format's defaults.
    let flags =
        ["check", "--arch", "sm_90a", "--dequant", "hardware", "--activation", "silu", "--family", "warp_decode"];
    let out = moe_jit(&[&flags[..], &spec].concat());
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(stdout.contains("1 variants ok (") && stdout.contains("), 0 failed"), "{stdout}");
    assert!(stdout.contains("warp_decode_h2880_i2880_e32_k4_mxfp4_bf16_silu_hardware "), "{stdout}");
}

#[test]
fn check_refuses_an_invalid_or_incomplete_spec() {
    let cases: [(&[&str], &str); 4] = [
        // 2880 holds no whole 128-element group: the typed SpecError, naming the field.
        (
            &["--hidden", "2880", "--intermediate", "2880", "--experts", "32", "--top-k", "4", "--format", "int4_g128"],
            "`hidden` = 2880 is not a multiple of 128",
        ),
        (
            &["--hidden", "2048", "--intermediate", "768", "--experts", "8", "--top-k", "16"],
            "top_k = 16 exceeds experts = 8",
        ),
        (&["--hidden", "2048", "--intermediate", "768"], "--experts, --top-k missing"),
        (&["--dequant", "lut"], "give --hidden, --intermediate, --experts and --top-k"),
    ];
    for (args, want) in cases {
        let out = moe_jit(&[&["check", "--arch", "sm_90a"][..], args].concat());
        let (stdout, stderr) = text(&out);
        assert!(!out.status.success(), "{args:?} accepted: {stdout}");
        assert!(stderr.contains(want), "{args:?}: expected `{want}` in: {stderr}");
        assert!(!stdout.contains("ok "), "{args:?} compiled something: {stdout}");
    }
}

/// A cache folder with two sound entries, one with a flipped byte and one cut short; the keys of
/// the bad ones.
fn damaged_cache(dir: &Path) -> [String; 2] {
    let c = DiskCache::new(dir);
    for (i, key) in ["aa", "bb", "cc", "dd"].iter().enumerate() {
        c.write(key, &vec![i as u8; 1000]).unwrap();
    }
    let mut data = std::fs::read(c.path_of("cc")).unwrap();
    data[500] ^= 1;
    std::fs::write(c.path_of("cc"), &data).unwrap();
    std::fs::write(c.path_of("dd"), &data[..300]).unwrap();
    ["cc".into(), "dd".into()]
}

#[test]
fn cache_reports_and_prunes_corrupt_entries_only() {
    let dir = tempfile::tempdir().unwrap();
    let bad = damaged_cache(dir.path());
    let d = dir.path().to_str().unwrap();
    for op in ["stats", "verify", "list"] {
        let out = moe_jit(&["cache", "--cache-dir", d, op]);
        let (stdout, stderr) = text(&out);
        assert!(!out.status.success(), "cache {op} exits 0 with corrupt entries: {stdout}");
        assert!(
            stderr.contains("2 corrupt cache entries") && stderr.contains("moe-jit cache prune-corrupt"),
            "{stderr}"
        );
        if op == "verify" {
            assert!(stdout.contains("checksum mismatch") && stdout.contains("truncated"), "{stdout}");
            for k in &bad {
                assert!(stdout.contains(&format!("{k}.cubin")), "verify does not name {k}: {stdout}");
            }
        }
        if op == "stats" {
            assert!(stdout.contains("4 entries") && stdout.contains("2 corrupt"), "{stdout}");
        }
    }
    // --cache-dir goes before the subcommand as well.
    let out = moe_jit(&["--cache-dir", d, "cache", "prune-corrupt"]);
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(stdout.contains("removed 2 corrupt entries"), "{stdout}");
    let left: Vec<_> = DiskCache::new(dir.path()).list().unwrap().into_iter().map(|e| (e.key, e.valid)).collect();
    assert_eq!(left, [("aa".to_string(), true), ("bb".to_string(), true)]);
    for op in ["stats", "verify", "list"] {
        let out = moe_jit(&["cache", "--cache-dir", d, op]);
        assert!(out.status.success(), "cache {op} after pruning: {:?}", text(&out));
    }
}

#[test]
fn check_rebuilds_a_corrupt_entry_and_says_so() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().to_str().unwrap();
    let args = [
        "--cache-dir",
        d,
        "check",
        "--arch",
        "sm_90a",
        "--family",
        "warp_decode",
        "--hidden",
        "256",
        "--intermediate",
        "128",
        "--experts",
        "8",
        "--top-k",
        "2",
    ];
    let out = moe_jit(&args);
    assert!(out.status.success(), "{:?}", text(&out));
    let entries = DiskCache::new(dir.path()).list().unwrap();
    assert_eq!(entries.len(), 1);
    let path = DiskCache::new(dir.path()).path_of(&entries[0].key);
    let data = std::fs::read(&path).unwrap();
    std::fs::write(&path, &data[..data.len() - 7]).unwrap();
    let out = moe_jit(&args);
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(stderr.contains("is corrupt (truncated") && stderr.contains(&path.display().to_string()), "{stderr}");
    assert!(stdout.contains("REBUILT") && stdout.contains("1 corrupt cache entries rebuilt"), "{stdout}");
    assert!(DiskCache::new(dir.path()).list().unwrap()[0].valid);
}

const SMALL: [&str; 10] =
    ["--hidden", "256", "--intermediate", "128", "--experts", "8", "--top-k", "2", "--format", "bf16"];

/// The closing line's counts: (modules, from the cache, compiled by NVRTC, failed).
fn warm_counts(stdout: &str) -> (usize, usize, usize, usize) {
    let line = stdout.lines().find(|l| l.contains(" modules of ")).unwrap_or_else(|| panic!("no summary: {stdout}"));
    let n = |after: &str| -> usize {
        let at = line.find(after).unwrap_or_else(|| panic!("no `{after}` in: {line}"));
        line[..at].rsplit([' ', '(']).next().unwrap().parse().unwrap_or_else(|_| panic!("{line}"))
    };
    (n(" modules of "), n(" from the cache"), n(" compiled by NVRTC"), n(" failed"))
}

/// The cache keys of every module a layer of `spec` loads on `arch`: each entry point of each
/// family the spec supports, as its own module (as `Device::compile_entries` builds them).
fn layer_keys(spec: &MoeSpec, arch: Arch) -> BTreeSet<String> {
    let opts = CompileOptions::for_arch(toolkit().expect("NVRTC"), arch);
    KernelFamily::ALL
        .into_iter()
        .filter(|&f| family_supports(f, spec))
        .flat_map(|f| {
            let src = render(spec, f, arch).unwrap();
            src.entry_points.iter().map(|e| cache_key(&src, &opts.for_entry(e))).collect::<Vec<_>>()
        })
        .collect()
}

#[test]
fn warm_compiles_what_a_layer_loads_then_finds_it_all_in_the_cache() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().to_str().unwrap();
    let out = moe_jit(&[&["--cache-dir", d, "warm", "--arch", "sm_90a"][..], &SMALL].concat());
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    let (n, hits, compiled, failed) = warm_counts(&stdout);
    assert_eq!((hits, compiled, failed), (0, n, 0), "{stdout}");
    // Exactly the layer's modules: both families (bf16), every entry point, the layer's keys.
    let spec = MoeSpec::builder(256, 128, 8, 2).build().unwrap();
    let want = layer_keys(&spec, Arch::Sm90a);
    assert!(family_supports(KernelFamily::GroupedGemm, &spec));
    assert!(
        stdout.contains("warp_decode_h256_i128_e8_k2_") && stdout.contains("grouped_gemm_h256_i128_e8_k2_"),
        "{stdout}"
    );
    let got: BTreeSet<String> = DiskCache::new(dir.path()).list().unwrap().into_iter().map(|e| e.key).collect();
    assert_eq!(got, want);
    assert_eq!(n, want.len());

    let out = moe_jit(&["--cache-dir", d, "cache", "stats"]);
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(stdout.contains(&format!(": {n} entries, ")) && stdout.contains(" 0 corrupt"), "{stdout}");

    // Again: nothing left to compile.
    let out = moe_jit(&[&["--cache-dir", d, "warm", "--arch", "sm_90a"][..], &SMALL].concat());
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert_eq!(warm_counts(&stdout), (n, n, 0, 0), "{stdout}");

    // The same spec twice from a JSON file (the format as a list once): each module once, all hits.
    let file = dir.path().join("specs.json");
    std::fs::write(
        &file,
        r#"[{"hidden": 256, "intermediate": 128, "experts": 8, "top_k": 2},
            {"hidden": 256, "intermediate": 128, "experts": 8, "top_k": 2, "format": ["bf16"], "activation": "silu"}]"#,
    )
    .unwrap();
    let out = moe_jit(&["--cache-dir", d, "warm", "--arch", "sm_90a", "--specs", file.to_str().unwrap()]);
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert_eq!(warm_counts(&stdout), (n, n, 0, 0), "{stdout}");
    assert!(stdout.contains("of 2 specs x 1 archs"), "{stdout}");
    assert_eq!(DiskCache::new(dir.path()).list().unwrap().len(), n);
}

#[test]
fn warm_refuses_an_invalid_spec() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().to_str().unwrap();
    let bad_file = dir.path().join("bad.json");
    std::fs::write(&bad_file, r#"[{"hidden": 256, "intermediate": 128, "experts": 8, "top_k": 16}]"#).unwrap();
    let typo_file = dir.path().join("typo.json");
    std::fs::write(&typo_file, r#"[{"hidden": 256, "intermediate": 128, "experts": 8, "topk": 2}]"#).unwrap();
    let cases: [(Vec<&str>, &str); 5] = [
        (
            vec!["--hidden", "256", "--intermediate", "128", "--experts", "8", "--top-k", "16"],
            "top_k = 16 exceeds experts = 8",
        ),
        (vec!["--hidden", "256", "--intermediate", "128"], "--experts, --top-k missing"),
        (
            vec!["--hidden", "256", "--intermediate", "128", "--experts", "8", "--top-k", "2", "--format", "int5"],
            "unknown weight format `int5`",
        ),
        (vec!["--specs", bad_file.to_str().unwrap()], "spec 0: invalid spec"),
        (vec!["--specs", typo_file.to_str().unwrap()], "unknown field `topk`"),
    ];
    for (args, want) in cases {
        let out = moe_jit(&[&["--cache-dir", d, "warm", "--arch", "sm_90a"][..], &args].concat());
        let (stdout, stderr) = text(&out);
        assert!(!out.status.success(), "{args:?} accepted: {stdout}");
        assert!(stderr.contains(want), "{args:?}: expected `{want}` in: {stderr}");
    }
    assert!(DiskCache::new(dir.path()).list().unwrap().is_empty(), "an invalid spec compiled something");
}

#[test]
fn profile_refuses_an_invalid_spec_and_a_machine_without_a_gpu() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().to_str().unwrap();
    let spec = ["--hidden", "256", "--intermediate", "128", "--experts", "8"];
    let out = moe_jit(&[&["--cache-dir", d, "profile"][..], &spec, &["--top-k", "16"]].concat());
    let (_, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("top_k = 16 exceeds experts = 8"), "{stderr}");
    let out = moe_jit(&[&["--cache-dir", d, "profile"][..], &spec].concat());
    assert_eq!(out.status.code(), Some(2), "{}", text(&out).1);
    // A valid spec: profiled on a GPU; without one, a clear failure and no profile written.
    let out = moe_jit(&[&["--cache-dir", d, "profile"][..], &spec, &["--top-k", "2"]].concat());
    let (stdout, stderr) = text(&out);
    if moe_runtime::Device::new(0).is_err() {
        assert_eq!(out.status.code(), Some(1), "{stdout}{stderr}");
        assert!(stderr.contains("needs an NVIDIA GPU"), "{stderr}");
        assert!(!dir.path().join("profiles").exists());
    } else {
        assert!(out.status.success(), "{stdout}{stderr}");
        assert!(stdout.contains("h256_i128_e8_k2_bf16_bf16_silu"), "{stdout}");
    }
}
