use moeforge::moe_kernel;

#[moe_kernel(hidden = 2056, intermediate = 1024, experts = 64, top_k = 8, format = fp8_e4m3)]
pub struct Layer;

fn main() {}
