use moeforge::moe_kernel;

#[moe_kernel(
    hidden = bf16,
    intermediate = 768.0,
    experts = -1,
    top_k = 8u8,
    format = [bf16],
    activation = "silu",
    archs = sm_90a,
    families = [warp_decode, 2],
)]
pub struct Layer;

fn main() {}
