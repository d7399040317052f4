use moeforge::moe_kernel;

#[moe_kernel(hiden = 2048, intermediate = 768, experts = 128, top_k = 8)]
pub struct Layer;

fn main() {}
