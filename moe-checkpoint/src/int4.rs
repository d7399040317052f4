//! GPTQ and AWQ int4 projections repacked into moeforge's INT4 layouts, exactly: the same codes,
//! the same f16 scales, the same zero points, moved (never requantized).
//!
//! Both store `W [N, K]` (N outputs, K inputs) as int32 words of eight 4-bit codes, with f16
//! `scales [K/G, N]` and packed `qzeros [K/G, N/8]`, and compute `w = (q - z) * s`. They differ in
//! the packing (AutoGPTQ's `QuantLinear.pack`, AutoAWQ's `WQLinear_GEMM.from_linear`, vLLM's
//! loaders read them the same way):
//!
//! - GPTQ: `qweight [K/8, N]` packs along K: code `k` of output `n` is bits `4 (k % 8)` of
//!   `qweight[k / 8][n]`; `qzeros` packs along N the same way. The v1 format (AutoGPTQ, the
//!   default `checkpoint_format: gptq`) stores each zero point minus 1 (`zeros -= 1` when packing,
//!   `zeros + 1` when unpacking); `gptq_v2` stores it as is. `g_idx [K]` maps input channels to
//!   groups: `k / G` without act-order.
//! - AWQ (GEMM): `qweight [K, N/8]` packs along N in the order `[0, 2, 4, 6, 1, 3, 5, 7]`: bits
//!   `4 i` of a word hold output `8 (n / 8) + ORDER[i]`, so output `n` sits at nibble
//!   `REVERSE[n % 8]` with `REVERSE = [0, 4, 1, 5, 2, 6, 3, 7]`; `qzeros` likewise; no offset.
//!
//! moeforge packs along K, element `2j` in the low nibble of byte `j` of the row: a GPTQ word's
//! little-endian bytes are exactly eight consecutive codes of one row, so GPTQ is a transpose of
//! words; AWQ is regathered nibble by nibble.

use crate::error::{CheckpointError, Result};
use crate::proj::Proj;
use crate::store::{Store, Tensor};
use safetensors::Dtype;

/// Where output `n % 8` sits in an AWQ word (AutoAWQ's `AWQ_REVERSE_ORDER`).
const AWQ_REVERSE: [usize; 8] = [0, 4, 1, 5, 2, 6, 3, 7];

const WORDS: &[Dtype] = &[Dtype::I32, Dtype::U32];

/// A GPTQ projection.
pub(crate) fn gptq(
    store: &Store,
    prefix: &str,
    n: usize,
    k: usize,
    group: Option<u32>,
    sym: bool,
    v2: bool,
) -> Result<Proj> {
    let g = group.map_or(k, |g| g as usize);
    let ng = k / g;
    let qw_name = format!("{prefix}.qweight");
    let (qw, _) = store.get(&qw_name, WORDS, &[k / 8, n])?;
    let qz_name = format!("{prefix}.qzeros");
    let (qz, _) = store.get(&qz_name, WORDS, &[ng, n / 8])?;
    let s_name = format!("{prefix}.scales");
    let (sc, _) = store.get(&s_name, &[Dtype::F16], &[ng, n])?;
    let gi_name = format!("{prefix}.g_idx");
    if store.contains(&gi_name)? {
        check_g_idx(store, &gi_name, k, g)?;
    }
    // The transpose of words: row n's bytes 4w..4w+4 are qweight[w][n]'s little-endian bytes.
    let row_bytes = k / 2;
    let mut data = vec![0u8; n * row_bytes];
    for w in 0..k / 8 {
        for (r, row) in data.chunks_exact_mut(row_bytes).enumerate() {
            row[4 * w..4 * w + 4].copy_from_slice(&qw.data[4 * (w * n + r)..4 * (w * n + r) + 4]);
        }
    }
    let offset = if v2 { 0 } else { 1 };
    let zero = |gi: usize, r: usize| ((qz.u32_at(gi * (n / 8) + r / 8) >> (4 * (r % 8))) & 15) + offset;
    let scales = pack_scales(&qz, n, ng, sym && group.is_none(), sym, |gi, r| sc.u16_at(gi * n + r), zero)?;
    Ok(Proj { data, scales })
}

