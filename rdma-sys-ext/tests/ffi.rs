//! Link, gate and NULL-pointer tests that need no RDMA device.

use rdma_sys_ext as ext;
use std::ptr;

fn header(env_path: &str) -> String {
    if env_path.is_empty() {
        return String::new();
    }
    std::fs::read_to_string(env_path).unwrap_or_else(|e| panic!("read {env_path}: {e}"))
}

fn verbs_h() -> String {
    header(env!("RDMA_SYS_EXT_VERBS_H"))
}

fn uverbs_h() -> String {
    header(env!("RDMA_SYS_EXT_IB_USER_VERBS_H"))
}

/// Number of uverbs devices the kernel exposes (0 without RDMA devices).
fn sysfs_uverbs_devices() -> i32 {
    match std::fs::read_dir("/sys/class/infiniband_verbs") {
        Ok(rd) => rd
            .filter_map(Result::ok)
            .filter(|e| e.file_name().to_string_lossy().starts_with("uverbs"))
            .count() as i32,
        Err(_) => 0,
    }
}

#[test]
fn links_and_lists_devices() {
    // SAFETY: the list is freed below, once, and not used afterwards.
    let (list, n) = unsafe { ext::ibv_get_device_list() }.expect("ibv_get_device_list");
    assert_eq!(
        n as i32,
        sysfs_uverbs_devices(),
        "device count differs from sysfs"
    );
    if !list.is_null() {
        // SAFETY: list came from ibv_get_device_list and is freed once.
        unsafe { ext::ibv_free_device_list(list) };
    }
}

#[test]
fn raw_device_list_call_links() {
    // The raw wrapper links and runs; without ib_uverbs it reports an errno
    // instead of an empty list (libibverbs behaviour).
    let mut n: i32 = -1;
    // SAFETY: n is a valid out-pointer; a non-NULL list is freed once.
    let list = unsafe { ext::stag_ibv_get_device_list(&mut n) };
    if list.is_null() {
        assert_eq!(n, 0);
        assert!(!std::path::Path::new("/sys/class/infiniband_verbs/abi_version").exists());
    } else {
        assert_eq!(n, sysfs_uverbs_devices());
        // SAFETY: as above.
        unsafe { ext::ibv_free_device_list(list) };
    }
}

/// Finds `NAME = value` (enum) or `#define NAME value` in header text and
/// evaluates the simple forms rdma-core uses: `N`, `1 << N`, `(1ULL << N)`.
/// `Some(None)`: declared without an explicit value.
fn header_value(text: &str, name: &str) -> Option<Option<u64>> {
    for line in text.lines() {
        let l = line.trim();
        let rest = if let Some(r) = l.strip_prefix("#define ") {
            r.trim_start()
        } else {
            l
        };
        let Some(after) = rest.strip_prefix(name) else {
            continue;
        };
        // Whole identifier only.
        if after.starts_with(|c: char| c.is_ascii_alphanumeric() || c == '_') {
            continue;
        }
        let expr = after.trim_start().trim_start_matches('=').trim();
        let expr = expr
            .split("/*")
            .next()
            .unwrap_or("")
            .trim()
            .trim_end_matches(',')
            .trim();
        if expr.is_empty() {
            return Some(None);
        }
        return Some(Some(
            eval(expr).unwrap_or_else(|| panic!("cannot evaluate {name} = {expr}")),
        ));
    }
    None
}

fn eval(expr: &str) -> Option<u64> {
    let e = expr
        .trim()
        .trim_start_matches('(')
        .trim_end_matches(')')
        .trim();
    let num = |s: &str| -> Option<u64> {
        let s = s.trim().trim_end_matches(['U', 'L', 'u', 'l']);
        if let Some(h) = s.strip_prefix("0x") {
            u64::from_str_radix(h, 16).ok()
        } else {
            s.parse().ok()
        }
    };
    if let Some((a, b)) = e.split_once("<<") {
        return Some(num(a)? << num(b)?);
    }
    num(e)
}

