//! Generates the C bindings the plugin speaks: libibverbs' public API and
//! librdmacm's types from the installed headers, and the private provider
//! ABI from `src/abi.h`. Links libibverbs (the plugin calls its private
//! `verbs_register_driver_34` family).

use std::env;
use std::path::PathBuf;

fn main() {
    let manifest = PathBuf::from(env::var("CARGO_MANIFEST_DIR").expect("cargo sets it"));
    let out = PathBuf::from(env::var("OUT_DIR").expect("cargo sets it"));
    println!("cargo:rerun-if-changed=src/abi.h");
    println!("cargo:rerun-if-env-changed=STAG_RDMA_INCLUDE_DIR");

    let mut builder = bindgen::Builder::default()
        .header(manifest.join("src/abi.h").display().to_string())
        .allowlist_type("ibv_.*|verbs_.*|rdma_.*|ib_uverbs_.*|stag_.*")
        .allowlist_function(
            "verbs_register_driver_34|_verbs_init_and_alloc_context|verbs_uninit_context|\
             verbs_set_ops|verbs_init_cq|ibv_get_device_list|ibv_free_device_list|\
             ibv_open_device|ibv_close_device|ibv_get_device_name|ibv_alloc_pd|\
             ibv_dealloc_pd|ibv_create_qp|ibv_destroy_qp|ibv_query_qp|ibv_modify_qp|\
             ibv_query_gid|ibv_query_port|ibv_query_device",
        )
        .allowlist_var("IBV_.*|RDMA_.*|IB_UVERBS_.*|RAI_.*|UCMA_.*")
        .derive_default(true)
        .derive_debug(false)
        .layout_tests(true)
        .prepend_enum_name(false)
        .default_enum_style(bindgen::EnumVariation::Consts)
        .parse_callbacks(Box::new(bindgen::CargoCallbacks::new()));
    if let Ok(dir) = env::var("STAG_RDMA_INCLUDE_DIR") {
        builder = builder.clang_arg(format!("-I{dir}"));
    }
    let bindings = builder
        .generate()
        .expect("bindgen over src/abi.h (needs libibverbs-dev and librdmacm-dev)")
        .to_string();
    // rdma-core >= 45 headers: `ibv_qp_ex::wr_flush` exists, so the plugin
    // can fill it in (and accept IBV_QP_EX_WITH_FLUSH).
    println!("cargo:rustc-check-cfg=cfg(has_wr_flush)");
    if bindings.contains("pub wr_flush:") {
        println!("cargo:rustc-cfg=has_wr_flush");
    }
    std::fs::write(out.join("abi.rs"), bindings).expect("write bindings");

    println!("cargo:rustc-link-lib=ibverbs");

    // rdma_cm: librdmacm's symbol versions for the names src/cm/exports.rs
    // gives its functions (the library can stand in for librdmacm.so.1).
    let map = manifest.join("src/cm/librdmacm.map");
    println!("cargo:rerun-if-changed={}", map.display());
    println!(
        "cargo:rustc-cdylib-link-arg=-Wl,--version-script={}",
        map.display()
    );
}
