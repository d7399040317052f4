//! Parsing the attribute's `key = value` arguments and checking them, every error spanned at the
//! argument it concerns. Names (formats, archs, ...) go through moe-codegen's `FromStr` impls, sizes
//! through `MoeSpec::new`: the macro owns no list of names and no validation rule of its own.

use moe_codegen::spec::VECTOR_WIDTH_WHY;
use moe_codegen::{
    family_supports, grouped_support, ActDtype, Activation, Arch, DequantVariant, GroupLimited, KernelFamily, MoeSpec,
    Router, SpecError, WeightFormat,
};
use proc_macro2::{Span, TokenStream};
use quote::ToTokens;
use std::str::FromStr;
use syn::ext::IdentExt;
use syn::parse::{discouraged::Speculative, Parse, ParseStream};
use syn::punctuated::Punctuated;
use syn::{bracketed, token, Ident, LitInt, Token};

/// Every key the attribute takes, in the order the docs list them.
pub(crate) const KEYS: [&str; 18] = [
    "hidden",
    "intermediate",
    "experts",
    "top_k",
    "format",
    "dequant",
    "activation",
    "act_dtype",
    "bias",
    "shared_experts",
    "shared_gate",
    "router",
    "router_groups",
    "router_topk_groups",
    "router_renormalize",
    "router_scaling",
    "archs",
    "families",
];
const REQUIRED: [&str; 4] = ["hidden", "intermediate", "experts", "top_k"];

/// The right-hand side of one argument: everything up to the next top-level comma.
#[derive(Clone)]
pub(crate) enum Value {
    Int(LitInt),
    Name(Ident),
    List {
        bracket: token::Bracket,
        items: Punctuated<Ident, Token![,]>,
    },
    /// Anything else (`-1`, `2.0`, `"bf16"`, `a::b`): reported by the key that got it.
    Other(TokenStream),
}

impl Parse for Value {
    fn parse(input: ParseStream) -> syn::Result<Self> {
        let fork = input.fork();
        let simple = if fork.peek(LitInt) {
            fork.parse().map(Value::Int).ok()
        } else if fork.peek(token::Bracket) {
            let content;
            let bracket = bracketed!(content in fork);
            content.parse_terminated(Ident::parse_any, Token![,]).ok().map(|items| Value::List { bracket, items })
        } else if fork.peek(Ident::peek_any) {
            Ident::parse_any(&fork).ok().map(Value::Name)
        } else {
            None
        };
        if let Some(v) = simple.filter(|_| fork.is_empty() || fork.peek(Token![,])) {
            input.advance_to(&fork);
            return Ok(v);
        }
        let mut other = TokenStream::new();
        while !input.is_empty() && !input.peek(Token![,]) {
            other.extend([input.parse::<proc_macro2::TokenTree>()?]);
        }
        if other.is_empty() {
            return Err(input.error("expected a value after `=`"));
        }
        Ok(Value::Other(other))
    }
}

impl ToTokens for Value {
    fn to_tokens(&self, tokens: &mut TokenStream) {
        match self {
            Value::Int(v) => v.to_tokens(tokens),
            Value::Name(v) => v.to_tokens(tokens),
            Value::List { bracket, items } => bracket.surround(tokens, |t| items.to_tokens(t)),
            Value::Other(v) => v.to_tokens(tokens),
        }
    }
}

/// One `key = value` argument.
#[derive(Clone)]
pub(crate) struct Arg {
    pub key: Ident,
    pub eq: Token![=],
    pub value: Value,
}

impl Parse for Arg {
    fn parse(input: ParseStream) -> syn::Result<Self> {
        Ok(Arg { key: Ident::parse_any(input)?, eq: input.parse()?, value: input.parse()? })
    }
}

impl ToTokens for Arg {
    fn to_tokens(&self, tokens: &mut TokenStream) {
        self.key.to_tokens(tokens);
        self.eq.to_tokens(tokens);
        self.value.to_tokens(tokens);
    }
}

/// The whole argument list.
pub(crate) struct Args(pub Punctuated<Arg, Token![,]>);

