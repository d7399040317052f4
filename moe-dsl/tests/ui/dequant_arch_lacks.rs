use moeforge::moe_kernel;

// The hardware FP4 decode (cvt.rn.f16x2.e2m1x2) exists on sm_100a and sm_120a, not on sm_90a.
#[moe_kernel(
    hidden = 2880,
    intermediate = 2880,
    experts = 32,
    top_k = 4,
    format = mxfp4,
    dequant = hardware,
    archs = [sm_100a, sm_90a]
)]
pub struct GptOss;

fn main() {}
