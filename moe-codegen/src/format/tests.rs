use super::*;

/// A deterministic, roughly Gaussian test matrix with one outlier per row.
fn matrix(rows: usize, cols: usize, seed: u32) -> Vec<f32> {
    let mut x = seed.wrapping_mul(2_654_435_761).max(1);
    let mut next = move || {
        x ^= x << 13;
        x ^= x >> 17;
        x ^= x << 5;
        x as f32 / u32::MAX as f32
    };
    (0..rows * cols)
        .map(|i| {
            let g = (0..4).map(|_| next()).sum::<f32>() - 2.0;
            let scale = 0.05 * (1 + (i / cols) % 7) as f32;
            if i % cols == (i / cols * 37) % cols {
                g * scale * 4.0
            } else {
                g * scale
            }
        })
        .collect()
}

/// The largest error a format may make on an element: `(relative to the element, relative to
/// the maximum magnitude of its scale group)` (MX saturation and e2m1's gaps dominate the 4-bit
/// floats; integers round to half a step).
fn bound(f: WeightFormat) -> (f32, f32) {
    match f.codec() {
        Codec::Bf16 => (1.0 / 256.0, 0.0),
        Codec::Fp16 => (1.0 / 2048.0, 0.0),
        Codec::E4m3 if f == WeightFormat::Mxfp8 => (1.0 / 16.0, 0.125),
        Codec::E4m3 => (1.0 / 16.0, 1e-5),
        Codec::Int8 => (0.0, 0.5 / 127.0 + 1e-3),
        Codec::Uint4 if f.has_zero_points() => (0.0, 0.5 / 7.5 + 1e-3),
        Codec::Uint4 => (0.0, 0.5 / 7.0 + 1e-3),
        Codec::E2m1 => (0.0, 0.25),
    }
}

/// The columns sharing `c`'s scale group (128 for the block format, the row when per row).
fn group_of(f: WeightFormat, cols: usize, c: usize) -> std::ops::Range<usize> {
    let g = match f.k_group() {
        0 => cols,
        g => g as usize,
    };
    (c / g * g)..((c / g + 1) * g).min(cols)
}

#[test]
fn every_format_roundtrips_within_its_bound() {
    let (t, rows, cols) = (2, 128, 256);
    let w = matrix(t * rows, cols, 7);
    for f in WeightFormat::ALL {
        let p = f.quantize_stacked(t, rows, cols, &w).unwrap();
        assert_eq!((p.rows, p.cols, p.tensors), (t * rows, cols, t));
        assert_eq!(p.data.len(), f.data_bytes(t * rows, cols), "{f}");
        assert_eq!(p.scales.len(), f.scale_bytes(t, rows, cols), "{f}");
        let d = f.dequantize(&p);
        let (mut e2, mut w2) = (0f64, 0f64);
        // Per element, the maximum magnitude over its scale group (block of 128 rows for b128).
        let band = if f == WeightFormat::Fp8E4m3B128 { 128 } else { 1 };
        let mut gmax = vec![0f32; w.len()];
        for r0 in (0..t * rows).step_by(band) {
            let mut c = 0;
            while c < cols {
                let g = group_of(f, cols, c);
                let m = (r0..r0 + band)
                    .flat_map(|r| g.clone().map(move |cc| (r, cc)))
                    .map(|(r, cc)| w[r * cols + cc].abs())
                    .fold(0f32, f32::max);
                for r in r0..r0 + band {
                    gmax[r * cols + g.start..r * cols + g.end].fill(m);
                }
                c = g.end;
            }
        }
        for r in 0..t * rows {
            for c in 0..cols {
                let (a, b) = (w[r * cols + c], d[r * cols + c]);
                let amax = gmax[r * cols + c];
                let tol = a.abs() * bound(f).0 + amax * bound(f).1;
                assert!((a - b).abs() <= tol + 1e-7, "{f} [{r}][{c}]: {a} -> {b} (group max {amax})");
                e2 += ((a - b) as f64).powi(2);
                w2 += (a as f64).powi(2);
            }
        }
        let rel = (e2 / w2).sqrt();
        let limit = match (f.elem_bits(), f.k_group()) {
            (16, _) => 3e-3,
            (8, _) => 0.05,
            (_, 0) => 0.25, // 4 bits over a whole row with an outlier in it
            _ => 0.15,
        };
        assert!(rel < limit, "{f}: relative rms error {rel}");
    }
}

