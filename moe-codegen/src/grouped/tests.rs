use super::*;
use crate::router::{GroupLimited, Router};
use crate::spec::REFERENCE_GEOMETRIES;

fn spec(h: u32, i: u32, e: u32, k: u32, f: WeightFormat) -> MoeSpec {
    MoeSpec::builder(h, i, e, k).weight_format(f).build().unwrap()
}

#[test]
fn renders_every_reference_geometry_and_arch() {
    for (_, h, i, e, k) in REFERENCE_GEOMETRIES {
        for f in [WeightFormat::Bf16, WeightFormat::Fp8E4m3, WeightFormat::Fp8E4m3B128] {
            let Ok(s) = MoeSpec::builder(h, i, e, k).weight_format(f).build() else { continue };
            for arch in Arch::ALL {
                let r = render_grouped(&s, arch, GemmTiles::for_spec(&s, arch));
                // Per-channel fp8 whose k does not hold whole 128-byte tiles (gpt-oss's 2880)
                // is decoded in registers; the block-scaled format refuses it at build.
                let misfit = f != WeightFormat::Bf16 && (h % 128 != 0 || i % 128 != 0);
                assert_eq!(decodes_weights(&s), misfit, "{f} {h}x{i}");
                assert_eq!(quantizes_activations(&s), f != WeightFormat::Bf16 && !misfit, "{f} {h}x{i}");
                let k = r.unwrap_or_else(|e| panic!("{f} {h}x{i} on {arch}: {e}"));
                assert_eq!(k.source.contains("constexpr int ELEM_BYTES = 1;"), quantizes_activations(&s));
                assert!(k.source.contains(&format!("constexpr int HIDDEN = {h};")));
                assert_eq!(k.source.contains("#define MOE_WGMMA 1"), arch == Arch::Sm90a && !misfit);
                assert!(!k.source.contains("{%"), "askama left a tag");
            }
        }
    }
}

#[test]
fn wgmma_operands_match_the_tile_width() {
    let s = spec(2048, 768, 128, 8, WeightFormat::Bf16);
    let k = render_grouped(&s, Arch::Sm90a, GemmTiles::for_spec(&s, Arch::Sm90a)).unwrap();
    assert!(k.source.contains("m64n256k16.f32.bf16.bf16"));
    assert!(k.source.contains("\"+f\"(d[127])") && !k.source.contains("\"+f\"(d[128])"));
    let s = spec(2048, 768, 128, 8, WeightFormat::Fp8E4m3);
    let k = render_grouped(&s, Arch::Sm120a, GemmTiles::for_spec(&s, Arch::Sm120a)).unwrap();
    assert!(k.source.contains("m16n8k32.row.col.f32.e4m3.e4m3.f32"));
}

#[test]
fn fp8_on_hopper_takes_wide_tiles_in_halves_and_quantizes_mid_in_gemm1() {
    let s = spec(2048, 768, 128, 8, WeightFormat::Fp8E4m3);
    let t = GemmTiles::for_spec(&s, Arch::Sm90a);
    assert_eq!((t.bn1, t.bn2, t.warp_specialized), (256, 256, true));
    assert!(t.quantizes_mid(&s));
    let k = render_grouped(&s, Arch::Sm90a, t).unwrap();
    // The 256-column accumulator and the 128-column partial it is built from.
    assert!(k.source.contains("m64n256k32.f32.e4m3.e4m3") && k.source.contains("m64n128k32.f32.e4m3.e4m3"));
    assert!(k.source.contains("constexpr bool MID_FP8 = true;"));
    // 128-column tiles, the block-barrier pipeline and bf16 leave mid to moe_quant_mid (or bf16).
    for t in [
        GemmTiles { bn1: 128, bn2: 128, stages: 6, ..t },
        GemmTiles { warp_specialized: false, bn1: 128, bn2: 128, ..t },
    ] {
        assert!(!t.quantizes_mid(&s));
        assert!(render_grouped(&s, Arch::Sm90a, t).unwrap().source.contains("constexpr bool MID_FP8 = false;"));
    }
    let b = spec(2048, 768, 128, 8, WeightFormat::Bf16);
    assert!(!GemmTiles::for_spec(&b, Arch::Sm90a).quantizes_mid(&b));
}

