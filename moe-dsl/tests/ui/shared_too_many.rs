use moeforge::moe_kernel;

#[moe_kernel(hidden = 2048, intermediate = 768, experts = 128, top_k = 30, shared_experts = 4)]
pub struct Layer;

fn main() {}
