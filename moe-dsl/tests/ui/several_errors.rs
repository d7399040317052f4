use moeforge::moe_kernel;

#[moe_kernel(hidden = 99999999999, intermediate = 768, experts = 128, top_k = 8, format = int3, activation = relu, typo = 1)]
pub struct Layer;

fn main() {}
