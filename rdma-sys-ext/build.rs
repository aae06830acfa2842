//! Build script for `rdma-sys-ext`.
//!
//! 1. Finds the installed rdma-core headers (`infiniband/verbs.h`).
//! 2. Probes them by compiling tiny C files (`-fsyntax-only`) with the `cc`
//!    compiler, and emits `cargo:rustc-cfg=...` for each feature found:
//!    - `has_ibv_wr_flush`: `ibv_wr_flush`, `IBV_QP_EX_WITH_FLUSH`,
//!      `IBV_WR_FLUSH` and `struct ibv_qp_ex::wr_flush` (rdma-core >= 45)
//!    - `has_ibv_wr_atomic_write`: `ibv_wr_atomic_write`,
//!      `IBV_QP_EX_WITH_ATOMIC_WRITE`, `struct ibv_qp_ex::wr_atomic_write`
//!    - `has_ibv_access_flush`: `IBV_ACCESS_FLUSH_GLOBAL/PERSISTENT`
//!    - `has_ib_uverbs_device_flush`: `IB_UVERBS_DEVICE_FLUSH_GLOBAL/PERSISTENT`
//!      (kernel uapi `rdma/ib_user_verbs.h`)
//!    - `has_ib_uverbs_device_atomic_write`: `IB_UVERBS_DEVICE_ATOMIC_WRITE`
//! 3. Builds `src/wrappers.c` (out-of-line copies of static-inline verbs with
//!    NULL checks) with the same gates as `-D` defines.
//! 4. Runs bindgen over `src/wrapper.h` with an allowlist.

use std::env;
use std::path::{Path, PathBuf};
use std::process::Command;

/// (cfg name, C body that must compile for the feature to count as present)
const PROBES: &[(&str, &str)] = &[
    (
        "has_ibv_wr_flush",
        "void probe(struct ibv_qp_ex *qp) {\n\
         ibv_wr_flush(qp, 0, 0, 0, IBV_FLUSH_GLOBAL, IBV_FLUSH_RANGE);\n\
         (void)qp->wr_flush;\n\
         unsigned long long a = IBV_QP_EX_WITH_FLUSH; (void)a;\n\
         int b = IBV_WR_FLUSH; (void)b;\n\
         }\n",
    ),
    (
        "has_ibv_wr_atomic_write",
        "void probe(struct ibv_qp_ex *qp, const void *v) {\n\
         ibv_wr_atomic_write(qp, 0, 0, v);\n\
         (void)qp->wr_atomic_write;\n\
         unsigned long long a = IBV_QP_EX_WITH_ATOMIC_WRITE; (void)a;\n\
         int b = IBV_WR_ATOMIC_WRITE; (void)b;\n\
         }\n",
    ),
    (
        "has_ibv_access_flush",
        "int probe(void) { return IBV_ACCESS_FLUSH_GLOBAL | IBV_ACCESS_FLUSH_PERSISTENT; }\n",
    ),
    (
        "has_ib_uverbs_device_flush",
        "unsigned long long probe(void) {\n\
         return (unsigned long long)IB_UVERBS_DEVICE_FLUSH_GLOBAL |\n\
         (unsigned long long)IB_UVERBS_DEVICE_FLUSH_PERSISTENT; }\n",
    ),
    (
        "has_ib_uverbs_device_atomic_write",
        "unsigned long long probe(void) {\n\
         return (unsigned long long)IB_UVERBS_DEVICE_ATOMIC_WRITE; }\n",
    ),
];

fn include_dirs() -> Vec<PathBuf> {
    let mut dirs = Vec::new();
    if let Some(d) = env::var_os("STAG_RDMA_INCLUDE_DIR") {
        dirs.push(PathBuf::from(d));
    }
    dirs.push(PathBuf::from("/usr/include"));
    dirs.push(PathBuf::from("/usr/local/include"));
    dirs
}

fn find_header(dirs: &[PathBuf], rel: &str) -> Option<PathBuf> {
    dirs.iter().map(|d| d.join(rel)).find(|p| p.is_file())
}

