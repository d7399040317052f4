//! The `#[moe_kernel]` attribute (see its own issue); this crate is the macro's home.