#[test]
fn zeros_quantize_to_zeros() {
    for f in WeightFormat::ALL {
        let p = f.quantize_stacked(2, 128, 128, &[0.0; 2 * 128 * 128]).unwrap();
        let d = f.dequantize(&p);
        assert!(d.iter().all(|&v| v == 0.0), "{f}");
    }
    // Unit scales for all-zero rows.
    let p = WeightFormat::Fp8E4m3.quantize(2, 16, &[0.0; 32]).unwrap();
    assert_eq!(p.scales, [1f32.to_le_bytes(), 1f32.to_le_bytes()].concat());
}

#[test]
fn extreme_magnitudes() {
    let (rows, cols) = (128, 128);
    let mut w = matrix(rows, cols, 3);
    for r in 0..rows {
        w[r * cols + r] = if r % 2 == 0 { f32::MAX } else { -f32::MAX };
    }
    for f in WeightFormat::ALL {
        match f.quantize(rows, cols, &w) {
            Ok(p) => {
                let d = f.dequantize(&p);
                assert!(d.iter().all(|v| v.is_finite()), "{f}: a value decoded to infinity");
                for r in 0..rows {
                    let got = d[r * cols + r];
                    let want = w[r * cols + r];
                    let tol = want.abs() * (bound(f).0 + bound(f).1);
                    assert!((got - want).abs() <= tol, "{f} row {r}: {want} -> {got}");
                }
            }
            Err(e) => {
                // Formats with 16-bit floats or f16 scales cannot reach f32::MAX: a typed error.
                let sixteen = matches!(
                    f.scale_layout(),
                    ScaleLayout::None | ScaleLayout::GroupF16 { .. } | ScaleLayout::GroupF16Zero { .. }
                );
                assert!(sixteen, "{f}: {e}");
                assert!(matches!(e, QuantError::OutOfRange { row: 0, col: 0, .. }), "{f}: {e}");
            }
        }
    }
    // The largest magnitudes the f16-scaled formats do hold come back.
    let m = f16::MAX.to_f32() * 127.0;
    let p = WeightFormat::Int8G32.quantize(1, 32, &[[m, -m].as_slice(), &[0.0; 30]].concat()).unwrap();
    let d = WeightFormat::Int8G32.dequantize(&p);
    assert_eq!((d[0], d[1]), (m, -m));
}

#[test]
fn subnormal_inputs_stay_finite_and_tiny() {
    let (rows, cols) = (128, 128);
    let w: Vec<f32> = (0..rows * cols)
        .map(|i| f32::from_bits(1 + (i as u32 * 7919) % 0x7f_ffff) * if i % 3 == 0 { -1.0 } else { 1.0 })
        .collect();
    assert!(w.iter().all(|v| v.is_subnormal()));
    for f in WeightFormat::ALL {
        let p = f.quantize(rows, cols, &w).unwrap();
        let d = f.dequantize(&p);
        for (a, b) in w.iter().zip(&d) {
            assert!(b.is_finite() && (a - b).abs() <= 2.0 * f32::MIN_POSITIVE, "{f}: {a} -> {b}");
        }
    }
    // With an f32 row scale, subnormal rows keep most of their precision.
    let p = WeightFormat::Int8.quantize(rows, cols, &w).unwrap();
    let d = WeightFormat::Int8.dequantize(&p);
    let err = w.iter().zip(&d).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
    assert!(err <= 1e-40, "{err}");
}

#[test]
fn non_finite_and_bad_shapes_are_refused() {
    for f in WeightFormat::ALL {
        for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            let mut w = vec![1.0f32; 2 * 128];
            w[128 + 5] = bad;
            let e = f.quantize(2, 128, &w).unwrap_err();
            assert!(matches!(e, QuantError::NonFinite { row: 1, col: 5, .. }), "{f}: {e}");
        }
        let e = f.quantize(3, 128, &[0.0; 256]).unwrap_err();
        assert!(matches!(e, QuantError::Shape { expected: 384, got: 256, .. }), "{f}: {e}");
    }
    let e = WeightFormat::Int4G128.quantize(1, 64, &[0.0; 64]).unwrap_err();
    assert!(matches!(e, QuantError::Layout { .. }), "{e}");
    let e = WeightFormat::Fp8E4m3B128.quantize(64, 128, &[0.0; 64 * 128]).unwrap_err();
    assert!(matches!(e, QuantError::Layout { .. }), "{e}");
}

