//! Keeps the layering that `src/lib.rs` states a fact: every module may use only the modules
//! below it. Reads every source file's `crate::` paths (in `use` lines and inline) and fails on
//! one that points up or sideways. Also keeps configuration in one place: only `config.rs`
//! reads the environment, and every `SYMMEM_*` name in the sources is one of its knobs.

use std::path::{Path, PathBuf};

/// The layers, bottom first. A module may use the modules of lower layers only.
const LAYERS: &[&[&str]] = &[
    &["error"],
    &["sys", "rt"],
    &["config"],
    &["sync", "topo"],
    &["tensor"],
    &["wire"],
    &["store"],
    &["group"],
    &["transport"],
    &["symm"],
    &["ops"],
    &["launch"],
];

fn layer_of(module: &str) -> Option<usize> {
    LAYERS.iter().position(|l| l.contains(&module))
}

fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            sources(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// The code of a line: without its `//` comment (good enough for this crate's sources, which
/// have no `//` inside string literals on lines that name modules).
fn code(line: &str) -> &str {
    line.split("//").next().unwrap_or("")
}

/// The top-level module a file belongs to (`src/symm/remote.rs` → `symm`).
fn module_of(src: &Path, file: &Path) -> String {
    let rel = file.strip_prefix(src).unwrap();
    let first = rel.components().next().unwrap().as_os_str().to_string_lossy().to_string();
    first.trim_end_matches(".rs").to_string()
}

/// Every `crate::<module>` a line names, including `crate::{a, b::c}` groups.
fn named_modules(line: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = line;
    while let Some(i) = rest.find("crate::") {
        // Not `symmem_crate::` or similar.
        let before = rest[..i].chars().last();
        rest = &rest[i + "crate::".len()..];
        if before.is_some_and(|c| c.is_alphanumeric() || c == '_') {
            continue;
        }
        if let Some(group) = rest.strip_prefix('{') {
            let inner = group.split('}').next().unwrap_or("");
            for item in inner.split(',') {
                let name: String = item.trim().chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect();
                out.push(name);
            }
        } else {
            out.push(rest.chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect());
        }
    }
    out
}

#[test]
fn no_import_points_up() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    sources(&src, &mut files);
    files.sort();
    let mut seen = std::collections::BTreeSet::new();
    let mut violations = Vec::new();
    for file in &files {
        let module = module_of(&src, file);
        if module == "lib" {
            continue; // the crate root declares and re-exports everything
        }
        let Some(mine) = layer_of(&module) else {
            violations.push(format!("{}: module `{module}` is in no layer; add it to LAYERS", file.display()));
            continue;
        };
        seen.insert(module.clone());
        for (n, line) in std::fs::read_to_string(file).unwrap().lines().enumerate() {
            for used in named_modules(code(line)) {
                if used == module || used.is_empty() {
                    continue;
                }
                match layer_of(&used) {
                    Some(theirs) if theirs < mine => {}
                    Some(_) => violations.push(format!(
                        "{}:{}: `{module}` uses `{used}`, which is not below it: {}",
                        file.display(),
                        n + 1,
                        line.trim()
                    )),
                    // Items of the crate root (its re-exports, `log_to_stderr`): the root is
                    // above every layer, so reaching them is reaching up.
                    None => violations.push(format!(
                        "{}:{}: `{module}` uses `crate::{used}`, which is no layer's; name the layer it lives in",
                        file.display(),
                        n + 1
                    )),
                }
            }
        }
    }
    let missing: Vec<_> = LAYERS.iter().flat_map(|l| l.iter()).filter(|m| !seen.contains(**m)).collect();
    assert!(missing.is_empty(), "LAYERS names modules that no longer exist: {missing:?}");
    assert!(violations.is_empty(), "imports that point up:\n{}", violations.join("\n"));
}

#[test]
fn the_layer_reader_sees_groups_and_inline_paths() {
    assert_eq!(named_modules("use crate::{symm, ops::x};"), ["symm", "ops"]);
    assert_eq!(named_modules("let t = crate::config::op_timeout(); other_crate::x"), ["config"]);
    assert_eq!(named_modules(code("let a = 1; // crate::symm")), Vec::<String>::new());
}

#[test]
fn only_config_reads_the_environment_and_it_lists_every_knob() {
    // The library's sources and the command line's (which reads its knobs through config too).
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files = Vec::new();
    sources(&root.join("src"), &mut files);
    sources(&root.join("cli/src"), &mut files);
    assert!(files.iter().any(|f| f.ends_with("cli/src/main.rs")), "the command line's sources are where they were");
    let knobs: Vec<&str> = symmem::config::KNOBS.iter().map(|k| k.env).collect();
    let mut bad = Vec::new();
    for file in &files {
        let text = std::fs::read_to_string(file).unwrap();
        let is_config = file.ends_with("config.rs");
        for (n, line) in text.lines().enumerate() {
            let c = code(line);
            for reader in ["env::var(", "env::var_os(", "env::vars(", "from_env(\"", "try_from_env("] {
                if !is_config && c.contains(reader) {
                    bad.push(format!(
                        "{}:{}: reads the environment outside config.rs: {}",
                        file.display(),
                        n + 1,
                        line.trim()
                    ));
                    break;
                }
            }
            // Every SYMMEM_* name, in code or docs, is a knob.
            let mut rest = line;
            while let Some(i) = rest.find("SYMMEM_") {
                let name: String = rest[i..]
                    .chars()
                    .take_while(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || *c == '_')
                    .collect();
                rest = &rest[i + name.len()..];
                // A family named by its prefix (`SYMMEM_TRANSPORT_TCP_*`) is fine if knobs have it.
                let ok = knobs.contains(&name.as_str())
                    || (name.ends_with('_') && knobs.iter().any(|k| k.starts_with(name.as_str())));
                if !ok {
                    bad.push(format!("{}:{}: {name} is not in config::KNOBS", file.display(), n + 1));
                }
            }
        }
    }
    assert!(bad.is_empty(), "{}", bad.join("\n"));
}