#[test]
fn per_channel_fp8_scales_x_per_token_and_keeps_mmas_in_flight() {
    let s = spec(2048, 768, 128, 8, WeightFormat::Fp8E4m3);
    let t = GemmTiles::for_spec(&s, Arch::Sm90a);
    assert!(x_per_token(&s));
    assert!(render_grouped(&s, Arch::Sm90a, t).unwrap().source.contains("constexpr bool X_PER_ROW = true;"));
    // GEMM1 then holds a k-tile's MMAs in flight: one more stage than a promoting pipeline.
    assert!(render_grouped(&s, Arch::Sm90a, GemmTiles { stages: 2, ..t }).is_err());
    assert!(render_grouped(&s, Arch::Sm90a, GemmTiles { stages: 3, ..t }).is_ok());
    // 128 x 128 blocks scale along K: x keeps a scale per 128, and two stages do.
    let b = spec(2048, 768, 128, 8, WeightFormat::Fp8E4m3B128);
    let tb = GemmTiles::for_spec(&b, Arch::Sm90a);
    assert!(!x_per_token(&b));
    assert!(render_grouped(&b, Arch::Sm90a, tb).unwrap().source.contains("constexpr bool X_PER_ROW = false;"));
    assert!(render_grouped(&b, Arch::Sm90a, GemmTiles { stages: 2, ..tb }).is_ok());
}

#[test]
fn the_tile_space_holds_the_defaults_and_renders() {
    for (_, h, i, e, k) in crate::REFERENCE_GEOMETRIES {
        for f in WeightFormat::ALL {
            let Ok(s) = MoeSpec::builder(h, i, e, k).weight_format(f).build() else { continue };
            for arch in Arch::ALL {
                let space = GemmTiles::space(&s, arch);
                let default = GemmTiles::for_spec(&s, arch);
                let renders = render_grouped(&s, arch, default).is_ok();
                // The space lists a tail only where it applies (else it is tail 0's kernel).
                let ext = default.extended_rows(&s.kernel_spec());
                let default = GemmTiles { tail: if ext == 0 { 0 } else { default.tail }, ..default };
                assert_eq!(space.contains(&default), renders, "{} {arch}: default {default:?}", s.id());
                let mut seen = space.clone();
                seen.dedup();
                assert_eq!(seen.len(), space.len(), "{} {arch}: a configuration twice", s.id());
            }
        }
    }
    // Every member renders, and only the members among their neighbours do.
    let s = spec(2048, 768, 128, 8, WeightFormat::Bf16);
    let space = GemmTiles::space(&s, Arch::Sm90a);
    assert!(space.len() > 20, "{} configurations", space.len());
    for t in &space {
        render_grouped(&s, Arch::Sm90a, *t).unwrap_or_else(|e| panic!("{t:?}: {e}"));
    }
    let sm120 = GemmTiles::space(&s, Arch::Sm120a);
    assert!(sm120.iter().all(|t| t.mma == Mma::MmaSync && t.fits(&s, Arch::Sm120a)));
    assert!(sm120.len() < space.len());
}

#[test]
fn default_tiles_fit_each_archs_shared_memory() {
    // Opt-in shared memory per block: H100 / B200 227 KiB, RTX PRO 6000 (sm_120) 99 KiB.
    for (arch, max) in Arch::ALL.map(|a| (a, smem_limits(a).0)) {
        for f in [WeightFormat::Bf16, WeightFormat::Fp8E4m3] {
            let t = GemmTiles::for_spec(&spec(2048, 768, 128, 8, f), arch);
            let s = spec(2048, 768, 128, 8, f);
            assert!(t.gemm1_smem_bytes(&s).max(t.gemm2_smem_bytes(&s)) <= max, "{arch} {f}: {t:?}");
        }
    }
}

