use moeforge::moe_kernel;

#[moe_kernel(hidden = 4096, intermediate = 14336, experts = 8, top_k = 9)]
pub struct Layer;

fn main() {}
