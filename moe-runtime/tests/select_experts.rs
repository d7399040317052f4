//! `HostWeights::select_experts`, what each rank of an expert-parallel layer loads: for every
//! format, the selected layer's expert i dequantizes to exactly the whole layer's expert
//! `experts[i]`, row by row (NVFP4's per-tensor global scales included), biases follow, and bad
//! selections are typed errors.

use moe_codegen::{MoeSpec, WeightFormat};
use moe_runtime::testing::random_weights;
use moe_runtime::RuntimeError;

#[test]
fn selected_experts_dequantize_to_the_originals_in_every_format() {
    let (h, i, e) = (256u32, 128u32, 6u32);
    let pick = [4u32, 1, 5];
    let mut formats = 0;
    for f in WeightFormat::ALL {
        let Ok(spec) = MoeSpec::builder(h, i, e, 2).weight_format(f).build() else { continue };
        let w = random_weights(&spec, 11);
        let local = MoeSpec::builder(h, i, pick.len() as u32, 2).weight_format(f).build().unwrap();
        let sel = w.select_experts(&spec, &pick).unwrap();
        formats += 1;
        sel.validate(&local).unwrap_or_else(|err| panic!("{f}: {err}"));
        for (li, &ge) in pick.iter().enumerate() {
            for r in [0, 1, i as usize, 2 * i as usize - 1] {
                assert_eq!(sel.w13_row(&local, li, r), w.w13_row(&spec, ge as usize, r), "{f} w13 e{ge} r{r}");
            }
            for r in [0, h as usize / 2, h as usize - 1] {
                assert_eq!(sel.w2_row(&local, li, r), w.w2_row(&spec, ge as usize, r), "{f} w2 e{ge} r{r}");
            }
        }
    }
    assert_eq!(formats, WeightFormat::ALL.len(), "every format takes this geometry");
}

#[test]
fn biases_follow_their_experts_and_bad_selections_are_refused() {
    let spec = MoeSpec::builder(64, 32, 4, 2).bias(true).build().unwrap();
    let (h, i) = (64usize, 32usize);
    let w = random_weights(&MoeSpec::builder(64, 32, 4, 2).build().unwrap(), 3)
        .with_bias((0..4 * 2 * i).map(|v| v as f32).collect(), (0..4 * h).map(|v| v as f32).collect());
    let sel = w.select_experts(&spec, &[3, 0]).unwrap();
    assert_eq!(sel.w13_bias[0], (3 * 2 * i) as f32);
    assert_eq!(sel.w13_bias[2 * i], 0.0);
    assert_eq!(sel.w2_bias[h - 1], (3 * h + h - 1) as f32);
    assert!(matches!(w.select_experts(&spec, &[4]), Err(RuntimeError::ExpertIdOutOfRange { first_id: 4, .. })));
    let shared = MoeSpec::builder(64, 32, 4, 2).build().unwrap().with_shared_experts(1, false).unwrap();
    let ws = random_weights(&shared, 1);
    assert!(matches!(ws.select_experts(&shared, &[4]), Err(RuntimeError::ExpertIdOutOfRange { first_id: 4, .. })));
}

#[test]
fn shared_experts_follow_the_selected_ones() {
    for gated in [false, true] {
        let whole = MoeSpec::builder(64, 32, 4, 2).build().unwrap().with_shared_experts(2, gated).unwrap();
        let local = MoeSpec::builder(64, 32, 2, 2).build().unwrap().with_shared_experts(2, gated).unwrap();
        let w = random_weights(&whole, 5);
        let sel = w.select_experts(&whole, &[3, 1]).unwrap();
        sel.validate(&local).unwrap();
        assert_eq!(sel.shared_gate, w.shared_gate);
        // Local experts 0, 1 are routed 3, 1; 2 and 3 the shared ones (4 and 5 of the whole layer).
        for (li, ge) in [(0, 3), (1, 1), (2, 4), (3, 5)] {
            for r in [0, 31, 63] {
                assert_eq!(sel.w13_row(&local, li, r), w.w13_row(&whole, ge, r), "gated {gated} w13 e{ge} r{r}");
            }
            assert_eq!(sel.w2_row(&local, li, 17), w.w2_row(&whole, ge, 17), "gated {gated} w2 e{ge}");
        }
    }
}
