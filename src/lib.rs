pub use moe_codegen as codegen;
