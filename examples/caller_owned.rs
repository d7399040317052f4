//! A layer driven entirely through the caller-owned API, as an inference engine would: the
//! engine's context, its stream and its buffers (cudarc only; moeforge allocates nothing for the
//! step), weights handed over from device memory, int64 routing ids, and the step captured in the
//! engine's own CUDA graph and replayed. Checked against the f64 CPU reference.
//!
//! `cargo run --release --example caller_owned` (without a GPU it says so and exits 0).

use moeforge::runtime::cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use moeforge::runtime::cudarc::driver::CudaContext;
use moeforge::runtime::reference::{compare, moe_forward};
use moeforge::runtime::testing::{random_step, random_weights};
use moeforge::runtime::{Device, DeviceTensor, DeviceTensorMut, DeviceWeights, MoeLayer, TopkIds};
use moeforge::MoeSpec;

type Bf = half::bf16;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let spec = MoeSpec::builder(2048, 768, 128, 8).build()?;
    // Without the driver library cudarc's calls panic: ask first.
    let driver = unsafe { moeforge::runtime::cudarc::driver::sys::is_culib_present() };
    let Some(ctx) = driver.then(|| CudaContext::new(0).ok()).flatten() else {
        println!("no GPU found: nothing to run (the caller-owned API needs one)");
        return Ok(());
    };
    // The engine's side: its context, its stream, its weights already on the device.
    let stream = ctx.new_stream()?;
    let host = random_weights(&spec, 1);
    let (w13, w2) = (stream.clone_htod(&host.w13)?, stream.clone_htod(&host.w2)?);

    // moeforge on that context; the weights are copied device to device.
    let device = Device::from_context(ctx.clone())?;
    let weights = DeviceWeights::copy_from(
        &stream,
        DeviceTensor::new(&w13, &stream),
        None,
        DeviceTensor::new(&w2, &stream),
        None,
    )?;
    let layer = MoeLayer::load(&device, spec, weights)?;
    let m = 64;
    layer.reserve(m)?;

    // The step's buffers, the engine's too.
    let (x, ids, rw) = random_step(&spec, m, 0.3, 2);
    let ids64: Vec<i64> = ids.iter().map(|&i| i as i64).collect();
    let dx = stream.clone_htod(&x.iter().map(|&v| Bf::from_f32(v)).collect::<Vec<_>>())?;
    let (dids, drw) = (stream.clone_htod(&ids64)?, stream.clone_htod(&rw)?);
    let mut dy = stream.alloc_zeros::<Bf>(x.len())?;

    stream.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)?;
    let step = layer.forward_on(
        &stream,
        DeviceTensor::new(&dx, &stream),
        TopkIds::I64(DeviceTensor::new(&dids, &stream)),
        DeviceTensor::new(&drw, &stream),
        DeviceTensorMut::new(&mut dy, &stream),
    );
    let graph = stream.end_capture(CUgraphInstantiate_flags(0))?;
    step?;
    let graph = graph.ok_or("the capture gave no graph")?;
    graph.launch()?;
    let got: Vec<f32> = stream.clone_dtoh(&dy)?.into_iter().map(|v| v.to_f32()).collect();
    let (rel, cos) = compare(&got, &moe_forward(&spec, &host, &x, &ids, &rw));
    println!(
        "{} M = {m} ({}) through the engine's graph: rel L2 {rel:.3e}, cosine {cos:.8}",
        spec.id(),
        layer.last_choice()?.family
    );
    if !(rel <= 5e-3 && cos >= 0.9999) {
        return Err("outside the tolerance (rel L2 <= 5e-3, cosine >= 0.9999)".into());
    }
    Ok(())
}
