use moeforge::moe_kernel;

// bf16 weights have one variant, `bits`; `dequant = table` is no variant at all.
#[moe_kernel(hidden = 2048, intermediate = 768, experts = 128, top_k = 8, format = bf16, dequant = lut)]
pub struct Qwen3Lut;

#[moe_kernel(hidden = 2048, intermediate = 768, experts = 128, top_k = 8, format = int4, dequant = table)]
pub struct Qwen3Table;

fn main() {}