fn check_const(text: &str, name: &str, ours: u64, gate: bool) {
    match header_value(text, name) {
        Some(Some(v)) => {
            assert_eq!(ours, v, "{name}: ours {ours:#x}, header {v:#x}");
            assert!(gate, "{name} is in the header but its gate is off");
        }
        Some(None) => assert!(gate, "{name} is in the header but its gate is off"),
        None => assert!(!gate, "{name} is not in the header but its gate is on"),
    }
}

#[test]
fn capability_constants_match_headers() {
    let v = verbs_h();
    let u = uverbs_h();
    assert!(v.contains("struct ibv_qp_ex"), "verbs.h looks wrong");

    check_const(
        &u,
        "IB_UVERBS_DEVICE_FLUSH_GLOBAL",
        ext::IB_UVERBS_DEVICE_FLUSH_GLOBAL,
        ext::HAS_DEVICE_FLUSH_BITS,
    );
    check_const(
        &u,
        "IB_UVERBS_DEVICE_FLUSH_PERSISTENT",
        ext::IB_UVERBS_DEVICE_FLUSH_PERSISTENT,
        ext::HAS_DEVICE_FLUSH_BITS,
    );
    check_const(
        &u,
        "IB_UVERBS_DEVICE_ATOMIC_WRITE",
        ext::IB_UVERBS_DEVICE_ATOMIC_WRITE,
        ext::HAS_DEVICE_ATOMIC_WRITE_BIT,
    );
    check_const(
        &v,
        "IBV_ACCESS_FLUSH_GLOBAL",
        ext::IBV_ACCESS_FLUSH_GLOBAL.into(),
        ext::HAS_ACCESS_FLUSH,
    );
    check_const(
        &v,
        "IBV_ACCESS_FLUSH_PERSISTENT",
        ext::IBV_ACCESS_FLUSH_PERSISTENT.into(),
        ext::HAS_ACCESS_FLUSH,
    );
    check_const(
        &v,
        "IBV_QP_EX_WITH_FLUSH",
        ext::IBV_QP_EX_WITH_FLUSH.into(),
        ext::HAS_WR_FLUSH,
    );
    check_const(
        &v,
        "IBV_WR_FLUSH",
        ext::IBV_WR_FLUSH.into(),
        ext::HAS_WR_FLUSH,
    );
    check_const(
        &v,
        "IBV_FLUSH_GLOBAL",
        ext::IBV_FLUSH_GLOBAL.into(),
        ext::HAS_WR_FLUSH,
    );
    check_const(
        &v,
        "IBV_FLUSH_PERSISTENT",
        ext::IBV_FLUSH_PERSISTENT.into(),
        ext::HAS_WR_FLUSH,
    );
    check_const(
        &v,
        "IBV_FLUSH_RANGE",
        ext::IBV_FLUSH_RANGE.into(),
        ext::HAS_WR_FLUSH,
    );
    check_const(
        &v,
        "IBV_QP_EX_WITH_ATOMIC_WRITE",
        ext::IBV_QP_EX_WITH_ATOMIC_WRITE.into(),
        ext::HAS_WR_ATOMIC_WRITE,
    );
    check_const(
        &v,
        "IBV_WR_ATOMIC_WRITE",
        ext::IBV_WR_ATOMIC_WRITE.into(),
        ext::HAS_WR_ATOMIC_WRITE,
    );
    check_const(
        &v,
        "IBV_WC_ATOMIC_WRITE",
        ext::IBV_WC_ATOMIC_WRITE.into(),
        ext::HAS_WR_ATOMIC_WRITE,
    );

    // Always-present constants: ours (from bindgen) equal the header text.
    for (name, ours) in [
        (
            "IBV_QP_EX_WITH_RDMA_WRITE",
            u64::from(ext::IBV_QP_EX_WITH_RDMA_WRITE),
        ),
        (
            "IBV_QP_EX_WITH_ATOMIC_FETCH_AND_ADD",
            ext::IBV_QP_EX_WITH_ATOMIC_FETCH_AND_ADD.into(),
        ),
        (
            "IBV_ACCESS_REMOTE_ATOMIC",
            ext::IBV_ACCESS_REMOTE_ATOMIC.into(),
        ),
        (
            "IBV_DEVICE_PCI_WRITE_END_PADDING",
            ext::IBV_DEVICE_PCI_WRITE_END_PADDING,
        ),
    ] {
        assert_eq!(header_value(&v, name), Some(Some(ours)), "{name}");
    }
}

