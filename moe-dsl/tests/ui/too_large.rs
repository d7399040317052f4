use moeforge::moe_kernel;

#[moe_kernel(hidden = 2048, intermediate = 768, experts = 2048, top_k = 8)]
pub struct Layer;

fn main() {}