#[test]
fn weights_decoded_in_registers_take_their_own_tiles_on_every_geometry_and_arch() {
    // gemm_wq.cuh: 64-token tiles, two blocks per SM where the shared memory holds them (one
    // on sm_120a), as many stages as fit; the source's static_asserts see the host's sizes.
    for (_, h, i, e, k) in crate::REFERENCE_GEOMETRIES {
        for f in [WeightFormat::Mxfp4, WeightFormat::Nvfp4, WeightFormat::Int8, WeightFormat::Mxfp8] {
            let Ok(s) = MoeSpec::builder(h, i, e, k).weight_format(f).build() else { continue };
            for arch in Arch::ALL {
                let t = GemmTiles::for_spec(&s, arch);
                assert_eq!((t.bm, t.mma, t.warp_specialized), (64, Mma::MmaSync, false), "{f} {arch}");
                assert_eq!(t.blocks_per_sm, if arch == Arch::Sm120a { 1 } else { 2 }, "{f} {arch}");
                assert!(t.check(&s, arch).is_ok() && t.fits(&s, arch), "{f} {arch}: {t:?}");
                // One more stage would not fit the blocks per SM.
                let deeper = GemmTiles { stages: t.stages + 1, ..t };
                assert!(t.stages == 8 || !deeper.fits(&s, arch), "{f} {arch}: {t:?}");
                let k = render_grouped(&s, arch, t).unwrap().source;
                for (name, v) in
                    [("HOST_GEMM1_SMEM", t.gemm1_smem_bytes(&s)), ("HOST_GEMM2_SMEM", t.gemm2_smem_bytes(&s))]
                {
                    assert!(k.contains(&format!("constexpr int {name} = {v};")), "{f} {arch}: {name} = {v}");
                }
            }
        }
    }
    // 4-bit stages carry 128 codes (64 bytes) of each weight row and 256 bytes of each token
    // row, and two 8-byte mbarriers.
    let s = spec(2048, 768, 128, 8, WeightFormat::Mxfp4);
    let t = GemmTiles::for_spec(&s, Arch::Sm90a);
    assert_eq!(t.gemm1_smem_bytes(&s), t.stages * (128 * 64 + 64 * 256 + 16) + 128);
    // 16- and 32-token tiles as options, nothing else; up to 4 blocks per SM.
    for (bm, ok) in [(16, true), (32, true), (48, false), (96, false)] {
        assert_eq!(GemmTiles { bm, ..t }.check(&s, Arch::Sm90a).is_ok(), ok, "bm {bm}");
    }
    assert!(GemmTiles::space(&s, Arch::Sm90a).iter().any(|t| t.bm == 16));
    let b = spec(2048, 768, 128, 8, WeightFormat::Bf16);
    assert!(GemmTiles { bm: 16, ..GemmTiles::for_spec(&b, Arch::Sm90a) }.check(&b, Arch::Sm90a).is_err());
    assert!(GemmTiles { blocks_per_sm: 4, ..t }.check(&s, Arch::Sm90a).is_ok());
    assert!(GemmTiles { blocks_per_sm: 5, ..t }.check(&s, Arch::Sm90a).is_err());
    // The tiles' text form takes the token rows last.
    assert_eq!(t.parse("128,128,6,3,bm16"), Some(GemmTiles { bm: 16, stages: 6, blocks_per_sm: 3, ..t }));
    assert_eq!(t.parse("128,128,6,3,bmx"), None);
}

#[test]
fn the_hosts_smem_sizes_reach_the_source() {
    // grouped_gemm.cu and prepare.cuh static_assert their layouts against these.
    for f in [WeightFormat::Bf16, WeightFormat::Fp8E4m3] {
        let s = spec(2048, 768, 128, 8, f);
        for arch in Arch::ALL {
            let t = GemmTiles::for_spec(&s, arch);
            let k = render_grouped(&s, arch, t).unwrap().source;
            for (name, v) in [
                ("HOST_GEMM1_SMEM", t.gemm1_smem_bytes(&s)),
                ("HOST_GEMM2_SMEM", t.gemm2_smem_bytes(&s)),
                ("HOST_PREPARE_SMEM", prepare_smem_bytes(&s)),
            ] {
                assert!(k.contains(&format!("constexpr int {name} = {v};")), "{f} {arch}: {name} = {v}");
            }
        }
    }
}

