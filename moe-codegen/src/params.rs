//! Kernel parameters, each kernel signature declared once. Every kernel takes one
//! `const __grid_constant__ <Name> p` argument; the declaration below is both the `#[repr(C)]`
//! struct the launcher fills and, through [`KernelParams::c_decl`], the C struct the renderer puts
//! into the module, with `static_assert`s on its size and on every field's size and alignment
//! (fields in the same order with the same sizes and alignments have the same offsets under both
//! languages' C layout rules, and NVRTC has no `offsetof`; so a layout that drifts fails to
//! compile, not to run) and a `MOE_UNPACK_<Name>(p)` macro that gives the kernel
//! body its arguments back as `__restrict__` locals of the same names.

use std::fmt::Write;

/// A kernel's parameter struct: its Rust layout is the one the C declaration asserts.
pub trait KernelParams: Copy + 'static {
    /// The C struct's name (the Rust type's).
    const C_NAME: &'static str;
    /// The C declaration: struct, layout asserts, unpack macro.
    fn c_decl() -> String;
}

/// A `CUtensorMap` (128 opaque bytes, 64-byte aligned) passed inside a parameter struct; the C
/// side's `TmaMap`.
#[repr(C, align(64))]
#[derive(Clone, Copy)]
pub struct TmaDesc(pub [u64; 16]);

impl TmaDesc {
    /// The all-zero map, for kernels built without TMA (the field is unused there).
    pub const UNUSED: TmaDesc = TmaDesc([0; 16]);
}

/// The dispatcher's cost planes as the device evaluates them: microseconds `c0 + cd * D + cp * P`
/// for D distinct experts and P valid pairs, `[c0, cd, cp]` per family; the C side's
/// `DispatchPlanes`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct DispatchPlanes {
    /// Warp decode.
    pub decode: [f32; 3],
    /// The grouped GEMMs.
    pub grouped: [f32; 3],
    /// The fused family (read where `fused_on`).
    pub fused: [f32; 3],
    /// Whether the fused family is a candidate (1) or not (0).
    pub fused_on: i32,
    /// Whether warp decode is a candidate (1) or not (0): where it is not, its kernels are not
    /// launched, so the device must not choose it.
    pub decode_on: i32,
}

impl std::fmt::Debug for TmaDesc {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("TmaDesc(..)")
    }
}

/// One field: its name, the type the kernel body sees (`__restrict__` pointers, `const T&` for a
/// field read in place), and the size and alignment of its Rust type.
struct Field {
    name: &'static str,
    local: &'static str,
    size: usize,
    align: usize,
}

fn c_decl(name: &str, size: usize, fields: &[Field]) -> String {
    let member = |local: &str| match local.strip_suffix('&') {
        Some(by_ref) => by_ref.trim_start_matches("const ").trim().to_string(),
        None => local.replace(" __restrict__", ""),
    };
    let mut s = format!("struct {name} {{\n");
    for f in fields {
        let _ = writeln!(s, "    {} {};", member(f.local), f.name);
    }
    let _ =
        writeln!(s, "}};\nstatic_assert(sizeof({name}) == {size}, \"{name}: the Rust layout (moe_codegen::params)\");");
    for f in fields {
        let _ = writeln!(
            s,
            "static_assert(sizeof({name}::{0}) == {1} && alignof(decltype({name}::{0})) == {2}, \"{name}::{0}\");",
            f.name, f.size, f.align
        );
    }
    let _ = write!(s, "#define MOE_UNPACK_{name}(p)");
    for f in fields {
        let _ = write!(s, " {} {} = p.{};", f.local, f.name, f.name);
    }
    s.push('\n');
    s
}

