//! Scalar codecs of the small number formats: FP8 e4m3 (`e4m3fn`), FP4 e2m1, the E8M0 shared
//! exponent of the OCP MX formats, and the integer helpers the quantizers share. Every decoder is
//! exact (each code is a value f32 holds exactly); every encoder rounds to nearest, ties to even,
//! and saturates at the format's largest finite magnitude.

/// Largest finite e4m3fn value.
pub const E4M3_MAX: f32 = 448.0;
/// Largest e2m1 value.
pub const E2M1_MAX: f32 = 6.0;
/// `floor(log2(max))` of the MX element types: the OCP MX shared exponent is
/// `floor(log2(amax)) - emax`, so the block maximum lands in `[2^emax, 2^(emax+1))`.
pub const E4M3_EMAX: i32 = 8;
/// `floor(log2(max))` of e2m1 (largest value 6), the `emax` of MXFP4's shared exponent.
pub const E2M1_EMAX: i32 = 2;

/// Decode one e4m3fn byte (bias 7, no infinities, 0x7f/0xff are NaN).
pub fn e4m3_to_f32(b: u8) -> f32 {
    let sign = if b & 0x80 != 0 { -1.0 } else { 1.0 };
    let e = ((b >> 3) & 0xf) as i32;
    let m = (b & 7) as f32;
    if e == 15 && b & 7 == 7 {
        return f32::NAN;
    }
    let mag = if e == 0 { m / 8.0 * 2f32.powi(-6) } else { (1.0 + m / 8.0) * 2f32.powi(e - 7) };
    sign * mag
}

/// Encode to e4m3fn: round to nearest, ties to even, saturating at ±448.
pub fn e4m3_from_f32(v: f32) -> u8 {
    if v.is_nan() {
        return 0x7f;
    }
    let sign = if v.is_sign_negative() { 0x80u8 } else { 0 };
    let a = v.abs();
    if a >= E4M3_MAX {
        return sign | 0x7e;
    }
    if a < 2f32.powi(-6) {
        // Subnormal codes step by 2^-9; code 8 is the smallest normal, 2^-6.
        return sign | (a * 512.0).round_ties_even() as u8;
    }
    // Normal: round the f32 mantissa to 3 bits, ties to even; a carry bumps the exponent.
    let bits = a.to_bits();
    let e = (bits >> 23) as i32 - 127 + 7;
    let m = bits & 0x7f_ffff;
    let q = (m + 0x7_ffff + ((m >> 20) & 1)) >> 20;
    sign | ((e as u32) << 3).wrapping_add(q) as u8
}

/// [`e4m3_from_f32`] by search over the decoded codes (the tests' oracle).
pub fn e4m3_from_f32_search(v: f32) -> u8 {
    if v.is_nan() {
        return 0x7f;
    }
    static VALUES: std::sync::OnceLock<[f32; 0x7f]> = std::sync::OnceLock::new();
    let values = VALUES.get_or_init(|| std::array::from_fn(|c| e4m3_to_f32(c as u8)));
    let sign = if v.is_sign_negative() { 0x80u8 } else { 0 };
    sign | nearest_code(v.abs(), values)
}

/// The eight e2m1 magnitudes, by the low three bits of the code (`e e m`).
pub const E2M1_VALUES: [f32; 8] = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0];

/// Decode one e2m1 nibble (bit 3 the sign; bias 1; `0b?001` is the subnormal 0.5).
pub fn e2m1_to_f32(n: u8) -> f32 {
    let mag = E2M1_VALUES[(n & 7) as usize];
    if n & 8 != 0 {
        -mag
    } else {
        mag
    }
}

/// Encode to e2m1 (a nibble): round to nearest, ties to even, saturating at ±6.
pub fn e2m1_from_f32(v: f32) -> u8 {
    let sign = if v.is_sign_negative() { 8u8 } else { 0 };
    let a = v.abs();
    // Midpoints between neighbours; ties go to the even code.
    let code = if a <= 0.25 {
        0
    } else if a < 0.75 {
        1
    } else if a <= 1.25 {
        2
    } else if a < 1.75 {
        3
    } else if a <= 2.5 {
        4
    } else if a < 3.5 {
        5
    } else if a <= 5.0 {
        6
    } else {
        7
    };
    sign | code
}

/// The code (index into the increasing `values`) nearest to `a >= 0`; ties go to the even code
/// (an even mantissa), values past the top saturate.
fn nearest_code(a: f32, values: &[f32]) -> u8 {
    let top = values.len() - 1;
    if a >= values[top] {
        return top as u8;
    }
    // The first value above `a`, and the one below it.
    let hi = values.partition_point(|&v| v <= a);
    let lo = hi - 1;
    let (dl, dh) = (a - values[lo], values[hi] - a);
    if dl < dh || (dl == dh && lo & 1 == 0) {
        lo as u8
    } else {
        hi as u8
    }
}

/// Decode an E8M0 scale: `2^(e - 127)`; 0 is 2^-127 (an f32 subnormal), 0xff is NaN.
pub fn e8m0_to_f32(e: u8) -> f32 {
    match e {
        0 => f32::from_bits(0x0040_0000),
        0xff => f32::NAN,
        _ => f32::from_bits((e as u32) << 23),
    }
}

/// `floor(log2(a))` of a finite `a > 0`, exact (subnormals included).
pub fn floor_log2(a: f32) -> i32 {
    let bits = a.to_bits() & 0x7fff_ffff;
    debug_assert!(bits != 0 && bits < 0x7f80_0000, "floor_log2 of {a}");
    let e = (bits >> 23) as i32;
    if e == 0 {
        // Subnormal: 2^-149 times the mantissa.
        -149 + (31 - bits.leading_zeros() as i32)
    } else {
        e - 127
    }
}