/// Compiles `body` after `#include`-ing the verbs headers; true if it builds.
fn probe(out: &Path, extra_inc: Option<&Path>, name: &str, body: &str) -> bool {
    let file = out.join(format!("probe_{name}.c"));
    let src = format!("#include <infiniband/verbs.h>\n#include <rdma/rdma_cma.h>\n{body}");
    std::fs::write(&file, src).expect("write probe");
    let mut build = cc::Build::new();
    build.cargo_metadata(false).warnings(false);
    if let Some(inc) = extra_inc {
        build.include(inc);
    }
    let compiler = build.get_compiler();
    let mut cmd: Command = compiler.to_command();
    cmd.arg("-fsyntax-only")
        .arg("-Werror=implicit-function-declaration");
    cmd.arg(&file);
    match cmd.output() {
        Ok(o) => o.status.success(),
        Err(e) => panic!("cannot run C compiler for probe {name}: {e}"),
    }
}

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=src/wrapper.h");
    println!("cargo:rerun-if-changed=src/wrappers.c");
    println!("cargo:rerun-if-env-changed=STAG_RDMA_INCLUDE_DIR");
    for (name, _) in PROBES {
        println!("cargo::rustc-check-cfg=cfg({name})");
    }

    let out = PathBuf::from(env::var_os("OUT_DIR").expect("OUT_DIR"));
    let dirs = include_dirs();
    let verbs_h = find_header(&dirs, "infiniband/verbs.h").unwrap_or_else(|| {
        panic!("infiniband/verbs.h not found in {dirs:?}; install libibverbs-dev (rdma-core)")
    });
    let cma_h = find_header(&dirs, "rdma/rdma_cma.h")
        .unwrap_or_else(|| panic!("rdma/rdma_cma.h not found in {dirs:?}; install librdmacm-dev"));
    let uverbs_h = find_header(&dirs, "rdma/ib_user_verbs.h");
    println!("cargo:rerun-if-changed={}", verbs_h.display());
    println!("cargo:rerun-if-changed={}", cma_h.display());
    // Tests compare the gates and constants with the text of these headers.
    println!("cargo:rustc-env=RDMA_SYS_EXT_VERBS_H={}", verbs_h.display());
    println!(
        "cargo:rustc-env=RDMA_SYS_EXT_IB_USER_VERBS_H={}",
        uverbs_h
            .as_deref()
            .map(|p| p.display().to_string())
            .unwrap_or_default()
    );
    let inc_root = verbs_h
        .parent()
        .and_then(Path::parent)
        .map(Path::to_path_buf)
        .expect("include root");
    let extra_inc = (inc_root != Path::new("/usr/include")).then_some(inc_root.as_path());

    let mut found = Vec::new();
    for (name, body) in PROBES {
        let ok = probe(&out, extra_inc, name, body);
        if ok {
            println!("cargo:rustc-cfg={name}");
            found.push(*name);
        }
    }
    // Let dependents (build scripts with `links`) see the gates too.
    println!(
        "cargo:has_ibv_wr_flush={}",
        found.contains(&"has_ibv_wr_flush")
    );
    println!(
        "cargo:has_ibv_wr_atomic_write={}",
        found.contains(&"has_ibv_wr_atomic_write")
    );

    // C wrappers.
    let mut build = cc::Build::new();
    build.file("src/wrappers.c").include("src").warnings(true);
    if let Some(inc) = extra_inc {
        build.include(inc);
    }
    if found.contains(&"has_ibv_wr_flush") {
        build.define("STAG_HAVE_WR_FLUSH", "1");
    }
    if found.contains(&"has_ibv_wr_atomic_write") {
        build.define("STAG_HAVE_WR_ATOMIC_WRITE", "1");
    }
    build.compile("stag_ibverbs_wrappers");

    println!("cargo:rustc-link-lib=dylib=ibverbs");
    println!("cargo:rustc-link-lib=dylib=rdmacm");

    // Bindings.
    let mut builder = bindgen::Builder::default()
        .header("src/wrapper.h")
        .parse_callbacks(Box::new(bindgen::CargoCallbacks::new()))
        .default_enum_style(bindgen::EnumVariation::Consts)
        .prepend_enum_name(false)
        .derive_default(true)
        .derive_debug(false)
        .generate_comments(false)
        .layout_tests(true)
        .opaque_type("pthread_.*")
        .allowlist_type("pthread_(mutex|cond)_t")
        // Our wrappers (static-inline verbs, gated features).
        .allowlist_function("stag_.*")
        // Exported (non-inline) libibverbs functions stag uses.
        .allowlist_function(
            "ibv_(free_device_list|get_device_name|get_device_guid|open_device|close_device\
             |query_device|query_gid|alloc_pd|dealloc_pd|dereg_mr\
             |create_comp_channel|destroy_comp_channel|create_cq|destroy_cq|get_cq_event|ack_cq_events\
             |create_qp|destroy_qp|modify_qp|query_qp|create_srq|destroy_srq\
             |wc_status_str|node_type_str|port_state_str|event_type_str\
             |get_async_event|ack_async_event|fork_init)",
        )
        // librdmacm.
        .allowlist_function(
            "rdma_(create_event_channel|destroy_event_channel|create_id|destroy_id|bind_addr\
             |listen|accept|reject|resolve_addr|resolve_route|connect|disconnect\
             |create_qp|create_qp_ex|destroy_qp|get_cm_event|ack_cm_event|event_str|migrate_id\
             |get_src_port|get_dst_port|get_devices|free_devices)",
        )
        // Enums and flag sets (constified: `pub const IBV_WR_SEND: ibv_wr_opcode = 0`).
        .allowlist_type(
            "ibv_(wr_opcode|wc_opcode|wc_status|wc_flags|send_flags|access_flags|qp_state|qp_type\
             |qp_attr_mask|qp_init_attr_mask|qp_create_send_ops_flags|node_type|transport_type\
             |atomic_cap|mtu|port_state|device_cap_flags|mig_state|placement_type|selectivity_level\
             |event_type)",
        )
        .allowlist_type("ib_uverbs_device_cap_flags")
        .allowlist_type("rdma_(cm_event_type|port_space)")
        .allowlist_var("IBV_DEVICE_.*")
        .allowlist_var("IBV_QP_EX_WITH_.*")
        .allowlist_var("IB_UVERBS_DEVICE_.*")
        .allowlist_var("RDMA_MAX_.*");
    if let Some(inc) = extra_inc {
        builder = builder.clang_arg(format!("-I{}", inc.display()));
    }
    let bindings = builder
        .generate()
        .expect("bindgen over infiniband/verbs.h failed");
    bindings
        .write_to_file(out.join("bindings.rs"))
        .expect("write bindings.rs");
}