#[test]
fn gates_match_header_text() {
    let v = verbs_h();
    let u = uverbs_h();
    let expect_flush = v.contains("ibv_wr_flush(") && v.contains("(*wr_flush)");
    let expect_aw = v.contains("ibv_wr_atomic_write(") && v.contains("(*wr_atomic_write)");
    assert_eq!(ext::HAS_WR_FLUSH, expect_flush);
    assert_eq!(ext::HAS_WR_ATOMIC_WRITE, expect_aw);
    assert_eq!(ext::HAS_ACCESS_FLUSH, v.contains("IBV_ACCESS_FLUSH_GLOBAL"));
    assert_eq!(
        ext::HAS_DEVICE_FLUSH_BITS,
        u.contains("IB_UVERBS_DEVICE_FLUSH_GLOBAL")
    );
    assert_eq!(
        ext::HAS_DEVICE_ATOMIC_WRITE_BIT,
        u.contains("IB_UVERBS_DEVICE_ATOMIC_WRITE")
    );
    // The C wrappers were built with the same gates as the Rust side.
    // SAFETY: pure functions returning compile-time constants.
    unsafe {
        assert_eq!(ext::stag_has_ibv_wr_flush() != 0, ext::HAS_WR_FLUSH);
        assert_eq!(
            ext::stag_has_ibv_wr_atomic_write() != 0,
            ext::HAS_WR_ATOMIC_WRITE
        );
    }
    println!(
        "gates: wr_flush={} wr_atomic_write={} access_flush={} device_flush_bits={} device_atomic_write_bit={}",
        ext::HAS_WR_FLUSH,
        ext::HAS_WR_ATOMIC_WRITE,
        ext::HAS_ACCESS_FLUSH,
        ext::HAS_DEVICE_FLUSH_BITS,
        ext::HAS_DEVICE_ATOMIC_WRITE_BIT
    );
}

#[test]
fn null_provider_pointers_return_eopnotsupp() {
    // A zeroed ibv_qp_ex: every provider function pointer is NULL.
    let mut fake = ext::ibv_qp_ex::default();
    let qp: *mut ext::ibv_qp_ex = &mut fake;
    let unsup = Err(ext::Errno::UNSUPPORTED);
    let word = [0u8; 8];
    // SAFETY: qp points to a live zeroed struct; the wrappers must only read
    // the (NULL) function pointers and return EOPNOTSUPP.
    unsafe {
        assert_eq!(
            ext::ibv_wr_flush(
                qp,
                1,
                0x1000,
                8,
                ext::IBV_FLUSH_GLOBAL,
                ext::IBV_FLUSH_RANGE
            ),
            unsup
        );
        assert_eq!(ext::ibv_wr_atomic_write(qp, 1, 0x1000, &word), unsup);
        assert_eq!(ext::ibv_wr_start(qp), unsup);
        assert_eq!(ext::ibv_wr_send(qp), unsup);
        assert_eq!(ext::ibv_wr_send_imm(qp, 7), unsup);
        assert_eq!(ext::ibv_wr_rdma_write(qp, 1, 0), unsup);
        assert_eq!(ext::ibv_wr_rdma_write_imm(qp, 1, 0, 7), unsup);
        assert_eq!(ext::ibv_wr_rdma_read(qp, 1, 0), unsup);
        assert_eq!(ext::ibv_wr_atomic_fetch_add(qp, 1, 0, 1), unsup);
        assert_eq!(ext::ibv_wr_atomic_cmp_swp(qp, 1, 0, 0, 1), unsup);
        assert_eq!(ext::ibv_wr_set_sge(qp, 1, 0, 8), unsup);
        assert_eq!(ext::ibv_wr_set_sge_list(qp, 0, ptr::null()), unsup);
        assert_eq!(ext::ibv_wr_set_inline_data(qp, ptr::null_mut(), 0), unsup);
        assert_eq!(ext::ibv_wr_complete(qp), unsup);
        assert_eq!(ext::ibv_wr_abort(qp), unsup);
        // A NULL qp_ex (ibv_qp_to_qp_ex on a QP without one) is refused too.
        assert_eq!(ext::ibv_wr_flush(ptr::null_mut(), 1, 0, 8, 1, 0), unsup);
        assert_eq!(ext::ibv_wr_send(ptr::null_mut()), unsup);
    }
}

