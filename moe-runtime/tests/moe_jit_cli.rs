//! The moe-jit command line: `check --tiles` compiles the grouped family with the tiles given
//! (NVRTC, no GPU), and a malformed tile list is refused before anything is compiled.

use std::process::Command;

fn moe_jit(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_moe-jit")).args(args).output().expect("moe-jit runs")
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
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    let compiled: Vec<&str> = stdout.lines().filter(|l| l.starts_with("ok ")).collect();
    assert!(!compiled.is_empty(), "{stdout}");
    for l in &compiled {
        assert!(l.contains("grouped_gemm_") && l.contains("_wgmma_wst16 "), "not the tiles given: {l}");
    }
    assert!(stdout.contains("moe_gemm1") && stdout.contains("regs"), "no resource report: {stdout}");
    assert!(!stdout.contains("warp_decode_"), "--family grouped_gemm compiled decode kernels: {stdout}");
}
