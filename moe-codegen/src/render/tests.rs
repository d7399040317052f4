use super::*;
use crate::spec::{ActDtype, REFERENCE_GEOMETRIES};

fn qwen(format: WeightFormat) -> MoeSpec {
    MoeSpec::builder(2048, 768, 128, 8).weight_format(format).build().unwrap()
}

#[test]
fn geometry_is_baked_in_as_constants() {
    let k = render(&qwen(WeightFormat::Bf16), KernelFamily::WarpDecode, Arch::Sm90a).unwrap();
    for needle in [
        "constexpr int HIDDEN = 2048;",
        "constexpr int INTER = 768;",
        "constexpr int EXPERTS = 128;",
        "constexpr int TOP_K = 8;",
        "typedef __nv_bfloat16 act_t;",
        "constexpr int W_VEC = 8;",
        "return __fdividef(g, 1.0f + __expf(-g));",
    ] {
        assert!(k.source.contains(needle), "missing {needle}");
    }
    for ep in &k.entry_points {
        let threads = match ep.as_str() {
            "moe_gate_up_bulk" => "BK_GU_THREADS, 1",
            "moe_down_bulk" => "BK_DN_THREADS, 1",
            "moe_route" | "moe_expand_routing" => "ROUTE_WARPS * 32",
            "moe_decode_resident" => "RES_WARPS * 32, 1",
            _ => "WARPS * 32",
        };
        // One parameter: the kernel's struct from moe_codegen::params.
        let sig = format!("void __launch_bounds__({threads})\n{ep}(const __grid_constant__ ");
        assert!(k.source.contains(&sig), "{ep}");
    }
    assert_eq!(k.name, "warp_decode_h2048_i768_e128_k8_bf16_bf16_silu");
}

#[test]
fn the_resident_kernel_serves_16_bit_weights_whose_w2_share_fits() {
    let sm90 = 232_448; // an H100's or H200's opt-in shared memory per block
    let spec = |h, i, e, k, f| MoeSpec::builder(h, i, e, k).weight_format(f).build().unwrap();
    let qwen3 = spec(2048, 768, 128, 8, WeightFormat::Bf16);
    assert_eq!(resident_rows(&qwen3, Arch::Sm90a, 132, sm90), Some(16));
    assert_eq!(resident_smem_bytes(&qwen3, 16), 8 * 16 * 768 * 2 + 2048 * 4 + 8 * 16 * 4 + 8);
    assert_eq!(resident_rows(&qwen3, Arch::Sm90a, 114, sm90), None, "114 SMs (H100 PCIe): 24 rows, 297 KiB");
    assert_eq!(resident_rows(&qwen3, Arch::Sm90a, 132, 99 * 1024), None, "sm_120a's 99 KiB");
    assert_eq!(resident_rows(&spec(2048, 768, 128, 8, WeightFormat::Fp16), Arch::Sm90a, 132, sm90), Some(16));
    assert_eq!(
        resident_rows(&spec(2048, 1024, 64, 8, WeightFormat::Bf16), Arch::Sm90a, 132, sm90),
        None,
        "OLMoE: 256 KiB"
    );
    assert_eq!(resident_rows(&spec(2048, 768, 128, 8, WeightFormat::Mxfp4), Arch::Sm90a, 132, sm90), None);
    assert!(
        !resident_renders(&spec(2880, 2880, 32, 4, WeightFormat::Bf16), Arch::Sm90a),
        "gpt-oss: 2880 not 256-aligned"
    );
    // Not the quantized formats: slower than the split kernels (row scales), or group scales.
    for f in
        [WeightFormat::Fp8E4m3, WeightFormat::Int8, WeightFormat::Int4, WeightFormat::Int4G128, WeightFormat::Mxfp4]
    {
        assert!(!resident_renders(&spec(2048, 768, 128, 8, f), Arch::Sm90a), "{f}");
    }
}