impl Parse for Args {
    fn parse(input: ParseStream) -> syn::Result<Self> {
        Ok(Args(Punctuated::parse_terminated(input)?))
    }
}

/// A value and the argument it came from (`None` where the default was taken).
pub(crate) struct Given<T> {
    pub value: T,
    pub arg: Option<Arg>,
}

impl<T> Given<T> {
    fn default(value: T) -> Self {
        Given { value, arg: None }
    }
    fn of(arg: &Arg, value: T) -> Self {
        Given { value, arg: Some(arg.clone()) }
    }
    /// An error at the argument, or at the attribute where the value was defaulted.
    fn error(&self, msg: impl std::fmt::Display) -> syn::Error {
        match &self.arg {
            Some(arg) => syn::Error::new_spanned(arg, msg),
            None => syn::Error::new(Span::call_site(), msg),
        }
    }
}

/// One element of a list argument, with the identifier it was written as.
pub(crate) struct Item<T> {
    pub value: T,
    pub ident: Option<Ident>,
}

impl<T> Item<T> {
    pub(crate) fn error(&self, msg: impl std::fmt::Display) -> syn::Error {
        match &self.ident {
            Some(i) => syn::Error::new_spanned(i, msg),
            None => syn::Error::new(Span::call_site(), msg),
        }
    }
}

/// The checked arguments: a valid spec plus the archs and families to render.
pub(crate) struct Checked {
    pub spec: MoeSpec,
    pub archs: Vec<Item<Arch>>,
    pub families: Vec<Item<KernelFamily>>,
}

/// Accumulates errors so that one expansion reports every bad argument at once.
#[derive(Default)]
struct Errors(Option<syn::Error>);

impl Errors {
    fn push(&mut self, e: syn::Error) {
        match &mut self.0 {
            Some(all) => all.combine(e),
            None => self.0 = Some(e),
        }
    }
    fn finish(self) -> syn::Result<()> {
        self.0.map_or(Ok(()), Err)
    }
}

fn int(arg: &Arg) -> syn::Result<u32> {
    match &arg.value {
        Value::Int(lit) => {
            if !matches!(lit.suffix(), "" | "u32") {
                return Err(syn::Error::new_spanned(
                    lit,
                    format!("`{}` takes a plain integer, without a suffix", arg.key),
                ));
            }
            if lit.base10_digits().starts_with('-') {
                return Err(syn::Error::new_spanned(lit, format!("`{}` cannot be negative", arg.key)));
            }
            lit.base10_parse::<u32>()
                .map_err(|e| syn::Error::new_spanned(lit, format!("`{}` must fit in a u32: {e}", arg.key)))
        }
        other => {
            Err(syn::Error::new_spanned(other, format!("`{}` takes an integer, e.g. `{} = 2048`", arg.key, arg.key)))
        }
    }
}

fn name<T: FromStr<Err = SpecError>>(arg: &Arg) -> syn::Result<T> {
    match &arg.value {
        Value::Name(ident) => parse_name(ident),
        other => {
            Err(syn::Error::new_spanned(other, format!("`{}` takes a single name, e.g. `{}`", arg.key, example(arg))))
        }
    }
}

fn boolean(arg: &Arg) -> syn::Result<bool> {
    match &arg.value {
        Value::Name(ident) if ident == "true" => Ok(true),
        Value::Name(ident) if ident == "false" => Ok(false),
        other => Err(syn::Error::new_spanned(other, format!("`{}` takes `true` or `false`", arg.key))),
    }
}

fn float(arg: &Arg) -> syn::Result<f32> {
    let bad = |t: &dyn ToTokens| syn::Error::new_spanned(t, format!("`{}` takes a number, e.g. `2.5`", arg.key));
    match &arg.value {
        Value::Int(lit) => lit.base10_parse::<f32>().map_err(|_| bad(lit)),
        Value::Other(tokens) => syn::parse2::<syn::LitFloat>(tokens.clone())
            .map_err(|_| bad(tokens))
            .and_then(|lit| lit.base10_parse::<f32>().map_err(|_| bad(&lit))),
        other => Err(bad(other)),
    }
}

