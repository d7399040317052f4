//! Code generation: the struct, kept, plus an `impl` with the checked spec and the CUDA sources
//! rendered here, at expansion time, by `moe_codegen::render`.

use crate::args::{Args, Checked};
use moe_codegen::{render, CodegenError, KernelFamily};
use proc_macro2::{Span, TokenStream};
use quote::{format_ident, quote};
use std::fmt::Debug;
use syn::{Fields, ItemStruct};

pub(crate) fn expand(attr: TokenStream, item: TokenStream) -> TokenStream {
    match try_expand(attr, item.clone()) {
        Ok(out) => out,
        // Keep the item so that the only errors are ours, not "cannot find type" cascades.
        Err(e) => {
            let e = e.to_compile_error();
            quote! { #item #e }
        }
    }
}

fn try_expand(attr: TokenStream, item: TokenStream) -> syn::Result<TokenStream> {
    let mut item: ItemStruct = syn::parse2(item)
        .map_err(|e| syn::Error::new(e.span(), "#[moe_kernel] goes on a unit struct, e.g. `pub struct Qwen3Moe;`"))?;
    if !matches!(item.fields, Fields::Unit) {
        return Err(syn::Error::new_spanned(
            &item.fields,
            "#[moe_kernel] goes on a unit struct: write `struct Name;` without fields",
        ));
    }
    if !item.generics.params.is_empty() || item.generics.where_clause.is_some() {
        return Err(syn::Error::new_spanned(&item.generics, "#[moe_kernel] structs take no generic parameters"));
    }
    let checked = syn::parse2::<Args>(attr)?.check()?;
    let sources = render_all(&checked)?;
    let Checked { spec, archs, families } = checked;

    // Enum values are written out by their variant names (their derived `Debug`), so a variant added
    // to moe-codegen needs no change here.
    let cg = quote!(::moeforge::codegen);
    let activation = variant("Activation", spec.activation());
    let format = variant("WeightFormat", spec.weight_format());
    let act_dtype = variant("ActDtype", spec.act_dtype());
    let dequant = match spec.dequant() {
        Some(d) => {
            let d = variant("DequantVariant", d);
            quote!(::core::option::Option::Some(#d))
        }
        None => quote!(::core::option::Option::None),
    };
    let (hidden, intermediate, experts, top_k) = (spec.hidden(), spec.intermediate(), spec.experts(), spec.top_k());
    let arch_values: Vec<_> = archs.iter().map(|a| variant("Arch", a.value)).collect();
    let family_values: Vec<_> = families.iter().map(|f| variant("KernelFamily", f.value)).collect();

    let dequant_doc = spec.dequant().map_or(String::new(), |d| format!(" (dequant {d})"));
    let geometry = format!(
        "hidden {hidden}, intermediate {intermediate}, {experts} experts, top-{top_k}, {} weights{dequant_doc}, {} \
         activations, {}",
        spec.weight_format(),
        spec.act_dtype(),
        spec.activation()
    );
    let arch_names = archs.iter().map(|a| a.value.name()).collect::<Vec<_>>().join(", ");
    let family_names = families.iter().map(|f| f.value.name()).collect::<Vec<_>>().join(", ");
    let ident = &item.ident;
    let panic_msg = format!("#[moe_kernel] checked this spec at expansion time: {geometry}");

    // One const per distinct source text (today every arch of a family renders the same text).
    let mut texts: Vec<&str> = Vec::new();
    let mut rows = Vec::new();
    let mut source_docs = String::new();
    for (family, arch, name, source) in &sources {
        let idx = texts.iter().position(|t| *t == source.as_str()).unwrap_or_else(|| {
            texts.push(source);
            texts.len() - 1
        });
        let text = format_ident!("__MOEFORGE_SOURCE_{idx}");
        let (f, a) = (variant("KernelFamily", *family), variant("Arch", *arch));
        rows.push(quote!((#f, #a, #name, #text)));
        source_docs.push_str(&format!("- {family} on {arch}: module `{name}`, {} bytes of CUDA C\n", source.len()));
    }
    let text_consts = texts.iter().enumerate().map(|(i, t)| {
        let text = format_ident!("__MOEFORGE_SOURCE_{i}");
        quote!(const #text: &str = #t;)
    });

    let load = families.iter().any(|f| f.value == KernelFamily::WarpDecode).then(|| {
        let doc = format!(
            " Upload `weights` to `device` and build this layer ({geometry}) with the warp-decode \
             kernels rendered at compile time for the device's arch.\n\n \
             The JIT cache is keyed on the rendered source, so this source and a runtime \
             `moe_codegen::render` of [`Self::SPEC`] share one cache entry.\n\n \
             # Panics\n\n If the device's arch is not one of [`Self::ARCHS`] ({arch_names})."
        );
        let missing = format!(
            "{ident} was declared with #[moe_kernel(archs = [{arch_names}])]; add the device's arch to `archs`"
        );
        quote! {
            #[doc = #doc]
            pub fn load(
                device: &::moeforge::runtime::Device,
                weights: &::moeforge::runtime::HostWeights,
            ) -> ::core::result::Result<::moeforge::runtime::MoeLayer, ::moeforge::runtime::RuntimeError> {
                let source = ::core::option::Option::expect(
                    Self::kernel_source(#cg::KernelFamily::WarpDecode, device.arch()),
                    #missing,
                );
                ::moeforge::runtime::MoeLayer::with_source(device, Self::SPEC, source, weights)
            }
        }
    });

    let struct_doc = format!(" MoE layer declared with `#[moe_kernel]`: {geometry}; archs {arch_names}.");
    let has_docs = item.attrs.iter().any(|a| a.path().is_ident("doc"));
    if has_docs {
        item.attrs.push(syn::parse_quote!(#[doc = ""]));
    }
    item.attrs.push(syn::parse_quote!(#[doc = #struct_doc]));

    let spec_doc = format!(" The layer's spec: {geometry}. Built by `MoeSpec::new`, checked when the macro expanded.");
    let archs_doc = format!(" The archs this layer's kernels were rendered for: {arch_names}.");
    let families_doc = format!(" The kernel families rendered: {family_names}.");
    let sources_doc = format!(
        " `(family, arch, module name, CUDA C source)` for every family and arch, rendered by \
         `moe_codegen::render` when the macro expanded: the binary carries exactly the source it JITs.\n\n{source_docs}"
    );
    let kernel_source_doc = format!(
        " The rendered kernel source of `family` for `arch` ({geometry}), equal to \
         `moe_codegen::render(&Self::SPEC, family, arch)`; `None` if that pair was not declared \
         (families: {family_names}; archs: {arch_names})."
    );

    Ok(quote! {
        #item

        impl #ident {
            #[doc = #spec_doc]
            pub const SPEC: #cg::MoeSpec = {
                let spec = #cg::MoeSpec::new_with_dequant(
                    #hidden, #intermediate, #experts, #top_k, #activation, #format, #act_dtype, #dequant,
                );
                let value = match &spec {
                    ::core::result::Result::Ok(spec) => *spec,
                    ::core::result::Result::Err(_) => ::core::panic!(#panic_msg),
                };
                // `SpecError` can own a `String` and consts run no destructors: forget the `Result`.
                ::core::mem::forget(spec);
                value
            };

            #[doc = #archs_doc]
            pub const ARCHS: &[#cg::Arch] = &[#(#arch_values),*];

            #[doc = #families_doc]
            pub const FAMILIES: &[#cg::KernelFamily] = &[#(#family_values),*];

            #[doc = #sources_doc]
            pub const SOURCES: &[(#cg::KernelFamily, #cg::Arch, &str, &str)] = {
                #(#text_consts)*
                &[#(#rows),*]
            };

            #[doc = #kernel_source_doc]
            pub fn kernel_source(
                family: #cg::KernelFamily,
                arch: #cg::Arch,
            ) -> ::core::option::Option<#cg::KernelSource> {
                let mut sources = Self::SOURCES.iter();
                let &(family, arch, name, source) = sources.find(|s| s.0 == family && s.1 == arch)?;
                ::core::option::Option::Some(#cg::KernelSource {
                    family,
                    arch,
                    name: ::std::string::ToString::to_string(name),
                    source: ::std::string::ToString::to_string(source),
                    entry_points: #cg::render::entry_points(family),
                    block_threads: #cg::render::block_threads(&Self::SPEC, family, arch),
                    decode_tiles: #cg::render::decode_tiles(&Self::SPEC, family),
                })
            }

            #load
        }
    })
}

/// `::moeforge::codegen::<ty>::<Variant>` for a fieldless enum value.
fn variant(ty: &str, v: impl Debug) -> TokenStream {
    let ty = format_ident!("{ty}");
    let v = format_ident!("{}", format!("{v:?}"));
    quote!(::moeforge::codegen::#ty::#v)
}

/// Every (family, arch) rendered: `(family, arch, module name, source)`.
fn render_all(c: &Checked) -> syn::Result<Vec<(KernelFamily, moe_codegen::Arch, String, String)>> {
    let mut out = Vec::new();
    for family in &c.families {
        for arch in &c.archs {
            match render(&c.spec, family.value, arch.value) {
                Ok(k) => out.push((k.family, k.arch, k.name, k.source)),
                Err(e @ (CodegenError::Unsupported { .. } | CodegenError::DequantUnavailable { .. })) => {
                    return Err(arch.error(e))
                }
                Err(e) => return Err(syn::Error::new(Span::call_site(), e)),
            }
        }
    }
    Ok(out)
}
