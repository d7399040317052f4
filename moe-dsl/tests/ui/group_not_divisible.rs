use moeforge::moe_kernel;

// gpt-oss-20b's 2880 holds groups of 32 and 64 along K, not of 128.
#[moe_kernel(hidden = 2880, intermediate = 2880, experts = 32, top_k = 4, format = int4_g128)]
pub struct GptOssG128;

// 128x128 blocks also run down w13's gate and up halves: intermediate must be a multiple of 128.
#[moe_kernel(hidden = 2048, intermediate = 1056, experts = 64, top_k = 8, format = fp8_e4m3_b128)]
pub struct Blocks;

fn main() {}