#[test]
fn refuses_what_it_cannot_do() {
    // Decoded weights take the mma.sync pipeline, or the warp-specialised one whose producer
    // decodes them: without clusters, bn1 >= 128, 128-row tiles; not the block-barrier wgmma
    // one, nor the lut variant (its table would take the stages' shared memory).
    let s = spec(2048, 768, 128, 8, WeightFormat::Int4);
    let ws = GemmTiles::for_spec(&spec(2048, 768, 128, 8, WeightFormat::Bf16), Arch::Sm90a);
    let refused = |t: GemmTiles| matches!(render_grouped(&s, Arch::Sm90a, t), Err(CodegenError::Unsupported { .. }));
    assert!(refused(GemmTiles { cluster: 2, ..ws }));
    assert!(refused(GemmTiles { cluster: 1, bn1: 64, ..ws }));
    assert!(refused(GemmTiles { cluster: 1, bm: 64, ..ws }));
    assert!(refused(GemmTiles { cluster: 1, warp_specialized: false, lag: 0, tail: 0, ..ws }));
    let decoded = GemmTiles { cluster: 1, stages: 3, ..ws };
    let k = render_grouped(&s, Arch::Sm90a, decoded).unwrap();
    // Three slots of the ring (four would take the stages past L1_KEEPING_SMEM, with or
    // without extended items: per-channel int4's column scales take 2 KiB).
    assert!(k.source.contains("constexpr int PACK_RING = 3;") && k.source.contains("constexpr int PACK_BITS = 4;"));
    assert_eq!(decoded.extended_rows(&s), 16, "the producer's decoded stages take extended items too");
    assert_eq!(decoded.gemm2_extended_rows(&s), 16, "GEMM2's too");
    assert!(k.source.contains("constexpr int TAIL = 16;") && k.source.contains("constexpr int TAIL2 = 16;"));
    let k0 = render_grouped(&s, Arch::Sm90a, GemmTiles { tail: 0, ..decoded }).unwrap();
    assert!(k0.source.contains("constexpr int PACK_RING = 3;") && k0.source.contains("constexpr int TAIL = 0;"));
    assert!(render_grouped(&s, Arch::Sm90a, GemmTiles::for_spec(&s, Arch::Sm90a)).is_ok());
    let lut = MoeSpec::builder(2048, 768, 128, 8)
        .weight_format(WeightFormat::Int4)
        .dequant(crate::DequantVariant::Lut)
        .build()
        .unwrap();
    assert!(grouped_support(&lut).is_err());
    let s = spec(2048, 768, 128, 8, WeightFormat::Bf16);
    let wg = GemmTiles { mma: Mma::Wgmma, ..GemmTiles::for_spec(&s, Arch::Sm120a) };
    assert!(render_grouped(&s, Arch::Sm120a, wg).is_err());
    let odd = GemmTiles { bn2: 96, ..GemmTiles::for_spec(&s, Arch::Sm90a) };
    assert!(render_grouped(&s, Arch::Sm90a, odd).is_err());
}