#[test]
fn format_picks_its_include_and_nothing_else() {
    let fp8 = render(&qwen(WeightFormat::Fp8E4m3), KernelFamily::WarpDecode, Arch::Sm90a).unwrap();
    assert!(fp8.source.contains("constexpr int W_VEC = 16;"));
    assert!(fp8.source.contains("__NV_E4M3"));
    assert_eq!(fp8.source.matches("constexpr int W_VEC").count(), 1);
    let fp16 = render(&qwen(WeightFormat::Fp16), KernelFamily::WarpDecode, Arch::Sm90a).unwrap();
    assert!(fp16.source.contains("typedef __half act_t;"));
    assert!(!fp16.source.contains("__NV_E4M3"));
}

#[test]
fn activation_is_rendered() {
    let spec = MoeSpec::builder(512, 256, 8, 2).activation(Activation::GeluTanh).build().unwrap();
    let k = render(&spec, KernelFamily::WarpDecode, Arch::Sm120a).unwrap();
    assert!(k.source.contains("tanhf"));
    assert!(!k.source.contains("__expf(-g)"));
}

#[test]
fn rendering_is_deterministic_and_spec_sensitive() {
    let a = render(&qwen(WeightFormat::Bf16), KernelFamily::WarpDecode, Arch::Sm90a).unwrap();
    let b = render(&qwen(WeightFormat::Bf16), KernelFamily::WarpDecode, Arch::Sm90a).unwrap();
    assert_eq!(a, b);
    let c = render(&MoeSpec::builder(2048, 768, 64, 8).build().unwrap(), KernelFamily::WarpDecode, Arch::Sm90a);
    assert_ne!(a.source, c.unwrap().source);
}

#[test]
fn every_reference_geometry_has_all_variants() {
    for (name, h, i, e, k) in REFERENCE_GEOMETRIES {
        let v = variants(h, i, e, k);
        // gpt-oss-20b's 2880 is no multiple of 128: no g128 formats, no 128x128 blocks.
        let formats = if name == "gpt-oss-20b" { WeightFormat::ALL.len() - 4 } else { WeightFormat::ALL.len() };
        // The grouped family takes every format the spec accepts (per-channel fp8 at
        // gpt-oss-20b's 2880 decoded in registers); the fused family every one whose K comes
        // in whole chunks (4-bit codes take 128 a chunk: 2880 has none of its 8 left).
        let fused = if name == "gpt-oss-20b" { formats - 8 } else { formats };
        assert_eq!(v.len(), 2 * formats + fused, "{name}");
        assert_eq!(v.iter().filter(|(_, f)| *f == KernelFamily::Fused).count(), fused, "{name}");
        for (spec, fam) in v {
            for arch in Arch::ALL {
                render(&spec, fam, arch).unwrap();
            }
        }
    }
}

#[test]
fn every_format_and_variant_renders_on_every_arch() {
    let v = dequant_variants(2048, 768, 128, 8);
    let n: usize = WeightFormat::ALL.iter().map(|f| f.dequant_variants().len()).sum();
    assert_eq!(v.len(), n);
    let mut names = std::collections::HashSet::new();
    for (spec, fam) in v {
        for arch in Arch::ALL {
            let k = render(&spec, fam, arch).unwrap();
            assert!(names.insert((k.name.clone(), arch)), "duplicate module name {}", k.name);
            let d = spec.dequant().unwrap();
            assert!(k.source.contains(&format!("dequant variant {d}")), "{}", k.name);
            assert_eq!(k.source.matches("constexpr int W_VEC").count(), 1);
            assert_eq!(k.source.contains("w_lut"), d == DequantVariant::Lut, "{}", k.name);
        }
    }
}

#[test]
fn variant_is_in_the_source_and_the_name() {
    let base = MoeSpec::builder(2048, 768, 128, 8).weight_format(WeightFormat::Int4G128);
    let bits = render(&base.build().unwrap(), KernelFamily::WarpDecode, Arch::Sm90a).unwrap();
    assert!(bits.name.ends_with("int4_g128_bf16_silu_bits"), "{}", bits.name);
    assert!(bits.source.contains("0x64006400u"));
    let lut = render(&base.dequant(DequantVariant::Lut).build().unwrap(), KernelFamily::WarpDecode, Arch::Sm90a);
    let lut = lut.unwrap();
    assert!(lut.name.ends_with("int4_g128_bf16_silu_lut"), "{}", lut.name);
    assert_ne!(lut.source, bits.source);
    // The symmetric table folds the zero point: entry 0 is -8.0 (0xc1000000).
    assert!(lut.source.contains("0xc1000000u"));
    // Named default and implied default render the same source (one cache entry).
    let named = render(&base.dequant(DequantVariant::Bits).build().unwrap(), KernelFamily::WarpDecode, Arch::Sm90a);
    assert_eq!(named.unwrap().source, bits.source);
    // fp8 keeps its hardware cvt path by default.
    let fp8 = render(&qwen(WeightFormat::Fp8E4m3), KernelFamily::WarpDecode, Arch::Sm90a).unwrap();
    assert!(fp8.name.ends_with("fp8_e4m3_bf16_silu_hardware"), "{}", fp8.name);
    assert!(fp8.source.contains("__nv_cvt_fp8x2_to_halfraw2"));
}

