use moeforge::moe_kernel;

#[moe_kernel(hidden = 2048, intermediate = 0, experts = 128, top_k = 8)]
pub struct Layer;

fn main() {}
