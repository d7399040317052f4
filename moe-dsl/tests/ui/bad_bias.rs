use moeforge::moe_kernel;

#[moe_kernel(hidden = 2048, intermediate = 768, experts = 128, top_k = 8, bias = yes)]
pub struct Layer;

fn main() {}
