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
    let large = render_large(&checked)?;
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
    let bias = spec.has_bias();
    let (shared, shared_gated) = (spec.shared_experts(), spec.shared_gated());
    let router = match spec.router() {
        moe_codegen::Router::Softmax { renormalize } => quote!(#cg::Router::Softmax { renormalize: #renormalize }),
        moe_codegen::Router::GroupLimited(g) => {
            let (groups, topk, renorm, scaling) = (g.groups, g.topk_groups, g.renormalize, g.scaling());
            quote!(#cg::Router::GroupLimited(#cg::GroupLimited::new(#groups, #topk, #renorm, #scaling)))
        }
    };
    let arch_values: Vec<_> = archs.iter().map(|a| variant("Arch", a.value)).collect();
    let family_values: Vec<_> = families.iter().map(|f| variant("KernelFamily", f.value)).collect();

    let dequant_doc = spec.dequant().map_or(String::new(), |d| format!(" (dequant {d})"));
    let geometry = format!(
        "hidden {hidden}, intermediate {intermediate}, {experts} experts, top-{top_k}, {} weights{dequant_doc}, {} \
         activations, {}{}",
        spec.weight_format(),
        spec.act_dtype(),
        spec.activation(),
        if spec.has_bias() { ", biases" } else { "" }
    );
    let arch_names = archs.iter().map(|a| a.value.name()).collect::<Vec<_>>().join(", ");
    let family_names = families.iter().map(|f| f.value.name()).collect::<Vec<_>>().join(", ");
    let ident = &item.ident;
    let panic_msg = format!("#[moe_kernel] checked this spec at expansion time: {geometry}");

    // One const per distinct source text: warp decode renders one text for every arch, the grouped
    // family one for sm_90a (wgmma) and others for the mma.sync archs.
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
    // The grouped family's large-step modules (`heuristics::large_step_tiles`), one per arch that has them.
    let large_rows = large.iter().map(|(arch, name, source)| {
        let a = variant("Arch", *arch);
        quote!((#a, #name, #source))
    });
    let large_doc = format!(
        concat!(
            " `(arch, module name, CUDA C source)` of the grouped family with its large-step tiles ",
            "(`moe_codegen::heuristics::large_step_tiles`), which `load` adds for steps of ",
            "`large_step_tokens` and more, rendered when the macro expanded:{}"
        ),
        if large.is_empty() {
            " none for this spec and these archs.".to_string()
        } else {
            large.iter().map(|(a, n, _)| format!("\n- {a}: module `{n}`")).collect::<String>()
        }
    );

    // `with_sources` needs the warp-decode module; without that family there is no `load`.
    let load = families.iter().any(|f| f.value == KernelFamily::WarpDecode).then(|| {
        let doc = format!(
            " Upload `weights` to `device` and build this layer ({geometry}) from the kernels rendered \
             at compile time for the device's arch: every declared family ({family_names}) in \
             [`Self::SOURCES`], passed to `MoeLayer::with_sources`. Nothing is rendered at run time.\n\n \
             The JIT cache is keyed on the rendered source, so these sources and a runtime \
             `moe_codegen::render` of [`Self::SPEC`] share cache entries.\n\n \
             # Errors\n\n `RuntimeError::MissingSource` if the device's arch is not one of \
             [`Self::ARCHS`] ({arch_names}); otherwise those of `MoeLayer::with_sources` (a \
             compile or upload failure)."
        );
        quote! {
            #[doc = #doc]
            pub fn load(
                device: &::moeforge::runtime::Device,
                weights: &::moeforge::runtime::HostWeights,
            ) -> ::core::result::Result<::moeforge::runtime::MoeLayer, ::moeforge::runtime::RuntimeError> {
                let arch = device.arch();
                let mut sources = ::std::vec::Vec::new();
                for &family in Self::FAMILIES {
                    if let ::core::option::Option::Some(source) = Self::kernel_source(family, arch) {
                        sources.push(source);
                    }
                }
                // The grouped family's large-step module, where the spec and arch have one.
                sources.extend(Self::large_step_source(arch));
                ::moeforge::runtime::MoeLayer::with_sources(device, Self::SPEC, &sources, weights)
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
                let spec = value.with_bias(#bias).with_shared_experts(#shared, #shared_gated);
                let value = match &spec {
                    ::core::result::Result::Ok(spec) => *spec,
                    ::core::result::Result::Err(_) => ::core::panic!(#panic_msg),
                };
                ::core::mem::forget(spec);
                value.with_router_checked_by_macro(#router)
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

            #[doc = #large_doc]
            pub const LARGE_STEP_SOURCES: &[(#cg::Arch, &str, &str)] = &[#(#large_rows),*];

            /// The grouped family's large-step module for `arch` as a `KernelSource` (its tiles
            /// from `moe_codegen::heuristics::large_step_tiles`); `None` where the spec and arch
            /// have none or the arch was not declared.
            pub fn large_step_source(arch: #cg::Arch) -> ::core::option::Option<#cg::KernelSource> {
                let tiles = #cg::heuristics::large_step_tiles(&Self::SPEC, arch)?;
                let &(_, name, source) = Self::LARGE_STEP_SOURCES.iter().find(|s| s.0 == arch)?;
                ::core::option::Option::Some(#cg::KernelSource {
                    family: #cg::KernelFamily::GroupedGemm,
                    arch,
                    name: ::std::string::ToString::to_string(name),
                    source: ::std::string::ToString::to_string(source),
                    entry_points: #cg::render::entry_points(#cg::KernelFamily::GroupedGemm),
                    block_threads: tiles.gemm_threads(),
                    decode_tiles: ::core::option::Option::None,
                    grouped_tiles: ::core::option::Option::Some(tiles),
                    fused_tiles: ::core::option::Option::None,
                })
            }

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
                    grouped_tiles: #cg::render::grouped_tiles(&Self::SPEC, family, arch),
                    fused_tiles: #cg::render::fused_tiles(&Self::SPEC, family),
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

/// The grouped family's large-step modules: `(arch, module name, source)` for every declared arch
/// where `large_step_tiles` has tiles for the spec (and the grouped family is declared).
fn render_large(c: &Checked) -> syn::Result<Vec<(moe_codegen::Arch, String, String)>> {
    let mut out = Vec::new();
    if !c.families.iter().any(|f| f.value == KernelFamily::GroupedGemm) {
        return Ok(out);
    }
    for arch in &c.archs {
        if let Some(t) = moe_codegen::heuristics::large_step_tiles(&c.spec, arch.value) {
            let k = moe_codegen::render_grouped(&c.spec, arch.value, t)
                .map_err(|e| syn::Error::new(Span::call_site(), e))?;
            out.push((arch.value, k.name, k.source));
        }
    }
    Ok(out)
}

/// Every (family, arch) rendered: `(family, arch, module name, source)`.
fn render_all(c: &Checked) -> syn::Result<Vec<(KernelFamily, moe_codegen::Arch, String, String)>> {
    let mut out = Vec::new();
    for family in &c.families {
        for arch in &c.archs {
            match render(&c.spec, family.value, arch.value) {
                Ok(k) => out.push((k.family, k.arch, k.name, k.source)),
                // The family exists for the spec (args.rs checked that) but this arch refuses it: at
                // the arch's entry, or at the family's where the archs were defaulted.
                Err(e @ (CodegenError::Unsupported { .. } | CodegenError::DequantUnavailable { .. })) => {
                    return Err(if arch.ident.is_some() { arch.error(e) } else { family.error(e) })
                }
                Err(e) => return Err(syn::Error::new(Span::call_site(), e)),
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    //! The expansion itself, as tokens: what no use of the generated items can observe.

    use super::expand;
    use moe_codegen::{render, Arch, KernelFamily, MoeSpec};
    use proc_macro2::{TokenStream, TokenTree};
    use quote::{quote, ToTokens};

    fn expansion(attr: &str) -> syn::File {
        let out = expand(
            attr.parse().unwrap(),
            quote!(
                pub struct Layer;
            ),
        );
        syn::parse2(out).unwrap()
    }

    fn impl_items(file: &syn::File) -> Vec<syn::ImplItem> {
        let imps = file.items.iter().filter_map(|i| match i {
            syn::Item::Impl(imp) => Some(imp.items.clone()),
            _ => None,
        });
        imps.flatten().collect()
    }

    /// Every identifier in `tokens`, groups included.
    fn idents(tokens: TokenStream, out: &mut Vec<String>) {
        for t in tokens {
            match t {
                TokenTree::Ident(i) => out.push(i.to_string()),
                TokenTree::Group(g) => idents(g.stream(), out),
                _ => {}
            }
        }
    }

    fn load_idents(attr: &str) -> Option<Vec<String>> {
        let file = expansion(attr);
        let load = impl_items(&file).into_iter().find_map(|i| match i {
            syn::ImplItem::Fn(f) if f.sig.ident == "load" => Some(f),
            _ => None,
        })?;
        let mut out = Vec::new();
        idents(load.block.to_token_stream(), &mut out);
        Some(out)
    }

    const SPECS: [&str; 5] = [
        "hidden = 2048, intermediate = 768, experts = 128, top_k = 8",
        "hidden = 2048, intermediate = 768, experts = 128, top_k = 8, archs = [sm_90a]",
        "hidden = 2048, intermediate = 768, experts = 128, top_k = 8, families = [warp_decode]",
        "hidden = 2048, intermediate = 768, experts = 128, top_k = 8, format = int4_g128, archs = [sm_100a]",
        "hidden = 2880, intermediate = 2880, experts = 32, top_k = 4, format = fp8_e4m3, act_dtype = fp16",
    ];

    /// `load` returns a `Result`: an undeclared arch is `RuntimeError::MissingSource`, never a panic.
    #[test]
    fn load_cannot_panic() {
        const PANICKING: [&str; 9] =
            ["expect", "unwrap", "panic", "unreachable", "todo", "unimplemented", "assert", "assert_eq", "assert_ne"];
        for attr in SPECS {
            let ids = load_idents(attr).unwrap_or_else(|| panic!("no `load` for {attr}"));
            for p in PANICKING {
                assert!(!ids.iter().any(|i| i == p), "`load` of {attr} calls `{p}`: {ids:?}");
            }
        }
    }

    /// `load` builds the layer from the embedded sources: no `render`, no `with_source` (which
    /// renders the grouped family), `with_sources` with every declared family.
    #[test]
    fn load_uses_the_embedded_sources() {
        for attr in SPECS {
            let ids = load_idents(attr).unwrap();
            assert!(ids.iter().any(|i| i == "with_sources"), "{attr}: {ids:?}");
            assert!(ids.iter().any(|i| i == "FAMILIES") && ids.iter().any(|i| i == "kernel_source"), "{attr}");
            for renders in ["render", "render_grouped", "render_warp_decode", "with_source", "load"] {
                assert!(!ids.iter().any(|i| i == renders), "`load` of {attr} calls `{renders}`: {ids:?}");
            }
        }
        // The large-step module where the grouped family decodes the weights on sm_90a.
        let ids = load_idents("hidden = 2048, intermediate = 768, experts = 128, top_k = 8, format = mxfp4").unwrap();
        assert!(ids.iter().any(|i| i == "large_step_source"), "{ids:?}");
        // No warp decode, no `load` (`with_sources` needs it).
        assert!(load_idents("hidden = 2048, intermediate = 768, experts = 128, top_k = 8, families = [grouped_gemm]")
            .is_none());
    }

    /// `SOURCES` holds one const per distinct text, and each row names the text rendered for its
    /// pair: warp decode shares one text across archs, the grouped family's differ (wgmma on
    /// sm_90a, mma.sync elsewhere).
    #[test]
    fn sources_hold_one_const_per_distinct_text() {
        let spec = MoeSpec::builder(2048, 768, 128, 8).build().unwrap();
        let file = expansion("hidden = 2048, intermediate = 768, experts = 128, top_k = 8");
        let sources = impl_items(&file)
            .into_iter()
            .find_map(|i| match i {
                syn::ImplItem::Const(c) if c.ident == "SOURCES" => Some(c.expr),
                _ => None,
            })
            .unwrap();
        let syn::Expr::Block(block) = sources else { panic!("SOURCES is a block") };
        let mut texts: Vec<(String, String)> = Vec::new();
        let mut rows = None;
        for stmt in &block.block.stmts {
            match stmt {
                syn::Stmt::Item(syn::Item::Const(c)) => {
                    let syn::Expr::Lit(syn::ExprLit { lit: syn::Lit::Str(s), .. }) = &*c.expr else {
                        panic!("a source const holds a string literal")
                    };
                    texts.push((c.ident.to_string(), s.value()));
                }
                syn::Stmt::Expr(syn::Expr::Reference(r), None) => rows = Some(r.expr.clone()),
                other => panic!("unexpected statement {}", other.to_token_stream()),
            }
        }
        let syn::Expr::Array(rows) = *rows.unwrap() else { panic!("SOURCES is an array") };
        let last = |e: &syn::Expr| match e {
            syn::Expr::Path(p) => p.path.segments.last().unwrap().ident.to_string(),
            _ => panic!("a path"),
        };

        let mut want = Vec::new();
        for family in KernelFamily::ALL {
            for arch in Arch::ALL {
                want.push(render(&spec, family, arch).unwrap());
            }
        }
        let mut distinct: Vec<&str> = want.iter().map(|k| k.source.as_str()).collect();
        distinct.sort_unstable();
        distinct.dedup();
        assert_eq!(texts.len(), distinct.len(), "one const per distinct text");
        assert!(distinct.len() >= 3, "warp decode's one text and the grouped family's two or more");
        assert_eq!(rows.elems.len(), want.len());
        for (row, k) in rows.elems.iter().zip(&want) {
            let syn::Expr::Tuple(t) = row else { panic!("a row is a tuple") };
            let e: Vec<&syn::Expr> = t.elems.iter().collect();
            assert_eq!(last(e[0]), format!("{:?}", k.family));
            assert_eq!(last(e[1]), format!("{:?}", k.arch));
            let text = &texts.iter().find(|(name, _)| *name == last(e[3])).unwrap().1;
            assert!(*text == k.source, "{} on {}: the row names another text", k.family, k.arch);
        }
    }
}