fn parse_name<T: FromStr<Err = SpecError>>(ident: &Ident) -> syn::Result<T> {
    ident.unraw().to_string().parse::<T>().map_err(|e| syn::Error::new_spanned(ident, e))
}

fn list<T: FromStr<Err = SpecError> + PartialEq + std::fmt::Display>(arg: &Arg) -> syn::Result<Vec<Item<T>>> {
    let Value::List { items, .. } = &arg.value else {
        return Err(syn::Error::new_spanned(
            &arg.value,
            format!("`{}` takes a list of names in brackets, e.g. `{} = [{}]`", arg.key, arg.key, example(arg)),
        ));
    };
    if items.is_empty() {
        return Err(syn::Error::new_spanned(arg, format!("`{}` must name at least one entry", arg.key)));
    }
    let mut errors = Errors::default();
    let mut out: Vec<Item<T>> = Vec::new();
    for ident in items {
        match parse_name::<T>(ident) {
            Ok(v) if out.iter().any(|o| o.value == v) => {
                errors.push(syn::Error::new_spanned(ident, format!("`{v}` is listed twice in `{}`", arg.key)))
            }
            Ok(value) => out.push(Item { value, ident: Some(ident.clone()) }),
            Err(e) => errors.push(e),
        }
    }
    errors.finish().map(|()| out)
}

fn example(arg: &Arg) -> &'static str {
    match arg.key.unraw().to_string().as_str() {
        "format" => "bf16",
        "dequant" => "bits",
        "activation" => "silu",
        "act_dtype" => "bf16",
        "archs" => "sm_90a, sm_100a",
        "families" => "warp_decode, grouped_gemm",
        _ => "...",
    }
}

/// Edit distance, for "did you mean" on misspelt keys.
fn distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut prev: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut cur = vec![i + 1];
        for (j, &cb) in b.iter().enumerate() {
            cur.push((prev[j] + usize::from(ca != cb)).min(prev[j + 1] + 1).min(cur[j] + 1));
        }
        prev = cur;
    }
    prev[b.len()]
}

/// The error for a key not in [`KEYS`], and the key it probably meant.
fn unknown_key(key: &Ident) -> (syn::Error, Option<&'static str>) {
    let k = key.unraw().to_string();
    let keys = KEYS.join(", ");
    let best = KEYS.into_iter().min_by_key(|c| distance(&k, c)).filter(|c| distance(&k, c) <= 2);
    let msg = match best {
        Some(best) => format!("unknown key `{k}`; did you mean `{best}`? (expected one of: {keys})"),
        None => format!("unknown key `{k}`; expected one of: {keys}"),
    };
    (syn::Error::new_spanned(key, msg), best)
}

