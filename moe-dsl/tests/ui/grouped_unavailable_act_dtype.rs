use moeforge::moe_kernel;

// bf16 weights with fp16 activations: the grouped GEMMs take one 16-bit type.
#[moe_kernel(hidden = 2048, intermediate = 768, experts = 128, top_k = 8, format = bf16, act_dtype = fp16,
             families = [grouped_gemm])]
pub struct Mixed;

fn main() {}
