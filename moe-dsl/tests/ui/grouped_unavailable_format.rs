use moeforge::moe_kernel;

// The lut dequant variant has warp decode only: the error points at `grouped_gemm`, names no arch,
// and says why.
#[moe_kernel(hidden = 2048, intermediate = 768, experts = 128, top_k = 8, format = int4, dequant = lut,
             families = [warp_decode, grouped_gemm])]
pub struct Qwen3Int4Lut;

fn main() {}