impl Args {
    /// Check every argument, then the spec through `MoeSpec::new` (the runtime's own constructor).
    pub(crate) fn check(&self) -> syn::Result<Checked> {
        let mut errors = Errors::default();
        let mut seen: Vec<String> = Vec::new();
        // Keys a misspelt key was taken for: not reported missing as well.
        let mut suggested: Vec<&str> = Vec::new();
        let mut sizes: [Option<Given<u32>>; 4] = [None, None, None, None];
        let mut format = Given::default(WeightFormat::Bf16);
        let mut activation = Given::default(Activation::Silu);
        let mut bias = false;
        let mut shared: Option<Given<u32>> = None;
        let mut shared_gate: Option<Given<bool>> = None;
        let mut router: Option<Given<Ident>> = None;
        let (mut groups, mut topk_groups): (Option<Given<u32>>, Option<Given<u32>>) = (None, None);
        let (mut renormalize, mut scaling): (Option<Given<bool>>, Option<Given<f32>>) = (None, None);
        let mut act_dtype: Option<Given<ActDtype>> = None;
        let mut dequant: Option<Given<DequantVariant>> = None;
        let mut archs: Vec<Item<Arch>> = Arch::ALL.into_iter().map(|value| Item { value, ident: None }).collect();
        // `None`: every family the spec supports, decided once the spec is built.
        let mut families: Option<Vec<Item<KernelFamily>>> = None;

        for arg in &self.0 {
            let key = arg.key.unraw().to_string();
            if !KEYS.contains(&key.as_str()) {
                let (e, meant) = unknown_key(&arg.key);
                errors.push(e);
                suggested.extend(meant);
                continue;
            }
            if seen.contains(&key) {
                errors.push(syn::Error::new_spanned(arg, format!("duplicate key `{key}`: it is already given")));
                continue;
            }
            seen.push(key.clone());
            let r = match key.as_str() {
                k if REQUIRED.contains(&k) => {
                    let slot = REQUIRED.iter().position(|r| *r == k).expect("required key");
                    int(arg).map(|v| sizes[slot] = Some(Given::of(arg, v)))
                }
                "format" => name(arg).map(|v| format = Given::of(arg, v)),
                "dequant" => name(arg).map(|v| dequant = Some(Given::of(arg, v))),
                "activation" => name(arg).map(|v| activation = Given::of(arg, v)),
                "act_dtype" => name(arg).map(|v| act_dtype = Some(Given::of(arg, v))),
                "bias" => boolean(arg).map(|v| bias = v),
                "shared_experts" => int(arg).map(|v| shared = Some(Given::of(arg, v))),
                "shared_gate" => boolean(arg).map(|v| shared_gate = Some(Given::of(arg, v))),
                "router" => match &arg.value {
                    Value::Name(ident) => {
                        router = Some(Given::of(arg, ident.clone()));
                        Ok(())
                    }
                    other => Err(syn::Error::new_spanned(
                        other,
                        "`router` takes `softmax`, `softmax_raw` or `group_limited`",
                    )),
                },
                "router_groups" => int(arg).map(|v| groups = Some(Given::of(arg, v))),
                "router_topk_groups" => int(arg).map(|v| topk_groups = Some(Given::of(arg, v))),
                "router_renormalize" => boolean(arg).map(|v| renormalize = Some(Given::of(arg, v))),
                "router_scaling" => float(arg).map(|v| scaling = Some(Given::of(arg, v))),
                "archs" => list(arg).map(|v| archs = v),
                "families" => list(arg).map(|v| families = Some(v)),
                _ => unreachable!("every key in KEYS is handled"),
            };
            if let Err(e) = r {
                errors.push(e);
            }
        }

        let missing: Vec<String> = REQUIRED
            .iter()
            .filter(|k| !seen.iter().any(|s| s == *k) && !suggested.contains(k))
            .map(|k| format!("`{k}`"))
            .collect();
        if !missing.is_empty() {
            errors.push(syn::Error::new(
                Span::call_site(),
                format!(
                    "missing required key{} {}: #[moe_kernel] needs `hidden`, `intermediate`, `experts` and `top_k`",
                    if missing.len() > 1 { "s" } else { "" },
                    missing.join(", ")
                ),
            ));
        }
        errors.finish()?;

        let [Some(hidden), Some(intermediate), Some(experts), Some(top_k)] = sizes else {
            unreachable!("missing keys were reported above")
        };
        let act = act_dtype.as_ref().map_or(format.value.default_act_dtype(), |g| g.value);
        let spec = MoeSpec::new_with_dequant(
            hidden.value,
            intermediate.value,
            experts.value,
            top_k.value,
            activation.value,
            format.value,
            act,
            dequant.as_ref().map(|d| d.value),
        )
        .map_err(|e| {
            let field = |f: &str| match f {
                "hidden" => &hidden,
                "intermediate" => &intermediate,
                "experts" => &experts,
                _ => &top_k,
            };
            match &e {
                SpecError::Zero { field: f } | SpecError::TooLarge { field: f, .. } => field(f).error(&e),
                SpecError::NotDivisible { field: f, divisor, why, .. } if *why == VECTOR_WIDTH_WHY => field(f).error(
                    format_args!("{e}: with `format = {}` one 16-byte vector holds {divisor} elements", format.value),
                ),
                SpecError::NotDivisible { field: f, .. } => {
                    field(f).error(format_args!("{e} (`format = {}`)", format.value))
                }
                SpecError::DequantUnsupported { .. } => match &dequant {
                    Some(d) => d.error(&e),
                    None => format.error(&e),
                },
                SpecError::TopKExceedsExperts { .. } => top_k.error(&e),
                SpecError::ActDtypeMismatch { .. } => match &act_dtype {
                    Some(a) => a.error(&e),
                    None => format.error(&e),
                },
                // The macro takes no router argument (the default router cannot fail).
                SpecError::Unknown { .. } | SpecError::Router { .. } => syn::Error::new(Span::call_site(), &e),
            }
        })?
        .with_bias(bias);
        let (count, gated) = (shared.as_ref().map_or(0, |g| g.value), shared_gate.as_ref().is_some_and(|g| g.value));
        let spec = spec.with_shared_experts(count, gated).map_err(|e| match (&shared, &shared_gate) {
            (Some(s), _) => s.error(&e),
            (None, Some(g)) => g.error(&e),
            (None, None) => syn::Error::new(Span::call_site(), &e),
        })?;
        let spec = match &router {
            None => {
                // The group-limited router's parameters mean nothing without it.
                if let Some(e) = [
                    groups.as_ref().map(|g| g.error("`router_groups` needs `router = group_limited`")),
                    topk_groups.as_ref().map(|g| g.error("`router_topk_groups` needs `router = group_limited`")),
                    scaling.as_ref().map(|g| g.error("`router_scaling` needs `router = group_limited`")),
                ]
                .into_iter()
                .flatten()
                .next()
                {
                    return Err(e);
                }
                match &renormalize {
                    Some(r) => spec.with_router(Router::Softmax { renormalize: r.value }).map_err(|e| r.error(e))?,
                    None => spec,
                }
            }
            Some(r) => {
                let renorm = renormalize.as_ref().is_none_or(|g| g.value);
                let chosen = match r.value.to_string().as_str() {
                    "softmax" => Router::Softmax { renormalize: renorm },
                    "softmax_raw" => Router::Softmax { renormalize: false },
                    "group_limited" => {
                        let need = |g: &Option<Given<u32>>, key: &str| {
                            g.as_ref()
                                .map(|g| g.value)
                                .ok_or_else(|| r.error(format!("`router = group_limited` needs `{key}`")))
                        };
                        let scale = scaling.as_ref().map_or(1.0, |g| g.value);
                        Router::GroupLimited(GroupLimited::new(
                            need(&groups, "router_groups")?,
                            need(&topk_groups, "router_topk_groups")?,
                            renorm,
                            scale,
                        ))
                    }
                    other => {
                        return Err(r.error(format!(
                            "unknown router `{other}`; expected one of: softmax, softmax_raw, group_limited"
                        )))
                    }
                };
                spec.with_router(chosen).map_err(|e| r.error(e))?
            }
        };
        let families = match families {
            Some(declared) => {
                let mut errors = Errors::default();
                for f in &declared {
                    if let Some(why) = family_unavailable(f.value, &spec) {
                        errors.push(f.error(format_args!("{} is not available for this spec: {why}", f.value)));
                    }
                }
                errors.finish()?;
                declared
            }
            None => KernelFamily::ALL
                .into_iter()
                .filter(|&f| family_supports(f, &spec))
                .map(|value| Item { value, ident: None })
                .collect(),
        };
        Ok(Checked { spec, archs, families })
    }
}

/// Why `family` has no kernels for `spec` on any arch (`None` where it has them): the error at a
/// declared family the spec rules out, rather than an error naming an arch.
fn family_unavailable(family: KernelFamily, spec: &MoeSpec) -> Option<String> {
    if family_supports(family, spec) {
        return None;
    }
    let why = match family {
        KernelFamily::GroupedGemm => grouped_support(spec).err(),
        KernelFamily::Fused => moe_codegen::fused_support(spec).err(),
        _ => None,
    };
    Some(why.unwrap_or_else(|| "moe_codegen::family_supports refuses it".into()))
}