#[test]
fn hardware_fp4_goes_through_e4m3_on_hopper() {
    let spec = MoeSpec::builder(2880, 2880, 32, 4)
        .weight_format(WeightFormat::Mxfp4)
        .dequant(DequantVariant::Hardware)
        .build()
        .unwrap();
    let h = render(&spec, KernelFamily::WarpDecode, Arch::Sm90a).unwrap().source;
    assert!(!h.contains("cvt.rn.f16x2.e2m1x2") && h.contains("cvt.rn.f16x2.e4m3x2"));
    assert!(h.contains("#define MOE_W_H2_UNIT 0.015625f"));
    for arch in [Arch::Sm100a, Arch::Sm120a] {
        let b = render(&spec, KernelFamily::WarpDecode, arch).unwrap().source;
        assert!(b.contains("cvt.rn.f16x2.e2m1x2") && !b.contains("MOE_W_H2_UNIT 0.015625f"));
    }
    // The default on sm_90a, not on Blackwell.
    assert_eq!(WeightFormat::Nvfp4.default_dequant(Arch::Sm90a), DequantVariant::Hardware);
    assert_eq!(WeightFormat::Nvfp4.default_dequant(Arch::Sm120a), DequantVariant::Bits);
    // A variant the format lacks altogether is refused by the spec itself.
    let e = MoeSpec::builder(2048, 768, 128, 8).dequant(DequantVariant::Lut).build().unwrap_err();
    assert!(matches!(e, crate::spec::SpecError::DequantUnsupported { .. }), "{e}");
}

#[test]
fn probe_renders_every_format_and_variant() {
    for f in WeightFormat::ALL {
        for &d in f.dequant_variants() {
            for arch in Arch::ALL {
                match render_dequant_probe(f, Some(d), arch, 2, 128, 256) {
                    Ok(k) => {
                        assert!(k.source.contains("dequant_probe("));
                        assert!(k.source.contains("constexpr int P_K = 256;"));
                    }
                    Err(e) => assert!(matches!(e, CodegenError::DequantUnavailable { .. }), "{e}"),
                }
            }
        }
    }
    assert!(render_dequant_probe(WeightFormat::Fp8E4m3B128, None, Arch::Sm90a, 1, 64, 256).is_err());
    assert!(render_dequant_probe(WeightFormat::Int8G128, None, Arch::Sm90a, 1, 64, 96).is_err());
}

#[test]
fn lut_is_static_shared_memory() {
    let s = |f, d| MoeSpec::builder(2048, 768, 128, 8).weight_format(f).dequant(d).build().unwrap();
    assert_eq!(static_smem_bytes(&s(WeightFormat::Nvfp4, DequantVariant::Lut), Arch::Sm90a), 64);
    assert_eq!(static_smem_bytes(&s(WeightFormat::Int8G32, DequantVariant::Lut), Arch::Sm90a), 1024);
    assert_eq!(static_smem_bytes(&s(WeightFormat::Int8G32, DequantVariant::Bits), Arch::Sm90a), 0);
}