/// Only the mixed-input mma.sync GEMM2 ends on a narrower column block (gpt-oss-20b's 2880
/// outputs: 22 blocks of 128 and one of 64); the other pipelines keep whole column tiles.
#[test]
fn only_decoded_weights_on_mma_sync_take_a_narrower_last_column_block() {
    for arch in [Arch::Sm90a, Arch::Sm100a, Arch::Sm120a] {
        for f in [WeightFormat::Mxfp4, WeightFormat::Int8, WeightFormat::Fp8E4m3] {
            let s = spec(2880, 2880, 32, 4, f);
            let t = GemmTiles::for_spec(&s, arch);
            assert_eq!((t.mma, t.bn2, t.gemm2_col_blocks(2880)), (Mma::MmaSync, 128, 23), "{f} {arch}");
            assert!(t.partial_gemm2(&s), "{f} {arch}");
            let k = render_grouped(&s, arch, t).unwrap_or_else(|e| panic!("{f} {arch}: {e}"));
            assert!(k.source.contains("constexpr int NT2 = (HIDDEN + BN2 - 1) / BN2;"));
            let wide = GemmTiles { bn2: 256, ..t };
            assert!(wide.partial_gemm2(&s) && wide.check(&s, arch).is_ok(), "{f} {arch}: 11 x 256 + 64");
        }
        // 16-bit weights on mma.sync, and decoded weights on the warp-specialised pipeline.
        let s = spec(2880, 2880, 32, 4, WeightFormat::Bf16);
        let t = GemmTiles { bm: 128, bn1: 128, bn2: 128, mma: Mma::MmaSync, ..GemmTiles::for_spec(&s, Arch::Sm100a) };
        assert!(!t.partial_gemm2(&s) && t.check(&s, arch).is_err(), "{arch}: {t:?}");
    }
    let s = spec(2880, 2880, 32, 4, WeightFormat::Mxfp4);
    let ws = crate::heuristics::large_step_tiles(&s, Arch::Sm90a).unwrap();
    assert!(ws.warp_specialized);
    let t = GemmTiles { bn2: 128, ..ws };
    assert!(!t.partial_gemm2(&s) && t.check(&s, Arch::Sm90a).is_err(), "{t:?}");
}

#[test]
fn warp_specialised_pipeline_is_sm90a_wgmma_only() {
    let s = spec(2048, 768, 128, 8, WeightFormat::Bf16);
    let ws = GemmTiles::for_spec(&s, Arch::Sm90a);
    assert!(ws.warp_specialized && ws.gemm_threads() == 384);
    let k = render_grouped(&s, Arch::Sm90a, ws).unwrap();
    assert!(k.source.contains("#define MOE_WS 1") && k.source.contains("cp.async.bulk.tensor.2d"));
    assert!(k.name.ends_with("_wst16"), "{}", k.name);
    let plain = ws.parse("256,256,4,1,0").unwrap();
    assert!(!plain.warp_specialized && plain.gemm_threads() == 256);
    let k = render_grouped(&s, Arch::Sm90a, plain).unwrap();
    assert!(k.source.contains("#define MOE_WS 0") && !k.source.contains("cp.async.bulk.tensor"));
    assert_eq!(ws.parse("256,256,4,1"), Some(ws));
    assert_eq!(ws.parse("256,256,4,1,2"), None);
    assert_eq!(plain.cluster, 1, "the block-barrier pipeline has no clusters");
    assert_eq!(ws.parse("256,256,4,1,1,1").map(|t| t.cluster), Some(1));
    let on_120 = GemmTiles { warp_specialized: true, ..GemmTiles::for_spec(&s, Arch::Sm120a) };
    assert!(render_grouped(&s, Arch::Sm120a, on_120).is_err());
    let two_blocks = GemmTiles { blocks_per_sm: 2, ..ws };
    assert!(render_grouped(&s, Arch::Sm90a, two_blocks).is_err());
    // The barriers and item slots sit past the stages.
    assert_eq!(ws.gemm2_smem_bytes(&s), 4 * (128 + 256) * 128 + 1024 + 176 + 2 * 256 * 4 + 8 * 2048);
    // GEMM1's stages also carry the extended rows, and the tail epilogue its exchange.
    assert_eq!(
        ws.gemm1_smem_bytes(&s),
        4 * (128 + 16 + 256) * 128 + 1024 + 176 + 2 * 256 * 4 + 8 * 2048 + 16 * 128 * 2
    );
}

