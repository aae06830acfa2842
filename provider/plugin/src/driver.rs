//! Registration with libibverbs and the device object.
//!
//! libibverbs finds devices in sysfs (here: the tree `stag run` or
//! `stag install` wrote under `$SYSFS_PATH`) and asks every registered
//! driver whether it takes each one. Ours takes the devices whose ibdev
//! name starts with `stag`.

use std::ffi::{c_char, CStr};
use std::ptr;

use crate::ffi::{
    verbs_device, verbs_device_ops, verbs_match_ent, verbs_match_ent__bindgen_ty_1,
    verbs_register_driver_34, verbs_sysfs_dev,
};

/// The driver's ops table; a `static` because libibverbs keeps the pointer
/// for the life of the process.
#[repr(transparent)]
struct DeviceOps(verbs_device_ops);

// SAFETY: the table is immutable and its pointers (a string literal and
// functions) are valid from any thread.
unsafe impl Sync for DeviceOps {}

/// A match table that matches nothing (its sentinel alone): the devices
/// are taken by [`match_device`]. It may not be NULL: libibverbs walks
/// every driver's table, unchecked, for each device that netlink reports
/// with a driver id (any kernel RDMA device), so with no table a program
/// that loaded the plugin from the driver directory (`stag install`) on
/// a machine with rxe0 or siw0 died in `ibv_get_device_list`.
#[repr(transparent)]
struct MatchTable([verbs_match_ent; 1]);

// SAFETY: immutable, and its one pointer is NULL.
unsafe impl Sync for MatchTable {}

static MATCH_NOTHING: MatchTable = MatchTable([verbs_match_ent {
    driver_data: ptr::null_mut(),
    u: verbs_match_ent__bindgen_ty_1 { driver_id: 0 },
    vendor: 0,
    device: 0,
    kind: 0, // VERBS_MATCH_SENTINEL
}]);

static DEVICE_OPS: DeviceOps = DeviceOps(verbs_device_ops {
    name: c"stag".as_ptr(),
    match_min_abi_version: 0,
    match_max_abi_version: u32::MAX,
    match_table: &MATCH_NOTHING.0[0],
    static_providers: ptr::null_mut(),
    match_device: Some(match_device),
    alloc_context: Some(crate::ops::alloc_context),
    import_context: None,
    alloc_device: Some(alloc_device),
    uninit_device: Some(uninit_device),
});

/// Runs when the library is loaded (preloaded by `stag run`, or dlopened by
/// libibverbs from its driver directory): hand libibverbs the driver.
extern "C" fn register_driver() {
    crate::log::init();
    // SAFETY: DEVICE_OPS lives for the whole process, as libibverbs requires.
    unsafe { verbs_register_driver_34(&DEVICE_OPS.0) };
}

#[used]
#[link_section = ".init_array"]
static REGISTER_DRIVER: extern "C" fn() = register_driver;

unsafe extern "C" fn match_device(sysfs_dev: *mut verbs_sysfs_dev) -> bool {
    crate::errno::guard("match_device", false, || {
        if sysfs_dev.is_null() {
            return false;
        }
        // SAFETY: libibverbs passes a valid verbs_sysfs_dev whose ibdev_name
        // is a NUL-terminated array inside it.
        let name = unsafe { CStr::from_ptr((*sysfs_dev).ibdev_name.as_ptr() as *const c_char) };
        name.to_bytes().starts_with(b"stag")
    })
}

unsafe extern "C" fn alloc_device(_sysfs_dev: *mut verbs_sysfs_dev) -> *mut verbs_device {
    crate::errno::guard("alloc_device", ptr::null_mut(), || {
        // libibverbs fills in the names, node and transport type, ops and
        // refcount after this returns; everything else starts zeroed.
        // SAFETY: verbs_device is plain C data for which all-zero is valid.
        let dev: Box<verbs_device> = Box::new(unsafe { std::mem::zeroed() });
        Box::into_raw(dev)
    })
}

unsafe extern "C" fn uninit_device(dev: *mut verbs_device) {
    crate::errno::guard("uninit_device", (), || {
        if !dev.is_null() {
            // SAFETY: allocated by alloc_device; libibverbs calls this once,
            // when the last reference is put.
            drop(unsafe { Box::from_raw(dev) });
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// libibverbs reads the table of every driver, without a NULL check,
    /// for each device netlink reports: it must be there and end at once.
    #[test]
    fn match_table_is_a_lone_sentinel() {
        let table = DEVICE_OPS.0.match_table;
        assert!(!table.is_null());
        // SAFETY: points at MATCH_NOTHING, a static.
        assert_eq!(unsafe { (*table).kind }, 0, "VERBS_MATCH_SENTINEL first");
    }
}
