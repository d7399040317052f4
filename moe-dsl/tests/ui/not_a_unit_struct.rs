use moeforge::moe_kernel;

#[moe_kernel(hidden = 2048, intermediate = 768, experts = 128, top_k = 8)]
pub struct Layer {
    weights: Vec<u8>,
}

#[moe_kernel(hidden = 2048, intermediate = 768, experts = 128, top_k = 8)]
pub fn layer() {}

fn main() {}