#[test]
fn clusters_multicast_the_weight_tile_on_the_warp_specialised_pipeline_only() {
    let s = spec(2048, 768, 128, 8, WeightFormat::Bf16);
    let ws = GemmTiles { cluster: 2, ..GemmTiles::for_spec(&s, Arch::Sm90a) };
    let k = render_grouped(&s, Arch::Sm90a, ws).unwrap();
    assert!(k.source.contains("constexpr int CLUSTER = 2;") && k.source.contains(".multicast::cluster"));
    assert!(k.name.ends_with("_wsc2"), "{}", k.name);
    let single = GemmTiles { cluster: 1, ..ws };
    let k1 = render_grouped(&s, Arch::Sm90a, single).unwrap();
    assert!(k1.source.contains("constexpr int CLUSTER = 1;") && k1.name != k.name);
    for bad in [
        GemmTiles { cluster: 3, ..ws },
        GemmTiles { cluster: 0, ..ws },
        GemmTiles { cluster: 2, ..ws.parse("256,256,4,1,0").unwrap() },
    ] {
        assert!(matches!(render_grouped(&s, Arch::Sm90a, bad), Err(CodegenError::Unsupported { .. })), "{bad:?}");
    }
    assert!(GemmTiles::for_spec(&s, Arch::Sm100a).cluster == 1 && GemmTiles::for_spec(&s, Arch::Sm120a).cluster == 1);
    assert_eq!(GemmTiles::for_spec(&s, Arch::Sm90a).cluster, 1, "off for short items");
    // Mixtral-8x7B: 32 or more k-tiles per item in both GEMMs, even column blocks.
    for f in [WeightFormat::Bf16, WeightFormat::Fp8E4m3] {
        let m = spec(4096, 14336, 8, 2, f);
        assert_eq!(GemmTiles::for_spec(&m, Arch::Sm90a).cluster, 2, "{f}");
        assert_eq!(GemmTiles::for_spec(&m, Arch::Sm120a).cluster, 1, "{f}");
        assert!(render_grouped(&m, Arch::Sm90a, GemmTiles::for_spec(&m, Arch::Sm90a)).is_ok());
    }
    // gpt-oss-20b: long items, and 240-column tiles give even column blocks (24 and 12).
    assert_eq!(GemmTiles::for_spec(&spec(2880, 2880, 32, 4, WeightFormat::Bf16), Arch::Sm90a).cluster, 2);
}

#[test]
fn a_warpgroup_lag_is_a_template_constant_of_the_warp_specialised_pipeline() {
    let s = spec(2048, 768, 128, 8, WeightFormat::Fp8E4m3);
    let ws = GemmTiles::for_spec(&s, Arch::Sm90a);
    assert_eq!(ws.lag, 0);
    let lagged = ws.parse("256,256,4,1,1,1,2").unwrap();
    assert_eq!((lagged.cluster, lagged.lag), (1, 2));
    let k = render_grouped(&s, Arch::Sm90a, lagged).unwrap();
    assert!(k.source.contains("constexpr int WG_LAG = 2;") && k.name.ends_with("_wsl2"), "{}", k.name);
    assert_ne!(k.name, render_grouped(&s, Arch::Sm90a, ws).unwrap().name, "part of the cache key");
    // At most stages - 2 (the first stage warpgroup 0 waits for must be free), and only
    // where there are warpgroups.
    for bad in [GemmTiles { lag: 3, ..ws }, GemmTiles { lag: 1, ..ws.parse("128,128,4,1,0").unwrap() }] {
        assert!(matches!(render_grouped(&s, Arch::Sm90a, bad), Err(CodegenError::Unsupported { .. })), "{bad:?}");
    }
    assert_eq!(ws.parse("256,256,4,1,0").map(|t| t.lag), Some(0));
}