#[test]
fn packed_layouts_byte_by_byte() {
    // INT4 symmetric: u = q + 8, element 0 in the low nibble; one f32 scale per row.
    let w = [-7.0f32, 7.0, 0.0, 1.0];
    let p = WeightFormat::Int4.quantize(1, 4, &w).unwrap();
    assert_eq!(p.data, vec![0x01 | 0xf0, 0x08 | 0x90]);
    assert_eq!(p.scales, 1f32.to_le_bytes());
    assert_eq!(WeightFormat::Int4.dequantize(&p), w);
    // INT8: two's complement codes.
    let p = WeightFormat::Int8.quantize(1, 2, &[-127.0, 64.0]).unwrap();
    assert_eq!(p.data, vec![0x81, 64]);
    // Asymmetric INT4: [0, 15] over [-3, 12]: scale 1, zero 3, record = f16(1) | 3 << 16.
    let w: Vec<f32> = (0..32).map(|i| (i % 16) as f32 - 3.0).collect();
    let p = WeightFormat::Int4AsymG32.quantize(1, 32, &w).unwrap();
    assert_eq!(p.scales, (0x3c00u32 | 3 << 16).to_le_bytes());
    assert_eq!(p.data[0], 0x10);
    assert_eq!(WeightFormat::Int4AsymG32.dequantize(&p), w);
    // MXFP4: amax 6 -> E8M0 127 (2^0), codes are the e2m1 nibbles themselves.
    let w: Vec<f32> =
        (0..32).map(|i| crate::numerics::E2M1_VALUES[i % 8] * if i % 16 >= 8 { -1.0 } else { 1.0 }).collect();
    let p = WeightFormat::Mxfp4.quantize(1, 32, &w).unwrap();
    assert_eq!(p.scales, vec![127]);
    assert_eq!(p.data[0], 0x10);
    assert_eq!(p.data[4], 0x98);
    assert_eq!(WeightFormat::Mxfp4.dequantize(&p), w);
    // NVFP4: globals first, one per stacked tensor, then the e4m3 block scales.
    let w: Vec<f32> = (0..2 * 32).map(|i| (i % 7) as f32 * if i >= 32 { 10.0 } else { 1.0 }).collect();
    let p = WeightFormat::Nvfp4.quantize_stacked(2, 1, 32, &w).unwrap();
    assert_eq!(p.scales.len(), 2 * 4 + 2 * 2);
    let g0 = f32::from_le_bytes(p.scales[0..4].try_into().unwrap());
    let g1 = f32::from_le_bytes(p.scales[4..8].try_into().unwrap());
    assert_eq!((g0, g1), (6.0 / 2688.0, 60.0 / 2688.0));
    // Block 128x128: one f32 per block, blocks of the second row band after the first.
    let mut w = vec![1.0f32; 256 * 128];
    w[200 * 128] = 448.0 * 4.0;
    let p = WeightFormat::Fp8E4m3B128.quantize(256, 128, &w).unwrap();
    let s: Vec<f32> = p.scales.chunks(4).map(|b| f32::from_le_bytes(b.try_into().unwrap())).collect();
    assert_eq!(s, vec![1.0 / 448.0, 4.0]);
}

#[test]
fn bytes_count_codes_and_every_scale() {
    let (n, k) = (1536, 2048);
    assert_eq!(WeightFormat::Bf16.bytes_for(n, k), n * k * 2);
    assert_eq!(WeightFormat::Fp8E4m3.bytes_for(n, k), n * k + 4 * n);
    assert_eq!(WeightFormat::Fp8E4m3B128.bytes_for(n, k), n * k + 4 * 12 * 16);
    assert_eq!(WeightFormat::Mxfp8.bytes_for(n, k), n * k + n * 64);
    assert_eq!(WeightFormat::Int8G128.bytes_for(n, k), n * k + 2 * n * 16);
    assert_eq!(WeightFormat::Int4.bytes_for(n, k), n * k / 2 + 4 * n);
    assert_eq!(WeightFormat::Int4AsymG128.bytes_for(n, k), n * k / 2 + 4 * n * 16);
    assert_eq!(WeightFormat::Int4Asym.bytes_for(n, k), n * k / 2 + 4 * n);
    assert_eq!(WeightFormat::Nvfp4.bytes_for(n, k), n * k / 2 + n * k / 16 + 4);
    assert_eq!(WeightFormat::Mxfp4.bytes_for(n, k), n * k / 2 + n * k / 32);
}

#[test]
fn names_parse() {
    for f in WeightFormat::ALL {
        assert_eq!(f.name().parse::<WeightFormat>().unwrap(), f);
        assert!(WeightFormat::NAMES.contains(f.name()));
    }
    let e = "int3".parse::<WeightFormat>().unwrap_err();
    assert!(e.to_string().contains("nvfp4"), "{e}");
}