#[test]
fn down_stash_is_bounded_and_has_its_own_entry() {
    let s = qwen(WeightFormat::Fp8E4m3);
    let t = DecodeTiles::for_spec(&s);
    assert_eq!(t.dn_stash, 4);
    let k = render_warp_decode(&s, Arch::Sm90a, t).unwrap();
    assert!(k.entry_points.iter().any(|e| e == "moe_down_stash"));
    assert!(k.source.contains("moe_down_stash(") && k.source.contains("DN_CHUNK : 4;"));
    // 8 warps x 12 vectors x 512 B = 48 KiB: over the static budget, a typed refusal.
    let e = render_warp_decode(&s, Arch::Sm90a, DecodeTiles { dn_stash: 12, ..t }).unwrap_err();
    assert!(matches!(e, CodegenError::Unsupported { .. }) && e.to_string().contains("stash"), "{e}");
    let e = render_warp_decode(&s, Arch::Sm90a, DecodeTiles { dn_rows: 0, ..t }).unwrap_err();
    assert!(e.to_string().contains("zero count"), "{e}");
    let e = render_warp_decode(&s, Arch::Sm90a, DecodeTiles { dn_rows: 3, ..t }).unwrap_err();
    assert!(e.to_string().contains("3 rows per down item"), "{e}");
    assert_eq!(decode_down_smem_bytes(&s, 1), 64);
    assert_eq!(decode_down_smem_bytes(&s, 3), 192);
}

#[test]
fn the_hosts_smem_sizes_reach_the_source() {
    // warp_decode.cu and decode_bulk.cuh static_assert their layouts against these.
    let s = qwen(WeightFormat::Int4G128);
    let t = DecodeTiles::for_spec(&s);
    let k = render_warp_decode(&s, Arch::Sm90a, t).unwrap().source;
    let (gu, dn) = bulk_smem_bytes(&s, &t);
    for (name, v) in [
        ("HOST_ROUTING_FIXED", routing_smem_bytes(&s, 0)),
        ("HOST_ROUTING_PER_PAIR", 16),
        ("HOST_ROUTING_PER_UNIQUE", 20),
        ("HOST_X_TOKEN", decode_smem_bytes(&s, 1) - routing_smem_bytes(&s, 1).next_multiple_of(16) - 16),
        ("HOST_X_MAX", X_STAGE_MAX_BYTES),
        ("HOST_DOWN_PER_PAIR", decode_down_smem_bytes(&s, 2) / (2 * 8)),
        ("HOST_MID_ROW", decode_mid_floats(&s, 1) as u32 / 8),
        ("HOST_DN_STASH", t.warps * t.dn_stash * 512),
        ("HOST_STATIC_SMEM", 0),
        ("HOST_BK_GU_SMEM", gu),
        ("HOST_BK_DN_SMEM", dn),
    ] {
        assert!(k.contains(&format!("constexpr int {name} = {v};")), "{name} = {v}");
    }
    let lut = MoeSpec::builder(2048, 768, 128, 8).weight_format(WeightFormat::Int8).dequant(DequantVariant::Lut);
    let k = render(&lut.build().unwrap(), KernelFamily::WarpDecode, Arch::Sm90a).unwrap().source;
    assert!(k.contains("constexpr int HOST_STATIC_SMEM = 1024;") && k.contains("sizeof(w_lut) == HOST_STATIC_SMEM"));
}

