use moeforge::moe_kernel;

#[moe_kernel(hidden = 2048, intermediate = 768, experts = 128, top_k = 8, router = group_limited, router_groups = 7, router_topk_groups = 4)]
pub struct Groups;

#[moe_kernel(hidden = 2048, intermediate = 768, experts = 128, top_k = 8, router = group_limited, router_groups = 8)]
pub struct MissingTopkGroups;

#[moe_kernel(hidden = 2048, intermediate = 768, experts = 128, top_k = 8, router_scaling = 2.5)]
pub struct ScalingAlone;

fn main() {}