#[test]
fn null_context_ops_return_eopnotsupp() {
    // A zeroed context (all ops NULL) behind a zeroed QP and CQ.
    let mut ctx = ext::ibv_context::default();
    let mut qp = ext::ibv_qp {
        context: &mut ctx,
        ..Default::default()
    };
    let mut cq = ext::ibv_cq {
        context: &mut ctx,
        ..Default::default()
    };
    let mut swr = ext::ibv_send_wr::default();
    let mut rwr = ext::ibv_recv_wr::default();
    let mut bad_s: *mut ext::ibv_send_wr = ptr::null_mut();
    let mut bad_r: *mut ext::ibv_recv_wr = ptr::null_mut();
    let mut wc = ext::ibv_wc::default();
    // SAFETY: all pointers reference live zeroed structs; the wrappers only
    // read the NULL ops and return.
    unsafe {
        assert_eq!(
            ext::stag_ibv_post_send(&mut qp, &mut swr, &mut bad_s),
            libc::EOPNOTSUPP
        );
        assert_eq!(bad_s, &mut swr as *mut _);
        assert_eq!(
            ext::stag_ibv_post_recv(&mut qp, &mut rwr, &mut bad_r),
            libc::EOPNOTSUPP
        );
        assert_eq!(bad_r, &mut rwr as *mut _);
        let mut srq = ext::ibv_srq {
            context: &mut ctx,
            ..Default::default()
        };
        bad_r = ptr::null_mut();
        assert_eq!(
            ext::stag_ibv_post_srq_recv(&mut srq, &mut rwr, &mut bad_r),
            libc::EOPNOTSUPP
        );
        assert_eq!(bad_r, &mut rwr as *mut _);
        assert_eq!(
            ext::stag_ibv_poll_cq(&mut cq, 1, &mut wc),
            -libc::EOPNOTSUPP
        );
        assert_eq!(ext::stag_ibv_req_notify_cq(&mut cq, 0), libc::EOPNOTSUPP);
    }
}

#[test]
fn struct_sizes_are_sane() {
    // ibv_qp_ex grows with rdma-core: it ends with wr_atomic_write (and then
    // wr_flush) when the header has them.
    let base = std::mem::size_of::<ext::ibv_qp>();
    let ptr_sz = std::mem::size_of::<usize>();
    let n_ptrs = (std::mem::size_of::<ext::ibv_qp_ex>() - base - 8 - 8 - 8) / ptr_sz;
    let expected = 20 + usize::from(ext::HAS_WR_ATOMIC_WRITE) + usize::from(ext::HAS_WR_FLUSH);
    assert_eq!(n_ptrs, expected, "ibv_qp_ex function-pointer count");
}