macro_rules! kernel_params {
    ($(
        $(#[$meta:meta])*
        $name:ident { $( $field:ident : $rty:ty = $local:literal ),* $(,)? }
    )*) => {$(
        $(#[$meta])*
        #[repr(C)]
        #[derive(Clone, Copy, Debug)]
        #[allow(missing_docs)] // the fields are the kernel's arguments, documented in its template
        pub struct $name { $( pub $field: $rty ),* }

        impl KernelParams for $name {
            const C_NAME: &'static str = stringify!($name);
            fn c_decl() -> String {
                c_decl(
                    stringify!($name),
                    std::mem::size_of::<$name>(),
                    &[$( Field {
                        name: stringify!($field),
                        local: $local,
                        size: std::mem::size_of::<$rty>(),
                        align: std::mem::align_of::<$rty>(),
                    } ),*],
                )
            }
        }
    )*};
}

// Device addresses are u64 on the Rust side; the C type says what the kernel reads there.
kernel_params! {
    /// `moe_route`: logits `[m, E]` (and the per-expert bias) to routing `[m, k]`.
    RouteParams {
        logits: u64 = "const float* __restrict__",
        bias: u64 = "const float* __restrict__",
        m: i32 = "int",
        topk_ids: u64 = "int* __restrict__",
        topk_weights: u64 = "float* __restrict__",
    }
    /// `moe_expand_routing`: the routed `[m, k]` routing widened with the shared experts' slots.
    ExpandParams {
        ids_in: u64 = "const int* __restrict__",
        weights_in: u64 = "const float* __restrict__",
        x: u64 = "const act_t* __restrict__",
        gate: u64 = "const float* __restrict__",
        dst_ids: u64 = "int* __restrict__",
        dst_weights: u64 = "float* __restrict__",
        m: i32 = "int",
        shared_on: i32 = "int",
    }
    /// `moe_ids_from_i64`: int64 routing ids narrowed to int32 (-1 out of range).
    IdsFromI64Params {
        src: u64 = "const long long* __restrict__",
        dst: u64 = "int* __restrict__",
        n: i32 = "int",
    }
    /// `moe_gate_up_t{1,2,4}`: x and the routing to the SwiGLU intermediate (warp decode).
    GateUpParams {
        x: u64 = "const act_t* __restrict__",
        topk_ids: u64 = "const int* __restrict__",
        w13: u64 = "const uint4* __restrict__",
        w13_scales: u64 = "const void* __restrict__",
        w13_bias: u64 = "const float* __restrict__",
        mid: u64 = "float* __restrict__",
        m: i32 = "int",
        err: u64 = "int* __restrict__",
        choice: u64 = "const int* __restrict__",
    }
    /// `moe_gate_up_bulk`: the one-token gate_up, which also prefetches w2 into L2.
    GateUpBulkParams {
        x: u64 = "const act_t* __restrict__",
        topk_ids: u64 = "const int* __restrict__",
        w13: u64 = "const uint4* __restrict__",
        w13_scales: u64 = "const void* __restrict__",
        w13_bias: u64 = "const float* __restrict__",
        w2: u64 = "const uint4* __restrict__",
        mid: u64 = "float* __restrict__",
        m: i32 = "int",
        err: u64 = "int* __restrict__",
    }
    /// `moe_decode_resident`: a one-token step in one cooperative launch (weights without group
    /// scales, each block's w2 rows in shared memory).
    ResidentParams {
        x: u64 = "const act_t* __restrict__",
        topk_ids: u64 = "const int* __restrict__",
        topk_weights: u64 = "const float* __restrict__",
        w13: u64 = "const uint4* __restrict__",
        w13_scales: u64 = "const void* __restrict__",
        w13_bias: u64 = "const float* __restrict__",
        w2: u64 = "const uint4* __restrict__",
        w2_scales: u64 = "const void* __restrict__",
        w2_bias: u64 = "const float* __restrict__",
        mid: u64 = "float* __restrict__",
        y: u64 = "act_t* __restrict__",
        sync: u64 = "unsigned* __restrict__",
        err: u64 = "int* __restrict__",
        choice: u64 = "const int* __restrict__",
        rows: i32 = "int",
    }
    /// `moe_down`, `moe_down_stash`, `moe_down_bulk`: the intermediate to y, routing weights folded in.
    DownParams {
        mid: u64 = "const float* __restrict__",
        topk_ids: u64 = "const int* __restrict__",
        topk_weights: u64 = "const float* __restrict__",
        w2: u64 = "const uint4* __restrict__",
        w2_scales: u64 = "const void* __restrict__",
        w2_bias: u64 = "const float* __restrict__",
        y: u64 = "act_t* __restrict__",
        m: i32 = "int",
        choice: u64 = "const int* __restrict__",
    }
    /// `moe_prepare`: route (from logits), align pairs into expert tiles, quantize x (fp8).
    PrepareParams {
        logits: u64 = "const float* __restrict__",
        bias: u64 = "const float* __restrict__",
        m: i32 = "int",
        topk_ids: u64 = "int* __restrict__",
        topk_weights: u64 = "float* __restrict__",
        x: u64 = "const act_t* __restrict__",
        xq: u64 = "unsigned char* __restrict__",
        xs_token: u64 = "float* __restrict__",
        xs_row: u64 = "float* __restrict__",
        counts: u64 = "int* __restrict__",
        errors: u64 = "int* __restrict__",
        sync: u64 = "unsigned* __restrict__",
        sorted_rows: u64 = "int* __restrict__",
        pair_pos: u64 = "int* __restrict__",
        tile_expert: u64 = "int* __restrict__",
        tile_span: u64 = "int4* __restrict__",
        tile_span1: u64 = "int4* __restrict__",
        num_tiles: u64 = "int* __restrict__",
        choice: u64 = "const int* __restrict__",
        // One block (no grid barrier, counts or sync): the GEMMs' two work counters, zeroed
        // here rather than by a memset before the launch; null otherwise.
        gemm_counters: u64 = "int* __restrict__",
        // One block of a step the device dispatches: the choice is made here from `planes`
        // (moe_choose's, in its layout) and written to `choose_into`; null otherwise.
        planes: DispatchPlanes = "const DispatchPlanes&",
        choose_into: u64 = "int* __restrict__",
    }
    /// `moe_quant_mid`: the intermediate to e4m3 with one f32 per 128 along K.
    QuantMidParams {
        mid: u64 = "const act_t* __restrict__",
        num_tiles: u64 = "const int* __restrict__",
        sorted_rows: u64 = "const int* __restrict__",
        q: u64 = "unsigned char* __restrict__",
        s: u64 = "float* __restrict__",
    }
    /// `moe_gemm1`: the grouped up-projection with the activation in its epilogue.
    Gemm1Params {
        a: u64 = "const void* __restrict__",
        a_scales: u64 = "const float* __restrict__",
        sorted_rows: u64 = "const int* __restrict__",
        tile_expert: u64 = "const int* __restrict__",
        tile_span: u64 = "const int4* __restrict__",
        num_tiles: u64 = "const int* __restrict__",
        w13: u64 = "const void* __restrict__",
        w13_scales: u64 = "const float* __restrict__",
        w13_bias: u64 = "const float* __restrict__",
        mid: u64 = "act_t* __restrict__",
        mid_scales: u64 = "float* __restrict__",
        work_counter: u64 = "int* __restrict__",
        b_map: TmaDesc = "const TmaMap&",
    }
    /// `moe_gemm2_atomic` (`out`: f32 token rows) and `moe_gemm2_rows` (`out`: activation-dtype
    /// pair rows): the grouped down-projection.
    Gemm2Params {
        a: u64 = "const void* __restrict__",
        a_scales: u64 = "const float* __restrict__",
        sorted_rows: u64 = "const int* __restrict__",
        tile_expert: u64 = "const int* __restrict__",
        tile_span: u64 = "const int4* __restrict__",
        num_tiles: u64 = "const int* __restrict__",
        w2: u64 = "const void* __restrict__",
        w2_scales: u64 = "const float* __restrict__",
        topk_weights: u64 = "const float* __restrict__",
        out: u64 = "void* __restrict__",
        work_counter: u64 = "int* __restrict__",
        b_map: TmaDesc = "const TmaMap&",
        // Weights decoded on the warp-specialised pipeline: the intermediate (A, in tile order)
        // by TMA, in boxes of a k-tile x BM rows.
        a_map: TmaDesc = "const TmaMap&",
    }
    /// `moe_combine_rows`: the deterministic gather-reduce of pair rows into y.
    CombineRowsParams {
        rows: u64 = "const act_t* __restrict__",
        pair_pos: u64 = "const int* __restrict__",
        topk_ids: u64 = "const int* __restrict__",
        topk_weights: u64 = "const float* __restrict__",
        w2_bias: u64 = "const float* __restrict__",
        m: i32 = "int",
        y: u64 = "act_t* __restrict__",
        choice: u64 = "const int* __restrict__",
        // Other ranks' partials added in rank order (0: none): rows `peer_rows` per rank, and
        // each token's row in each (`[m, ranks]`, by distance from `rank`).
        peers: u64 = "const act_t* __restrict__",
        peer_pos: u64 = "const int* __restrict__",
        peer_rows: i32 = "int",
        rank: i32 = "int",
        ranks: i32 = "int",
    }
    /// `moe_convert`: the atomic combine's f32 rows to y.
    ConvertParams {
        y32: u64 = "const float* __restrict__",
        topk_ids: u64 = "const int* __restrict__",
        topk_weights: u64 = "const float* __restrict__",
        w2_bias: u64 = "const float* __restrict__",
        m: i32 = "int",
        y: u64 = "act_t* __restrict__",
        choice: u64 = "const int* __restrict__",
    }
    /// `moe_choose`: the step's family from its live routing.
    ChooseParams {
        topk_ids: u64 = "const int* __restrict__",
        m: i32 = "int",
        planes: DispatchPlanes = "const DispatchPlanes&",
        out: u64 = "int* __restrict__",
    }
}

kernel_params! {
    /// `moe_fused`: the whole step in one cooperative launch (the fused family, `fused.cu`).
    FusedParams {
        x: u64 = "const act_t* __restrict__",
        topk_ids: u64 = "const int* __restrict__",
        topk_weights: u64 = "const float* __restrict__",
        w13: u64 = "const unsigned char* __restrict__",
        w13_scales: u64 = "const void* __restrict__",
        w13_bias: u64 = "const float* __restrict__",
        w2: u64 = "const unsigned char* __restrict__",
        w2_scales: u64 = "const void* __restrict__",
        w2_bias: u64 = "const float* __restrict__",
        mid: u64 = "act_t* __restrict__",
        y: u64 = "act_t* __restrict__",
        done: u64 = "int* __restrict__",
        finished: u64 = "int* __restrict__",
        dn_part: u64 = "float* __restrict__",
        dn_count: u64 = "int* __restrict__",
        err: u64 = "int* __restrict__",
        choice: u64 = "const int* __restrict__",
        m: i32 = "int",
    }
}

/// The declarations the fused family's module needs.
pub fn fused_decls() -> String {
    FusedParams::c_decl()
}

/// The declarations warp decode's module needs, in dependency order.
pub fn decode_decls() -> String {
    [
        RouteParams::c_decl(),
        ExpandParams::c_decl(),
        IdsFromI64Params::c_decl(),
        GateUpParams::c_decl(),
        GateUpBulkParams::c_decl(),
        DownParams::c_decl(),
        ResidentParams::c_decl(),
    ]
    .concat()
}

kernel_params! {
    /// `moe_ep_count`: per block of tokens, how many go to each slab.
    EpCountParams {
        topk_ids: u64 = "const int* __restrict__",
        owner: u64 = "const int* __restrict__",
        counts: u64 = "int* __restrict__",
        m: i32 = "int",
        rank: i32 = "int",
        ranks: i32 = "int",
    }
    /// `moe_ep_place`: each token's rows in the slabs it goes to, its routing and activations.
    EpPlaceParams {
        topk_ids: u64 = "const int* __restrict__",
        topk_weights: u64 = "const float* __restrict__",
        owner: u64 = "const int* __restrict__",
        local: u64 = "const int* __restrict__",
        slots: u64 = "const int* __restrict__",
        counts: u64 = "const int* __restrict__",
        pos: u64 = "int* __restrict__",
        self_ids: u64 = "int* __restrict__",
        self_weights: u64 = "float* __restrict__",
        send: u64 = "char* __restrict__",
        err: u64 = "int* __restrict__",
        m: i32 = "int",
        rows: i32 = "int",
        rank: i32 = "int",
        ranks: i32 = "int",
    }
    /// `moe_ep_pack`: each token's activations into the peer slabs it goes to.
    EpPackParams {
        x: u64 = "const uint4* __restrict__",
        pos: u64 = "const int* __restrict__",
        send: u64 = "char* __restrict__",
        m: i32 = "int",
        rows: i32 = "int",
        rank: i32 = "int",
        ranks: i32 = "int",
    }
    /// `moe_ep_unpack`: fp8 dispatch, the received slabs' rows back into the activation dtype.
    EpUnpackParams {
        recv: u64 = "const char* __restrict__",
        x_recv: u64 = "uint4* __restrict__",
        rows: i32 = "int",
        rank: i32 = "int",
        ranks: i32 = "int",
    }
    /// `moe_ep_combine`: each token's partial outputs, summed in rank order.
    EpCombineParams {
        y_self: u64 = "const uint4* __restrict__",
        y_self_b: u64 = "const uint4* __restrict__",
        y_peers: u64 = "const uint4* __restrict__",
        pos: u64 = "const int* __restrict__",
        y: u64 = "uint4* __restrict__",
        m: i32 = "int",
        rows: i32 = "int",
        rank: i32 = "int",
        ranks: i32 = "int",
        split: i32 = "int",
    }
}

/// The expert-parallel exchange module's parameter structs.
pub fn ep_decls() -> String {
    [
        RouteParams::c_decl(),
        EpCountParams::c_decl(),
        EpPlaceParams::c_decl(),
        EpPackParams::c_decl(),
        EpUnpackParams::c_decl(),
        EpCombineParams::c_decl(),
    ]
    .concat()
}

/// The declarations the grouped module needs.
pub fn grouped_decls() -> String {
    [
        RouteParams::c_decl(),
        PrepareParams::c_decl(),
        QuantMidParams::c_decl(),
        Gemm1Params::c_decl(),
        Gemm2Params::c_decl(),
        CombineRowsParams::c_decl(),
        ConvertParams::c_decl(),
        ChooseParams::c_decl(),
    ]
    .concat()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn declaration_matches_the_rust_layout() {
        let d = DownParams::c_decl();
        assert!(d.starts_with("struct DownParams {\n    const float* mid;\n"), "{d}");
        assert!(d.contains("    int m;\n    const int* choice;\n};"), "{d}");
        assert!(d.contains("static_assert(sizeof(DownParams) == 72,"), "{d}");
        assert!(
            d.contains("static_assert(sizeof(DownParams::m) == 4 && alignof(decltype(DownParams::m)) == 4,"),
            "{d}"
        );
        assert!(d.contains(" const float* __restrict__ mid = p.mid;"), "{d}");
    }

    #[test]
    fn a_tensor_map_is_read_in_place() {
        let d = Gemm1Params::c_decl();
        assert!(d.contains("    TmaMap b_map;\n"), "{d}");
        assert!(d.contains(" const TmaMap& b_map = p.b_map;"), "{d}");
        // 12 pointers, then the map at the next 64-byte boundary.
        assert_eq!(std::mem::offset_of!(Gemm1Params, b_map), 128);
        assert_eq!(std::mem::size_of::<Gemm1Params>(), 256);
    }

    #[test]
    fn the_dispatch_planes_are_one_struct_for_both_choosers() {
        // Eleven 4-byte fields, read in place by moe_choose and moe_prepare alike.
        assert_eq!((std::mem::size_of::<DispatchPlanes>(), std::mem::align_of::<DispatchPlanes>()), (44, 4));
        for d in [ChooseParams::c_decl(), PrepareParams::c_decl()] {
            assert!(d.contains("    DispatchPlanes planes;\n"), "{d}");
            assert!(d.contains(" const DispatchPlanes& planes = p.planes;"), "{d}");
            assert!(d.contains("::planes) == 44 && alignof(decltype("), "{d}");
        }
        // moe_prepare's fields before the planes are 20 pointers and one int, padded.
        assert_eq!(std::mem::offset_of!(PrepareParams, planes), 160);
    }
}
