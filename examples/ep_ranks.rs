//! Expert parallelism the way it is deployed: one process per GPU. Run without arguments, this
//! program is the launcher: it makes an NCCL unique id and starts itself once per GPU with the
//! rank, the rank count and the id in its environment. Each rank holds a contiguous slice of the
//! experts of a Qwen3-30B-A3B-shaped bf16 layer, runs one step on tokens of its own and checks
//! its output against the f64 CPU reference of the whole layer.
//!
//! `cargo run --release --example ep_ranks [-- RANKS]` (needs at least 2 GPUs; says so and exits 0
//! on a machine with fewer). Keep NCCL's environment (e.g. `NCCL_NVLS_ENABLE`) as the host needs:
//! the ranks inherit it.

use moeforge::runtime::cudarc::driver::CudaContext;
use moeforge::runtime::ep::{Comm, EpConfig, EpLayer, ExpertMap, UniqueId};
use moeforge::runtime::reference::{compare, moe_forward};
use moeforge::runtime::testing::{random_step, random_weights};
use moeforge::runtime::Device;
use moeforge::MoeSpec;
use std::process::Command;
use std::time::Duration;

const RANK: &str = "MOEFORGE_EP_RANK";
const RANKS: &str = "MOEFORGE_EP_RANKS";
const ID: &str = "MOEFORGE_EP_ID";

fn main() -> Result<(), Box<dyn std::error::Error>> {
    match std::env::var(RANK) {
        Ok(rank) => run_rank(rank.parse()?, std::env::var(RANKS)?.parse()?, &UniqueId::from_hex(&std::env::var(ID)?)?),
        Err(_) => launch(),
    }
}

/// The launcher: one process per rank, each told its rank and the shared id.
fn launch() -> Result<(), Box<dyn std::error::Error>> {
    let driver = unsafe { moeforge::runtime::cudarc::driver::sys::is_culib_present() };
    let gpus = if driver { CudaContext::device_count().unwrap_or(0) as usize } else { 0 };
    let ranks = std::env::args().nth(1).map(|a| a.parse()).transpose()?.unwrap_or(gpus);
    if ranks < 2 || ranks > gpus {
        println!("expert parallelism needs at least 2 GPUs ({gpus} found, {ranks} ranks asked): nothing to run");
        return Ok(());
    }
    let id = UniqueId::new()?;
    let exe = std::env::current_exe()?;
    let children: Vec<_> = (0..ranks)
        .map(|r| Command::new(&exe).env(RANK, r.to_string()).env(RANKS, ranks.to_string()).env(ID, id.to_hex()).spawn())
        .collect::<Result<_, _>>()?;
    let mut failed = 0;
    for mut c in children {
        failed += !c.wait()?.success() as usize;
    }
    if failed > 0 {
        return Err(format!("{failed} of {ranks} ranks failed").into());
    }
    println!("all {ranks} ranks matched the reference");
    Ok(())
}

/// One rank: its slice of the experts, one step of its own tokens, checked.
fn run_rank(rank: usize, ranks: usize, id: &UniqueId) -> Result<(), Box<dyn std::error::Error>> {
    let spec = MoeSpec::builder(2048, 768, 128, 8).build()?;
    let device = Device::new(rank)?;
    let comm = Comm::new(&device, rank, ranks, id, Duration::from_secs(60))?;
    let map = ExpertMap::contiguous(spec.experts(), ranks)?;
    // Every rank draws the same layer (one seed) and keeps its experts.
    let all = random_weights(&spec, 7);
    let mine = all.select_experts(&spec, &map.experts_of(rank))?;
    let mut layer = EpLayer::new(&device, comm, spec, map, &mine, EpConfig::new(64))?;

    let m = 16;
    let (x, ids, weights) = random_step(&spec, m, 0.3, 100 + rank as u64);
    let s = layer.stream().clone();
    let xb: Vec<half::bf16> = x.iter().map(|&v| half::bf16::from_f32(v)).collect();
    let (dx, di, dw) = (s.clone_htod(&xb)?, s.clone_htod(&ids)?, s.clone_htod(&weights)?);
    let mut y = s.alloc_zeros::<half::bf16>(xb.len())?;
    layer.forward(&dx, &di, &dw, &mut y)?;
    layer.synchronize()?;
    layer.take_errors()?;
    let got: Vec<f32> = s.clone_dtoh(&y)?.into_iter().map(f32::from).collect();
    let (rel, cos) = compare(&got, &moe_forward(&spec, &all, &x, &ids, &weights));
    println!(
        "rank {rank}/{ranks} ({}): {m} tokens, rel L2 {rel:.2e}, cosine {cos:.7} against the f64 reference",
        device.name()
    );
    if rel > 5e-3 || cos < 0.99999 {
        return Err(format!("rank {rank}: rel L2 {rel:.3e}, cosine {cos}").into());
    }
    Ok(())
}