/// The OCP MX shared exponent of a block with maximum magnitude `amax` for an element type whose
/// largest value has exponent `emax`: `floor(log2(amax)) - emax`, clamped to E8M0's `[-127, 127]`;
/// an all-zero block gets 2^0. Returned as the E8M0 code (never 0xff).
pub fn e8m0_for_amax(amax: f32, emax: i32) -> u8 {
    if amax == 0.0 {
        return 127;
    }
    ((floor_log2(amax) - emax).clamp(-127, 127) + 127) as u8
}

/// Round to the nearest integer, ties to even (the rounding of every integer quantizer here).
/// Adding and subtracting 1.5 * 2^23 rounds in the FPU's default mode, without a libm call.
pub fn rne(v: f32) -> f32 {
    const C: f32 = 12_582_912.0;
    if v.abs() < 4_194_304.0 {
        (v + C) - C
    } else {
        v.round_ties_even()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn e4m3_roundtrips_every_finite_code() {
        for b in 0u8..=255 {
            let v = e4m3_to_f32(b);
            if v.is_nan() {
                assert!(b & 0x7f == 0x7f);
                continue;
            }
            // +0 and -0 both round-trip to themselves.
            assert_eq!(e4m3_from_f32(v), b, "code {b:#x} value {v}");
        }
        assert_eq!(e4m3_to_f32(0x7e), 448.0);
        assert_eq!(e4m3_to_f32(0x01), 2f32.powi(-9));
    }

    #[test]
    fn e4m3_rounds_to_nearest_even_and_saturates() {
        // 1.0 = 0x38, next is 1.125 = 0x39; 1.0625 is a tie -> even (0x38).
        assert_eq!(e4m3_from_f32(1.0625), 0x38);
        assert_eq!(e4m3_from_f32(1.07), 0x39);
        assert_eq!(e4m3_from_f32(1e6), 0x7e);
        assert_eq!(e4m3_from_f32(-1e6), 0xfe);
        assert_eq!(e4m3_from_f32(f32::MAX), 0x7e);
        // Below half the smallest subnormal: zero.
        assert_eq!(e4m3_from_f32(2f32.powi(-11)), 0);
    }

    #[test]
    fn e4m3_bit_rounding_agrees_with_search() {
        let mut x = 0x1234_5678u32;
        for i in 0..200_000u32 {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            // Every binade from 2^-12 to 2^10, plus exact midpoints between codes.
            let v = if i % 4 == 0 {
                let c = (x % 0x7e) as u8;
                (e4m3_to_f32(c) + e4m3_to_f32(c + 1)) / 2.0
            } else {
                f32::from_bits((x & 0x807f_ffff) | ((115 + (x >> 8) % 22) << 23))
            };
            assert_eq!(e4m3_from_f32(v), e4m3_from_f32_search(v), "{v:e}");
        }
    }

    #[test]
    fn e2m1_roundtrips_and_rounds_to_even() {
        for n in 0u8..16 {
            assert_eq!(e2m1_from_f32(e2m1_to_f32(n)), n, "nibble {n}");
        }
        assert_eq!(e2m1_from_f32(0.25), 0); // tie 0 / 0.5 -> even code 0
        assert_eq!(e2m1_from_f32(0.26), 1);
        assert_eq!(e2m1_from_f32(2.5), 4); // tie 2 / 3 -> code 4 (2.0)
        assert_eq!(e2m1_from_f32(5.0), 6); // tie 4 / 6 -> code 6 (4.0)
        assert_eq!(e2m1_from_f32(-100.0), 0xf);
        assert_eq!(e2m1_to_f32(0xf), -6.0);
    }

    #[test]
    fn e2m1_and_rne_agree_with_their_definitions() {
        for i in 0..=1400 {
            let a = i as f32 / 200.0;
            assert_eq!(e2m1_from_f32(a), nearest_code(a, &E2M1_VALUES), "{a}");
            assert_eq!(e2m1_from_f32(-a), 8 | nearest_code(a, &E2M1_VALUES), "-{a}");
            let v = (i as f32 - 700.0) / 4.0;
            assert_eq!(rne(v), v.round_ties_even(), "{v}");
        }
        assert_eq!(rne(-0.5), 0.0);
        assert_eq!(rne(2.5), 2.0);
        assert_eq!(rne(1e9 + 0.5), 1e9);
    }

    #[test]
    fn e8m0_and_floor_log2() {
        assert_eq!(e8m0_to_f32(127), 1.0);
        assert_eq!(e8m0_to_f32(0), 2f32.powi(-127));
        assert_eq!(e8m0_to_f32(254), 2f32.powi(127));
        assert!(e8m0_to_f32(255).is_nan());
        assert_eq!(floor_log2(1.0), 0);
        assert_eq!(floor_log2(1.99), 0);
        assert_eq!(floor_log2(0.5), -1);
        assert_eq!(floor_log2(f32::MAX), 127);
        assert_eq!(floor_log2(f32::from_bits(1)), -149);
        assert_eq!(floor_log2(f32::MIN_POSITIVE), -126);
        assert_eq!(e8m0_for_amax(448.0, E4M3_EMAX), 127);
        assert_eq!(e8m0_for_amax(6.0, E2M1_EMAX), 127);
        assert_eq!(e8m0_for_amax(0.0, E2M1_EMAX), 127);
        assert_eq!(e8m0_for_amax(f32::from_bits(1), E4M3_EMAX), 0);
        assert_eq!(e8m0_for_amax(f32::MAX, E2M1_EMAX), 127 + 125);
    }
}
