//! `#[catch_panics]`, on every `#[pyfunction]`, `#[pymodule]` and `#[pymethods]` impl of the
//! Python bindings (above PyO3's attribute): runs each entry point's body under the bindings'
//! `crate::panics::guard`, so a panic reaches Python as a `RuntimeError` rather than PyO3's
//! `PanicException`, which derives from `BaseException` and escapes `except Exception`.
//!
//! ```text
//!   fn f(args) -> PyResult<T> { body }   becomes   fn f(args) -> PyResult<T> {
//!                                                       crate::panics::guard(move || -> PyResult<T> { body })
//!                                                   }
//!   fn f(args) -> T { body }             becomes   fn f(args) -> PyResult<T> {
//!                                                       crate::panics::guard(move || Ok((move || -> T { body })()))
//!                                                   }
//! ```
//!
//! The arguments stay as they are, so PyO3 sees the same signature; only the return type of a
//! function that could not fail before becomes a `PyResult`.

use proc_macro::TokenStream;
use proc_macro2::TokenStream as TokenStream2;
use quote::ToTokens;
use syn::{Attribute, Block, ImplItem, Item, ReturnType, Signature, Type, parse_quote};

/// Turns panics in the entry points of the item it is on (a `#[pyfunction]`, a `#[pymodule]`
/// or a `#[pymethods]` impl, written above PyO3's attribute) into `RuntimeError`s.
#[proc_macro_attribute]
pub fn catch_panics(attr: TokenStream, item: TokenStream) -> TokenStream {
    let attr = TokenStream2::from(attr);
    if !attr.is_empty() {
        return syn::Error::new_spanned(attr, "#[catch_panics] takes no arguments").to_compile_error().into();
    }
    match syn::parse::<Item>(item).and_then(expand) {
        Ok(tokens) => tokens.into(),
        Err(e) => e.to_compile_error().into(),
    }
}

fn expand(item: Item) -> syn::Result<TokenStream2> {
    match item {
        Item::Fn(mut f) => {
            pyo3_below(&f.attrs, &["pyfunction", "pymodule"], &f.sig.ident)?;
            guard(&mut f.sig, &mut f.block);
            Ok(f.into_token_stream())
        }
        Item::Impl(mut i) => {
            pyo3_below(&i.attrs, &["pymethods"], &i.self_ty)?;
            for item in &mut i.items {
                if let ImplItem::Fn(m) = item {
                    guard(&mut m.sig, &mut m.block);
                }
            }
            Ok(i.into_token_stream())
        }
        other => Err(syn::Error::new_spanned(
            other,
            "#[catch_panics] goes on a #[pyfunction], #[pymodule] or #[pymethods] impl",
        )),
    }
}

/// Checks that PyO3's attribute follows (so it expands after this one and sees the guarded
/// bodies and return types).
fn pyo3_below(attrs: &[Attribute], names: &[&str], at: &impl ToTokens) -> syn::Result<()> {
    if attrs.iter().any(|a| a.path().segments.last().is_some_and(|s| names.iter().any(|n| s.ident == n))) {
        return Ok(());
    }
    Err(syn::Error::new_spanned(at, format!("#[catch_panics] must be written above #[{}]", names.join("] or #["))))
}

/// Whether `ty` is spelled `PyResult<..>`.
fn is_py_result(ty: &Type) -> bool {
    matches!(ty, Type::Path(p) if p.qself.is_none() && p.path.segments.last().is_some_and(|s| s.ident == "PyResult"))
}

/// Runs the body under `crate::panics::guard`, making the return type a `PyResult`.
fn guard(sig: &mut Signature, block: &mut Block) {
    let body = &*block;
    let guarded: Block = match &sig.output {
        ReturnType::Type(_, ty) if is_py_result(ty) => {
            parse_quote!({ crate::panics::guard(move || -> #ty #body) })
        }
        ReturnType::Type(_, ty) => {
            let ty = ty.clone();
            sig.output = parse_quote!(-> ::pyo3::PyResult<#ty>);
            parse_quote!({ crate::panics::guard(move || ::std::result::Result::Ok((move || -> #ty #body)())) })
        }
        ReturnType::Default => {
            sig.output = parse_quote!(-> ::pyo3::PyResult<()>);
            parse_quote!({ crate::panics::guard(move || ::std::result::Result::Ok((move || #body)())) })
        }
    };
    *block = guarded;
}
