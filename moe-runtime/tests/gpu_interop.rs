//! The caller-owned API on a real GPU: a device from the caller's context, weights moved in from
//! device memory, and `forward_on` over the caller's buffers and stream (int32 and int64 ids),
//! captured in the caller's graph. Ignored without a GPU; each test fails (never passes) when no
//! GPU is found.

use moe_codegen::{KernelFamily, MoeSpec};
use moe_runtime::cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use moe_runtime::cudarc::driver::CudaContext;
use moe_runtime::reference::{compare, moe_forward};
use moe_runtime::testing::{fresh_seed, random_step, random_weights};
use moe_runtime::{Device, DeviceTensor, DeviceTensorMut, DeviceWeights, MoeLayer, RuntimeError, TopkIds};

type Bf = half::bf16;

fn context() -> std::sync::Arc<CudaContext> {
    CudaContext::new(0).unwrap_or_else(|e| panic!("this test needs an NVIDIA GPU: {e:?}"))
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn caller_owned_buffers_stream_and_graph() {
    let ctx = context();
    let dev = Device::from_context(ctx.clone()).unwrap();
    // The engine's own stream and buffers: nothing below is allocated by moeforge for the step.
    let stream = ctx.new_stream().unwrap();
    let spec = MoeSpec::builder(1024, 512, 32, 4).build().unwrap();
    let seed = fresh_seed();
    let w = random_weights(&spec, seed);
    // Weights the caller already has on the device, copied device to device.
    let (a, b) = (stream.clone_htod(&w.w13).unwrap(), stream.clone_htod(&w.w2).unwrap());
    let dw =
        DeviceWeights::copy_from(&stream, DeviceTensor::new(&a, &stream), None, DeviceTensor::new(&b, &stream), None)
            .unwrap();
    drop((a, b)); // the layer holds its own copies
    let layer = MoeLayer::load(&dev, spec, dw).unwrap();
    for (n, m) in [1usize, 5, 40, 300].into_iter().enumerate() {
        layer.reserve(m).unwrap();
        let (x, ids, rw) = random_step(&spec, m, 0.3, seed + n as u64);
        let want = moe_forward(&spec, &w, &x, &ids, &rw);
        let xs: Vec<Bf> = x.iter().map(|&v| Bf::from_f32(v)).collect();
        let dx = stream.clone_htod(&xs).unwrap();
        let ids64: Vec<i64> = ids.iter().map(|&i| i as i64).collect();
        let (d32, d64) = (stream.clone_htod(&ids).unwrap(), stream.clone_htod(&ids64).unwrap());
        let dr = stream.clone_htod(&rw).unwrap();
        for (wide, graph) in [(false, false), (true, false), (true, true), (false, true)] {
            let mut y = stream.clone_htod(&vec![Bf::NAN; x.len()]).unwrap();
            let ids_view = if wide {
                TopkIds::I64(DeviceTensor::new(&d64, &stream))
            } else {
                DeviceTensor::new(&d32, &stream).into()
            };
            let (xv, rv) = (DeviceTensor::new(&dx, &stream), DeviceTensor::new(&dr, &stream));
            if graph {
                stream.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL).unwrap();
                let r = layer.forward_on(&stream, xv, ids_view, rv, DeviceTensorMut::new(&mut y, &stream));
                let g = stream.end_capture(CUgraphInstantiate_flags(0));
                r.unwrap();
                g.unwrap().expect("captured a graph").launch().unwrap();
            } else {
                layer.forward_on(&stream, xv, ids_view, rv, DeviceTensorMut::new(&mut y, &stream)).unwrap();
            }
            let got: Vec<f32> = stream.clone_dtoh(&y).unwrap().into_iter().map(|v| v.to_f32()).collect();
            let (rel, cos) = compare(&got, &want);
            println!(
                "m={m:<4} i64={wide} graph={graph} {}: rel_l2={rel:.3e} cos={cos:.8}",
                layer.last_choice().unwrap().family
            );
            assert!(got.iter().all(|v| v.is_finite()), "m={m}: unwritten outputs");
            assert!(rel <= 5e-3 && cos >= 0.9999, "m={m} i64={wide} graph={graph}: rel {rel:.3e} cos {cos:.8}");
        }
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU"]
fn caller_owned_bad_input_is_a_typed_error() {
    let ctx = context();
    let dev = Device::from_context(ctx.clone()).unwrap();
    let stream = ctx.new_stream().unwrap();
    let spec = MoeSpec::builder(512, 256, 16, 2).build().unwrap();
    let w = random_weights(&spec, fresh_seed());
    let mut layer = MoeLayer::load(&dev, spec, &w).unwrap();
    layer.set_validate_routing(false);
    let m = 3;
    let x = stream.alloc_zeros::<Bf>(m * 512).unwrap();
    let mut y = stream.alloc_zeros::<Bf>(m * 512).unwrap();
    let r = stream.clone_htod(&[0.5f32; 6]).unwrap();
    // Weights of the wrong size, moved in from the device.
    let short = DeviceWeights {
        w13: stream.alloc_zeros(16).unwrap(),
        w13_scales: None,
        w2: stream.alloc_zeros(16).unwrap(),
        w2_scales: None,
        bias: None,
        shared_gate: None,
    };
    assert!(matches!(MoeLayer::load(&dev, spec, short), Err(RuntimeError::Shape { .. })));
    // Ids of the wrong count.
    let ids = stream.clone_htod(&[0i64; 5]).unwrap();
    let e = layer.forward_on(
        &stream,
        DeviceTensor::new(&x, &stream),
        TopkIds::I64(DeviceTensor::new(&ids, &stream)),
        DeviceTensor::new(&r, &stream),
        DeviceTensorMut::new(&mut y, &stream),
    );
    assert!(matches!(e, Err(RuntimeError::Shape { what: "topk_ids", .. })), "{e:?}");
    // int64 ids past int32 are counted as out of range and their pairs skipped, in both families.
    let ids = stream.clone_htod(&[0i64, 1 << 40, 3, 4, -(1 << 33), 15]).unwrap();
    for family in [KernelFamily::WarpDecode, KernelFamily::GroupedGemm] {
        layer.reserve(m).unwrap();
        layer
            .forward_family_on(
                &stream,
                family,
                DeviceTensor::new(&x, &stream),
                TopkIds::I64(DeviceTensor::new(&ids, &stream)),
                DeviceTensor::new(&r, &stream),
                DeviceTensorMut::new(&mut y, &stream),
            )
            .unwrap();
        stream.synchronize().unwrap();
        assert_eq!(layer.take_routing_errors().unwrap(), 2, "{family}");
    }
    // With validation on, the host check names the first offender.
    layer.set_validate_routing(true);
    let e = layer.forward_on(
        &stream,
        DeviceTensor::new(&x, &stream),
        TopkIds::I64(DeviceTensor::new(&ids, &stream)),
        DeviceTensor::new(&r, &stream),
        DeviceTensorMut::new(&mut y, &stream),
    );
    assert!(matches!(e, Err(RuntimeError::ExpertIdOutOfRange { count: 2, first_pair: 1, .. })), "{e:?}");
}