#[test]
fn tiles_and_smem() {
    let s = qwen(WeightFormat::Bf16);
    let t = DecodeTiles::for_spec(&s);
    // down: 8 rows x 96 vectors = 24 per lane, in units of 4; 4-bit: 6 per lane, one unit.
    assert_eq!((t.gu_chunk, t.dn_chunk, t.dn_rows), (4, 4, 2));
    assert_eq!(DecodeTiles::for_spec(&qwen(WeightFormat::Int4G128)).dn_chunk, 6);
    assert_eq!(DecodeTiles::for_spec(&qwen(WeightFormat::Fp8E4m3)).dn_chunk, 4);
    // The early first unit is on for the e4m3 codes only, and reaches the source.
    assert!(DecodeTiles::for_spec(&qwen(WeightFormat::Mxfp8)).gu_early && !t.gu_early);
    let k = render_warp_decode(
        &qwen(WeightFormat::Fp8E4m3),
        Arch::Sm90a,
        DecodeTiles::for_spec(&qwen(WeightFormat::Fp8E4m3)),
    );
    assert!(k.unwrap().source.contains("constexpr bool GU_EARLY = true;"));
    // 16 lanes per row in the multi-token gate_up kernels (the 4-bit default) reach the
    // source; 8 is refused.
    let s4 = qwen(WeightFormat::Int4G128);
    let t4 = DecodeTiles::for_spec(&s4);
    assert_eq!((t.gu_lanes, t4.gu_lanes), (32, 16));
    assert_eq!(DecodeTiles::for_spec(&qwen(WeightFormat::Nvfp4)).gu_lanes, 16);
    assert!(render_warp_decode(&s4, Arch::Sm90a, t4).unwrap().source.contains("MT == 1 ? 32 : 16;"));
    let e = render_warp_decode(&s4, Arch::Sm90a, DecodeTiles { gu_lanes: 8, ..t4 }).unwrap_err();
    assert!(e.to_string().contains("8 lanes per gate_up row"), "{e}");
    // The bulk kernels: both for 4-bit, down alone for 8-bit, neither for 16-bit.
    let on = |f: WeightFormat| {
        let t = DecodeTiles::for_spec(&qwen(f));
        (t.bulk_gu, t.bulk_dn)
    };
    assert_eq!(on(WeightFormat::Int4G128), (true, true));
    assert_eq!(on(WeightFormat::Fp8E4m3), (false, true));
    assert_eq!((on(WeightFormat::Nvfp4), on(WeightFormat::Bf16)), ((true, true), (false, false)));
    assert!(t4.bulk_dn_h2 && DecodeTiles::for_spec(&qwen(WeightFormat::Int4G32)).bulk_dn_h2);
    let h2 = |t: DecodeTiles| render_warp_decode(&s4, Arch::Sm90a, t).unwrap().source;
    assert!(h2(t4).contains("W_H2 && true;") && h2(DecodeTiles { bulk_dn_h2: false, ..t4 }).contains("W_H2 && false;"));
    // Int4 g128: 3 gate_up stages of 16 gate and up rows (32 KiB) after 512 bytes of barriers
    // and the 8 KiB token; one down stage of 16 rows per slot (48 KiB) after the 32 KiB
    // intermediate. One 8-bit down stage (96 KiB) is past the budget but allowed.
    assert_eq!((t4.bulk_gu_stages, t4.bulk_dn_stages), (3, 1));
    assert_eq!(bulk_smem_bytes(&s4, &t4), (512 + 8320 + 3 * 32768, 128 + 128 + 32768 + 49152));
    let t8 = DecodeTiles::for_spec(&qwen(WeightFormat::Fp8E4m3));
    assert_eq!(bulk_smem_bytes(&qwen(WeightFormat::Fp8E4m3), &t8).1, 256 + 32768 + 98304);
    let bad = render_warp_decode(&s4, Arch::Sm90a, DecodeTiles { bulk_dn_warps: 24, ..t4 }).unwrap_err();
    assert!(bad.to_string().contains("24 consumer warps"), "{bad}");
    let bad = render_warp_decode(&s4, Arch::Sm90a, DecodeTiles { bulk_gu_stages: 9, ..t4 }).unwrap_err();
    assert!(bad.to_string().contains("bulk rings of 9"), "{bad}");
    // A 4-bit intermediate row of 768 is 24 vectors of 32, padded to one chunk of 32.
    assert_eq!(decode_mid_floats(&qwen(WeightFormat::Int4G128), 2), 2 * 8 * 1024);
    assert_eq!(decode_mid_floats(&s, 1), 8 * 768);
    assert_eq!(DecodeTiles::token_tile(1), 1);
    assert_eq!(DecodeTiles::token_tile(3), 4);
    assert_eq!(DecodeTiles::token_tile(64), 4);
    // 128 map + 5*8 + 4*8 + 1 ints at M = 1.
    assert_eq!(routing_smem_bytes(&s, 1), 4 * (128 + 40 + 32 + 1));
    // Plus a 16-byte slot of per-token exponents and 2048 fp32 activations per token while
    // they fit in 64 KiB.
    assert_eq!(decode_smem_bytes(&s, 1), 816 + 16 + 8192);
    assert_eq!(decode_smem_bytes(&s, 8), routing_smem_bytes(&s, 8).next_multiple_of(16) + 32 + 65536);
    assert_eq!(decode_smem_bytes(&s, 9), routing_smem_bytes(&s, 9).next_multiple_of(16));
    let _ = ActDtype::Bf16;
}