/// An AWQ (GEMM) projection: always with zero points.
pub(crate) fn awq(store: &Store, prefix: &str, n: usize, k: usize, group: Option<u32>) -> Result<Proj> {
    let g = group.map_or(k, |g| g as usize);
    let ng = k / g;
    let qw_name = format!("{prefix}.qweight");
    let (qw, _) = store.get(&qw_name, WORDS, &[k, n / 8])?;
    let qz_name = format!("{prefix}.qzeros");
    let (qz, _) = store.get(&qz_name, WORDS, &[ng, n / 8])?;
    let s_name = format!("{prefix}.scales");
    let (sc, _) = store.get(&s_name, &[Dtype::F16], &[ng, n])?;
    let nibble =
        |t: &Tensor, row: usize, col: usize| (t.u32_at(row * (n / 8) + col / 8) >> (4 * AWQ_REVERSE[col % 8])) & 15;
    let row_bytes = k / 2;
    let mut data = vec![0u8; n * row_bytes];
    for kk in 0..k {
        let shift = 4 * (kk % 2);
        for (r, row) in data.chunks_exact_mut(row_bytes).enumerate() {
            row[kk / 2] |= (nibble(&qw, kk, r) as u8) << shift;
        }
    }
    let scales = pack_scales(&qz, n, ng, false, false, |gi, r| sc.u16_at(gi * n + r), |gi, r| nibble(&qz, gi, r))?;
    Ok(Proj { data, scales })
}

/// moeforge's scale bytes for `[n, ng]` groups: symmetric (`Int4G*`: f16 per group, or with
/// `per_row_f32` the per-row `Int4`'s f32), every zero point checked to be 8; else `Int4Asym*`
/// records (f16 scale in bits 0-15, zero point in bits 16-23).
fn pack_scales(
    qzeros: &Tensor,
    n: usize,
    ng: usize,
    per_row_f32: bool,
    sym: bool,
    scale: impl Fn(usize, usize) -> u16,
    zero: impl Fn(usize, usize) -> u32,
) -> Result<Vec<u8>> {
    let mut out = Vec::with_capacity(n * ng * 4);
    for r in 0..n {
        for gi in 0..ng {
            let (s, z) = (scale(gi, r), zero(gi, r));
            if sym {
                if z != 8 {
                    return Err(CheckpointError::Value {
                        tensor: qzeros.name.to_string(),
                        why: format!(
                            "the config says sym, but output {r}, group {gi} has zero point {z} (a symmetric \
                             checkpoint has 8 everywhere)"
                        ),
                    });
                }
                if per_row_f32 {
                    // Int4: one f32 per row; the f16 widens exactly.
                    out.extend_from_slice(&half::f16::from_bits(s).to_f32().to_le_bytes());
                } else {
                    out.extend_from_slice(&s.to_le_bytes());
                }
            } else {
                if z > 15 {
                    // GPTQ v1 stores zero 0 as 0 - 1 = 0xF, read back as 16: moeforge's zero
                    // points are 0..=15.
                    return Err(CheckpointError::Value {
                        tensor: qzeros.name.to_string(),
                        why: format!(
                            "output {r}, group {gi}: zero point {z} (GPTQ v1's stored 15 + 1) is outside moeforge's \
                             0..=15"
                        ),
                    });
                }
                out.extend_from_slice(&(s as u32 | z << 16).to_le_bytes());
            }
        }
    }
    Ok(out)
}

/// `g_idx[k]` must be `k / g` (no act-order permutation).
fn check_g_idx(store: &Store, name: &str, k: usize, g: usize) -> Result<()> {
    let (t, _) = store.get(name, &[Dtype::I32, Dtype::I64], &[k])?;
    let w = t.data.len() / k;
    for kk in 0..k {
        let b = &t.data[w * kk..w * kk + w];
        let got = if w == 4 {
            i32::from_le_bytes(b.try_into().expect("4 bytes")) as i64
        } else {
            i64::from_le_bytes(b.try_into().expect("8 bytes"))
        };
        if got != (kk / g) as i64 {
            return Err(CheckpointError::ActOrder { tensor: name.to_string(), k: kk, got, expected: kk / g });
        }
    }
    Ok(())
}