#[test]
fn short_last_tiles_extend_gemm1_items_where_the_scales_hold_along_k() {
    for f in [WeightFormat::Bf16, WeightFormat::Fp8E4m3] {
        let s = spec(2048, 768, 128, 8, f);
        let default = GemmTiles::for_spec(&s, Arch::Sm90a);
        // On by default for 16-bit weights; per-channel fp8 takes them as an option.
        assert_eq!(default.tail, if f == WeightFormat::Bf16 { 16 } else { 0 }, "{f}");
        let t = GemmTiles { tail: 16, ..default };
        let k = render_grouped(&s, Arch::Sm90a, t).unwrap();
        assert!(k.source.contains("constexpr int TAIL = 16;") && k.name.ends_with("t16"), "{}", k.name);
        let off = render_grouped(&s, Arch::Sm90a, GemmTiles { tail: 0, ..t }).unwrap();
        assert!(off.source.contains("constexpr int TAIL = 0;") && off.name != k.name, "part of the cache key");
        assert_eq!(t.parse("256,256,4,1,1,1,0,0").map(|t| t.tail), Some(0));
        assert_eq!(GemmTiles { tail: 0, ..t }.parse("256,256,4,1,1,1,0,16"), Some(t));
        assert_eq!(GemmTiles::for_spec(&s, Arch::Sm120a).extended_rows(&s), 0, "{f}: mma.sync tiles");
        // GEMM2 extends them only where the producer decodes its weights.
        assert_eq!(t.gemm2_extended_rows(&s), 0, "{f}");
        assert!(k.source.contains("constexpr int TAIL2 = 0;"));
    }
    // Off where the scales change along K, in clusters (Mixtral-8x7B), on 128-wide tiles and
    // on the block-barrier pipeline.
    let b = spec(2048, 768, 128, 8, WeightFormat::Fp8E4m3B128);
    let tb = GemmTiles::for_spec(&b, Arch::Sm90a);
    let m = spec(4096, 14336, 8, 2, WeightFormat::Bf16);
    let s = spec(2048, 768, 128, 8, WeightFormat::Bf16);
    let t = GemmTiles::for_spec(&s, Arch::Sm90a);
    for (spec, off) in [
        (b, tb),
        (m, GemmTiles::for_spec(&m, Arch::Sm90a)),
        (s, GemmTiles { cluster: 2, ..t }),
        (s, GemmTiles { bn1: 128, ..t }),
        (s, GemmTiles { warp_specialized: false, ..t }),
    ] {
        assert_eq!(off.extended_rows(&spec), 0, "{off:?}");
        let k = render_grouped(&spec, Arch::Sm90a, off).unwrap();
        assert!(k.source.contains("constexpr int TAIL = 0;") && !k.name.contains("t16"), "{}", k.name);
    }
    assert_eq!(tb.gemm1_smem_bytes(&b), tb.smem_bytes(tb.bn1, 0));
    for bad in [GemmTiles { tail: 8, ..t }, GemmTiles { tail: 32, ..t }] {
        let err = render_grouped(&s, Arch::Sm90a, bad).unwrap_err();
        assert!(err.to_string().contains("extended items"), "{bad:?}: {err}");
    }
}

#[test]
fn router_is_baked_in() {
    let s = spec(2048, 768, 256, 8, WeightFormat::Bf16)
        .with_router(Router::GroupLimited(GroupLimited::new(8, 4, true, 2.5)))
        .unwrap();
    let k = render_grouped(&s, Arch::Sm90a, GemmTiles::for_spec(&s, Arch::Sm90a)).unwrap();
    assert!(k.source.contains("constexpr int GROUPS = 8;"));
    assert!(k.source.contains("constexpr float SCALING = 2.5f;"));
    assert!(k.name.contains("grouped8x4s2.5"));
}

#[test]
fn clusters_need_an_even_number_of_column_blocks() {
    let s = spec(2048, 768, 128, 8, WeightFormat::Bf16);
    let t = GemmTiles { cluster: 2, ..GemmTiles::for_spec(&s, Arch::Sm90a) };
    assert!(render_grouped(&s, Arch::Sm90a, t).is_ok());
    // 640 / 128 = 5 column blocks in GEMM1.
    let odd = spec(2048, 640, 128, 8, WeightFormat::Bf16);
    let err = render_grouped(&odd, Arch::Sm90a, t).unwrap_err().to_string();
    assert!(err.contains("column blocks"), "{err}");
}

#[test]
fn max_tiles_bounds_every_histogram() {
    let t = GemmTiles::for_spec(&spec(2048, 768, 128, 8, WeightFormat::Bf16), Arch::Sm90a);
    for cluster in [1u32, 2] {
        let t = GemmTiles { cluster, ..t };
        let tiles = |c: usize| c.div_ceil(128);
        for pairs in [1usize, 8, 127, 128, 129, 255, 257, 1000, 32768] {
            // Worst case: one pair on each of min(E, pairs) - 1 experts, the rest on one.
            let e = 128usize.min(pairs);
            let worst = (e - 1) * tiles(1) + tiles(pairs - (e - 1));
            assert!(t.max_tiles(pairs, 128) >= worst, "cluster {cluster} pairs {pairs}");
        }
    }
}
