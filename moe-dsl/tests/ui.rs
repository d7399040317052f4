//! Compile-fail cases: every error of `#[moe_kernel]` points at the argument it concerns.
//! Regenerate the expected output with `TRYBUILD=overwrite cargo test -p moe-dsl --test ui`.

#[test]
fn ui() {
    let t = trybuild::TestCases::new();
    t.compile_fail("tests/ui/*.rs");
}
