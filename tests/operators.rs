//! Keeps every copy of the operator list true to the one table, `symmem::ops::OPERATORS`: the
//! Rust functions exist, the native module binds and registers each, its stubs declare each,
//! and the Python package defines each; and nothing operator-like is in one copy but not in
//! the table.

use std::collections::BTreeSet;
use std::path::Path;

use symmem::ops::OPERATORS;

fn read(rel: &str) -> String {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join(rel);
    std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("read {}: {e}", p.display()))
}

/// Every Rust source under `dir`, concatenated.
fn sources(dir: &str) -> String {
    fn walk(p: &Path, out: &mut String) {
        for e in std::fs::read_dir(p).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                walk(&p, out);
            } else if p.extension().is_some_and(|x| x == "rs") {
                out.push_str(&std::fs::read_to_string(&p).unwrap());
            }
        }
    }
    let mut out = String::new();
    walk(&Path::new(env!("CARGO_MANIFEST_DIR")).join(dir), &mut out);
    out
}

/// The names `prefix` introduces at the start of a line (`def name(`, `wrap_pyfunction!(name`).
fn names(text: &str, prefix: &str) -> BTreeSet<String> {
    text.lines()
        .filter_map(|l| l.trim_start().strip_prefix(prefix).filter(|_| !l.starts_with("    ") || prefix.contains('!')))
        .map(|rest| rest.chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect())
        .collect()
}

#[test]
fn the_table_names_each_operator_once() {
    let mut seen = BTreeSet::new();
    for op in OPERATORS {
        assert!(seen.insert(op.torch), "{} listed twice", op.torch);
        assert_eq!(op.python.is_some(), op.native.is_some(), "{}: a Python function needs its native one", op.torch);
        assert!(
            op.python.is_some(),
            "{}: every operator has a Python function (GPU ones say what they need)",
            op.torch
        );
    }
}

#[test]
fn every_rust_function_exists() {
    let ops = sources("src/ops");
    let symm = sources("src/symm");
    for op in OPERATORS {
        let (module, f) = op.rust.split_once("::").unwrap();
        let text = match module {
            "ops" => &ops,
            "symm" => &symm,
            other => panic!("{}: unknown module {other}", op.torch),
        };
        assert!(text.contains(&format!("pub fn {f}(")), "{}: no `pub fn {f}` in src/{module}", op.torch);
    }
}

#[test]
fn the_native_module_binds_registers_and_declares_exactly_the_table() {
    let bindings = read("python/src/symm.rs");
    let stubs = read("python/py/symmem/_native.pyi");
    let registered = names(&bindings, "m.add_function(wrap_pyfunction!(");
    let declared = names(&stubs, "def ");
    let natives: BTreeSet<String> = OPERATORS.iter().filter_map(|o| o.native).map(str::to_string).collect();
    for op in OPERATORS {
        let Some(native) = op.native else { continue };
        assert!(registered.contains(native), "{native} is not registered in python/src/symm.rs");
        assert!(bindings.contains(&format!("fn {native}(")), "{native} has no binding in python/src/symm.rs");
        assert!(bindings.contains(&format!("{}(", op.rust)), "the binding of {native} does not call {}", op.rust);
        assert!(declared.contains(native), "{native} is not declared in _native.pyi");
    }
    // What the native module has beyond the operators: its setup functions, and the CLI.
    let setup: BTreeSet<String> = [
        "world",
        "empty",
        "rendezvous",
        "available_transports",
        "new_transport_rank",
        "cli_main",
        "set_backend",
        "get_backend",
        "set_signal_pad_size",
        "get_signal_pad_size",
        "get_mem_pool",
    ]
    .map(String::from)
    .into();
    for name in &registered {
        assert!(natives.contains(name) || setup.contains(name), "{name} is registered but not in ops::OPERATORS");
    }
    for name in &declared {
        assert!(natives.contains(name) || setup.contains(name), "_native.pyi declares {name}, not in ops::OPERATORS");
    }
}

#[test]
fn the_python_package_defines_exactly_the_table() {
    let package = read("python/py/symmem/symm.py");
    let defined: BTreeSet<String> = names(&package, "def ").into_iter().filter(|n| !n.starts_with('_')).collect();
    let pythons: BTreeSet<String> = OPERATORS.iter().filter_map(|o| o.python).map(str::to_string).collect();
    for op in OPERATORS {
        let Some(python) = op.python else { continue };
        assert!(defined.contains(python), "symmem.symm does not define {python}");
        let native = op.native.unwrap();
        assert!(package.contains(&format!("_native.{native}(")), "symmem.symm.{python} does not call _native.{native}");
    }
    // Beyond the operators: groups, allocation and rendezvous.
    let setup: BTreeSet<String> = [
        "world",
        "new_group",
        "empty",
        "is_symm_mem_tensor",
        "rendezvous",
        "barrier",
        // PyTorch's configuration and capability names.
        "set_backend",
        "get_backend",
        "set_signal_pad_size",
        "get_signal_pad_size",
        "get_mem_pool",
        "get_mempool_allocator",
        "enable_symm_mem_for_group",
        "is_symm_mem_enabled_for_group",
        "get_symm_mem_workspace",
        "is_nvshmem_available",
        "has_multicast_support",
        // The switch that points torch.distributed._symmetric_memory and torch.ops.symm_mem at
        // symmem, and PyTorch's copy-in variants, composed in Python of one_shot_all_reduce.
        "install",
        "one_shot_all_reduce_copy",
        "one_shot_all_reduce_copy_out",
    ]
    .map(String::from)
    .into();
    for name in &defined {
        assert!(pythons.contains(name) || setup.contains(name), "symmem.symm defines {name}, not in ops::OPERATORS");
    }
}
