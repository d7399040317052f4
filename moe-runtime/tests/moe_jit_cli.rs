//! The moe-jit command line: `check --tiles` compiles the grouped family with the tiles given
//! (NVRTC, no GPU), and a malformed tile list is refused before anything is compiled; `check`
//! takes a spec of the user's own, refuses an invalid or incomplete one and an empty selection;
//! `cache` finds, reports and prunes corrupt entries, and exits non-zero while any is left.

use moe_runtime::cache::DiskCache;
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
    // Extended items for per-channel fp8 (off by default) on the warp-specialised sm_90a kernels.
    let out = moe_jit(&[
        "check",
        "--arch",
        "sm_90a",
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
    // No grouped GEMM takes INT4 weights: the filters leave nothing.
    let spec = ["--hidden", "2048", "--intermediate", "768", "--experts", "8", "--top-k", "2", "--format", "int8"];
    let cases: [&[&str]; 3] = [
        &["check", "--format", "int4", "--family", "grouped_gemm"],
        &["check", "--format", "int4", "--family", "grouped_gemm", "--list"],
        &[&["check", "--family", "grouped_gemm"][..], &spec].concat(),
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
    // (the grouped family takes no MXFP4), on each arch asked for.
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
    assert!(!stdout.contains("grouped_gemm_"), "{stdout}");
    assert!(stdout.contains("6 modules to compile"), "{stdout}");
    // And compiled, through the cache (the reference set holds this one: a hit after `moe-jit
    // check` in scripts/test.sh). The flags override the format's defaults.
    let out =
        moe_jit(&[&["check", "--arch", "sm_90a", "--dequant", "hardware", "--activation", "silu"][..], &spec].concat());
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
