//! The private provider ABI declared in `src/abi.h` against rdma-core's own
//! `libibverbs/driver.h` (v55, IBVERBS_PRIVATE_34, the ABI of v44..v56),
//! as vendored by the crates.io package `ibverbs-sys` 0.3.2+55.0: every
//! shared structure has the same members in the same order. (Debian ships
//! no driver.h; the gate's programs check the layout against the running
//! library's behaviour.)

use std::path::{Path, PathBuf};
use std::process::Command;

const PKG: &str = "ibverbs-sys-0.3.2+55.0";

/// The vendored rdma-core tree, fetched into cargo's registry if needed.
fn rdma_core() -> PathBuf {
    let home = std::env::var_os("CARGO_HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(std::env::var_os("HOME").expect("HOME")).join(".cargo"));
    let find = || -> Option<PathBuf> {
        std::fs::read_dir(home.join("registry/src"))
            .ok()?
            .flatten()
            .map(|d| d.path().join(PKG).join("vendor/rdma-core"))
            .find(|p| p.join("libibverbs/driver.h").is_file())
    };
    if let Some(p) = find() {
        return p;
    }
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let st = Command::new(cargo)
        .args(["info", "ibverbs-sys@0.3.2+55.0"])
        .current_dir(std::env::temp_dir())
        .status()
        .expect("run cargo info");
    assert!(st.success(), "cargo info ibverbs-sys failed");
    find().expect("ibverbs-sys source in the registry after cargo info")
}

/// The member names of `struct NAME { ... }` in C source, in order.
fn members(src: &str, name: &str) -> Vec<String> {
    let start = src
        .find(&format!("struct {name} {{"))
        .unwrap_or_else(|| panic!("struct {name} not found"));
    let body = &src[start + name.len() + 9..];
    let mut depth = 1;
    let mut end = 0;
    for (i, c) in body.char_indices() {
        match c {
            '{' => depth += 1,
            '}' => {
                depth -= 1;
                if depth == 0 {
                    end = i;
                    break;
                }
            }
            _ => {}
        }
    }
    let body = &body[..end];
    // Strip comments, split declarations on ';' at depth 0 of parens/braces.
    let mut clean = String::new();
    let mut rest = body;
    while let Some(i) = rest.find("/*") {
        clean.push_str(&rest[..i]);
        rest = &rest[i + 2..];
        rest = &rest[rest.find("*/").map(|j| j + 2).unwrap_or(rest.len())..];
    }
    clean.push_str(rest);
    let mut out = Vec::new();
    let mut decl = String::new();
    let mut level = 0i32;
    for c in clean.chars() {
        match c {
            '(' | '{' => level += 1,
            ')' | '}' => level -= 1,
            _ => {}
        }
        if c == ';' && level == 0 {
            out.push(member_name(decl.trim()));
            decl.clear();
        } else {
            decl.push(c);
        }
    }
    out.into_iter().filter(|n| !n.is_empty()).collect()
}

/// A declaration's member name: `(*name)(...)` for function pointers,
/// the last identifier otherwise (a union's members are listed as
/// `union{a,b}`).
fn member_name(decl: &str) -> String {
    if let Some(i) = decl.find("(*") {
        let rest = &decl[i + 2..];
        return rest[..rest.find(')').unwrap_or(0)].trim().to_owned();
    }
    if decl.starts_with("union") {
        let inner = &decl[decl.find('{').unwrap_or(0) + 1..decl.rfind('}').unwrap_or(decl.len())];
        let names: Vec<String> = inner
            .split(';')
            .map(|d| member_name(d.trim()))
            .filter(|n| !n.is_empty())
            .collect();
        return format!("union{{{}}}", names.join(","));
    }
    let decl = decl.split('[').next().unwrap_or("");
    decl.split(|c: char| !(c.is_alphanumeric() || c == '_'))
        .rfind(|s| !s.is_empty())
        .unwrap_or("")
        .to_owned()
}

#[test]
fn private_abi_matches_rdma_core_driver_h() {
    let driver = std::fs::read_to_string(rdma_core().join("libibverbs/driver.h")).unwrap();
    let ours =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("src/abi.h")).unwrap();
    for s in [
        "verbs_match_ent",
        "verbs_sysfs_dev",
        "verbs_device_ops",
        "verbs_device",
        "verbs_mr",
        "verbs_qp",
        "verbs_srq",
        "verbs_context_ops",
    ] {
        let theirs = members(&driver, s);
        let mine = members(&ours, s);
        assert!(!theirs.is_empty(), "{s}: nothing parsed from driver.h");
        assert_eq!(mine, theirs, "struct {s} differs from rdma-core's driver.h");
    }
}

#[test]
fn member_parser_reads_function_pointers_unions_and_arrays() {
    let src = "struct t {\n\tint (*f)(int a, int b);\n\tunion { struct x a; struct y b; };\n\tchar n[IBV_X];\n\tconst struct z *p; /* c; */\n};";
    assert_eq!(members(src, "t"), ["f", "union{a,b}", "n", "p"]);
}
