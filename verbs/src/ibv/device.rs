//! Devices and contexts: `ibv_get_device_list`, `ibv_open_device`,
//! `ibv_query_device(_ex)`, `ibv_query_port`.

use super::{c_chars, check, IbvError, Result};
use rdma_sys_ext as ffi;
use std::any::Any;
use std::sync::{Arc, OnceLock};

/// `enum ibv_node_type`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NodeType {
    /// `IBV_NODE_CA`: InfiniBand / RoCE channel adapter (incl. rxe).
    Ca,
    /// `IBV_NODE_RNIC`: iWARP RNIC (incl. siw, irdma in iWARP mode, cxgb4).
    Rnic,
    /// Anything else (switch, router, usNIC, unknown).
    Other(i32),
}

impl NodeType {
    fn from_raw(v: ffi::ibv_node_type) -> Self {
        match v {
            ffi::IBV_NODE_CA => NodeType::Ca,
            ffi::IBV_NODE_RNIC => NodeType::Rnic,
            o => NodeType::Other(o),
        }
    }
}

/// `enum ibv_transport_type`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transport {
    /// `IBV_TRANSPORT_IB`: InfiniBand or RoCE.
    Ib,
    /// `IBV_TRANSPORT_IWARP`.
    Iwarp,
    /// Anything else.
    Other(i32),
}

impl Transport {
    fn from_raw(v: ffi::ibv_transport_type) -> Self {
        match v {
            ffi::IBV_TRANSPORT_IB => Transport::Ib,
            ffi::IBV_TRANSPORT_IWARP => Transport::Iwarp,
            o => Transport::Other(o),
        }
    }
}

/// `enum ibv_atomic_cap`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AtomicCap {
    /// `IBV_ATOMIC_NONE`: no atomics (siw).
    None,
    /// `IBV_ATOMIC_HCA`: atomic among QPs of this device.
    Hca,
    /// `IBV_ATOMIC_GLOB`: atomic with CPU and other devices.
    Glob,
}

impl AtomicCap {
    fn from_raw(v: ffi::ibv_atomic_cap) -> Self {
        match v {
            ffi::IBV_ATOMIC_HCA => AtomicCap::Hca,
            ffi::IBV_ATOMIC_GLOB => AtomicCap::Glob,
            _ => AtomicCap::None,
        }
    }
}

/// One entry of `ibv_get_device_list`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceInfo {
    /// `ibv_get_device_name` (e.g. `rxe0`, `siw0`).
    pub name: String,
    /// `ibv_get_device_guid`, host order.
    pub guid: u64,
    /// `ibv_device::node_type`.
    pub node_type: NodeType,
    /// `ibv_device::transport_type`.
    pub transport: Transport,
}

/// RAII over the `ibv_get_device_list` array.
struct DeviceList {
    list: *mut *mut ffi::ibv_device,
    len: usize,
}

impl DeviceList {
    fn get() -> Result<Self> {
        // SAFETY: ownership of the returned list is taken by DeviceList,
        // whose Drop frees it once.
        let (list, len) = unsafe { ffi::ibv_get_device_list() }
            .map_err(|e| IbvError::new("ibv_get_device_list", e.0))?;
        Ok(DeviceList { list, len })
    }

    fn iter(&self) -> impl Iterator<Item = *mut ffi::ibv_device> + '_ {
        (0..self.len).map(move |i| {
            // SAFETY: i < len and the list holds len valid entries while
            // self is alive.
            unsafe { *self.list.add(i) }
        })
    }
}

impl Drop for DeviceList {
    fn drop(&mut self) {
        if !self.list.is_null() {
            // SAFETY: list came from ibv_get_device_list and is freed once.
            unsafe { ffi::ibv_free_device_list(self.list) };
        }
    }
}

fn device_info(dev: *mut ffi::ibv_device) -> DeviceInfo {
    // SAFETY: dev is a live entry of a device list; the name pointer is
    // valid while the list is, and we copy it immediately.
    let (name, guid, node_type, transport) = unsafe {
        let name = std::ffi::CStr::from_ptr(ffi::ibv_get_device_name(dev))
            .to_string_lossy()
            .into_owned();
        (
            name,
            u64::from_be(ffi::ibv_get_device_guid(dev)),
            (*dev).node_type,
            (*dev).transport_type,
        )
    };
    DeviceInfo {
        name,
        guid,
        node_type: NodeType::from_raw(node_type),
        transport: Transport::from_raw(transport),
    }
}

/// Lists RDMA devices. A kernel without the RDMA stack (no
/// `/sys/class/infiniband_verbs`) yields an empty list, not an error.
pub fn devices() -> Result<Vec<DeviceInfo>> {
    let list = DeviceList::get()?;
    Ok(list.iter().map(device_info).collect())
}

/// Decoded `ibv_query_device` + `ibv_query_device_ex`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceAttr {
    /// Device name.
    pub name: String,
    /// `fw_ver`.
    pub fw_ver: String,
    /// `node_guid`, host order.
    pub node_guid: u64,
    /// `vendor_id`.
    pub vendor_id: u32,
    /// `vendor_part_id`.
    pub vendor_part_id: u32,
    /// `max_qp`.
    pub max_qp: u32,
    /// `max_qp_wr`: max outstanding WRs per queue.
    pub max_qp_wr: u32,
    /// `max_sge`: max SGEs per send/recv WR.
    pub max_sge: u32,
    /// `max_sge_rd`: max SGEs per RDMA READ.
    pub max_sge_rd: u32,
    /// `max_cq`.
    pub max_cq: u32,
    /// `max_cqe`.
    pub max_cqe: u32,
    /// `max_mr`.
    pub max_mr: u32,
    /// `max_mr_size`.
    pub max_mr_size: u64,
    /// `max_pd`.
    pub max_pd: u32,
    /// `max_qp_rd_atom`: incoming RDMA READ/atomic depth.
    pub max_qp_rd_atom: u32,
    /// `max_qp_init_rd_atom`: outgoing RDMA READ/atomic depth.
    pub max_qp_init_rd_atom: u32,
    /// `atomic_cap`.
    pub atomic_cap: AtomicCap,
    /// `phys_port_cnt`.
    pub phys_port_cnt: u8,
    /// `device_cap_flags` (legacy 32 bits).
    pub device_cap_flags: u32,
    /// `device_cap_flags_ex` (0 if the extended query is unavailable).
    pub device_cap_flags_ex: u64,
    /// Whether `ibv_query_device_ex` answered (else only the legacy fields
    /// are real and every extended field reads 0 = absent).
    pub extended: bool,
    /// `IB_UVERBS_DEVICE_FLUSH_GLOBAL` (bit 38 of `device_cap_flags_ex`).
    pub flush_global: bool,
    /// `IB_UVERBS_DEVICE_FLUSH_PERSISTENT` (bit 39).
    pub flush_persistent: bool,
    /// `IB_UVERBS_DEVICE_ATOMIC_WRITE` (bit 40).
    pub atomic_write: bool,
    /// `ibv_device::node_type`.
    pub node_type: NodeType,
    /// `ibv_device::transport_type`: iWARP vs IB/RoCE.
    pub transport: Transport,
}

impl DeviceAttr {
    /// iWARP transport (RNIC node type or iWARP transport type).
    pub fn is_iwarp(&self) -> bool {
        self.transport == Transport::Iwarp || self.node_type == NodeType::Rnic
    }
}

/// Decoded `ibv_port_attr` (the fields stag uses).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PortAttr {
    /// `state` (`enum ibv_port_state`, 4 = ACTIVE).
    pub state: u32,
    /// `active_mtu` (`enum ibv_mtu`: 1 = 256 ... 5 = 4096).
    pub active_mtu: u32,
    /// `lid`.
    pub lid: u16,
    /// `gid_tbl_len`.
    pub gid_tbl_len: i32,
    /// `link_layer` (1 = IB, 2 = Ethernet).
    pub link_layer: u8,
}

/// An open device context (`ibv_open_device`), or one borrowed from a
/// librdmacm id (`cm_id->verbs`, kept alive by holding that id).
pub struct Context {
    pub(crate) ctx: *mut ffi::ibv_context,
    name: String,
    node_type: NodeType,
    transport: Transport,
    /// `Some` when the context belongs to librdmacm: keeps the owner alive
    /// and suppresses `ibv_close_device`.
    borrowed_from: Option<Arc<dyn Any + Send + Sync>>,
    attr: OnceLock<DeviceAttr>,
}

// SAFETY: libibverbs contexts are thread-safe (verbs may be called on one
// context from several threads); the Rust side only holds an immutable
// pointer and a OnceLock.
unsafe impl Send for Context {}
// SAFETY: as above.
unsafe impl Sync for Context {}

impl std::fmt::Debug for Context {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Context")
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

impl Context {
    /// Opens the device named `name` (e.g. `rxe0`).
    pub fn open(name: &str) -> Result<Arc<Context>> {
        let list = DeviceList::get()?;
        let dev = list
            .iter()
            .find(|&d| device_info(d).name == name)
            .ok_or(IbvError {
                call: "ibv_open_device",
                errno: libc::ENODEV,
            })?;
        let info = device_info(dev);
        // SAFETY: dev is a live list entry; an opened context stays valid
        // after the list is freed (libibverbs holds a device reference).
        let ctx = unsafe { ffi::ibv_open_device(dev) };
        if ctx.is_null() {
            return Err(IbvError::last("ibv_open_device"));
        }
        tracing::debug!(device = name, "opened device");
        Ok(Arc::new(Context {
            ctx,
            name: info.name,
            node_type: info.node_type,
            transport: info.transport,
            borrowed_from: None,
            attr: OnceLock::new(),
        }))
    }

    /// Wraps a context owned by librdmacm.
    ///
    /// # Safety
    /// `ctx` must be a live context that stays open as long as `owner` is
    /// alive.
    pub(crate) unsafe fn borrowed(
        ctx: *mut ffi::ibv_context,
        owner: Arc<dyn Any + Send + Sync>,
    ) -> Arc<Context> {
        // SAFETY: ctx is live per the contract; ctx->device is set by
        // libibverbs for every context.
        let info = unsafe { device_info((*ctx).device) };
        Arc::new(Context {
            ctx,
            name: info.name,
            node_type: info.node_type,
            transport: info.transport,
            borrowed_from: Some(owner),
            attr: OnceLock::new(),
        })
    }

    /// The context librdmacm itself uses for device `name`
    /// (`rdma_get_devices`): PDs, CQs and MRs made on it can be used with
    /// QPs that rdma_cm creates on its ids, which a context from
    /// [`Context::open`] cannot.
    pub fn open_for_cm(name: &str) -> Result<Arc<Context>> {
        let mut n: i32 = 0;
        // SAFETY: rdma_get_devices writes the count and returns a
        // NULL-terminated array it owns until rdma_free_devices.
        let list = unsafe { ffi::rdma_get_devices(&mut n) };
        if list.is_null() {
            return Err(IbvError::last("rdma_get_devices"));
        }
        let owner = Arc::new(CmDeviceList(list));
        for i in 0..n.max(0) as usize {
            // SAFETY: i < n entries of the array.
            let ctx = unsafe { *list.add(i) };
            if ctx.is_null() {
                break;
            }
            // SAFETY: librdmacm keeps its contexts open while the list is
            // referenced (and for the life of the library); `owner` keeps
            // the list.
            let c = unsafe { Context::borrowed(ctx, owner.clone()) };
            if c.name() == name {
                c.siw_mmap_key_guard();
                return Ok(c);
            }
        }
        Err(IbvError {
            call: "rdma_get_devices",
            errno: libc::ENODEV,
        })
    }

    /// Works around a libsiw bug, once per context: libsiw takes the mmap
    /// key `SIW_INVAL_UOBJ_KEY` (0x90000) for "no mapping", but the kernel
    /// hands out keys as page offsets in the ucontext, and page offset 144
    /// *is* 0x90000. The CQ, QP or SRQ whose queue lands there fails to
    /// create with no errno (seen as `rdma_create_qp_ex` failing for the
    /// fifth connection of a process, then `UNREACHABLE` at the peer). A
    /// CQ large enough to span offset 144 from wherever the context's
    /// mappings end, created before anything else and kept for the life
    /// of the process, makes sure no queue ever starts there.
    fn siw_mmap_key_guard(self: &Arc<Self>) {
        /// siw's `vendor_id` ("bmt").
        const SIW_VENDOR_ID: u32 = 0x0062_6d74;
        /// 32 B per siw CQE: 1 MiB, 257 pages, covering page 144 from any
        /// start below it.
        const GUARD_CQES: i32 = 32768;
        static GUARDED: std::sync::Mutex<Vec<usize>> = std::sync::Mutex::new(Vec::new());
        let Ok(attr) = self.query_device() else {
            return;
        };
        if attr.vendor_id != SIW_VENDOR_ID {
            return;
        }
        let mut guarded = GUARDED.lock().unwrap_or_else(|p| p.into_inner());
        if guarded.contains(&(self.ctx as usize)) {
            return;
        }
        let cqes = GUARD_CQES.min(attr.max_cqe.try_into().unwrap_or(GUARD_CQES));
        // SAFETY: ctx is live (librdmacm keeps its device contexts open for
        // the life of the library); no channel, no context pointer. The CQ
        // is deliberately never destroyed: it must outlive every object
        // made on this context, and the kernel frees it when the process
        // closes the device.
        let cq = unsafe {
            ffi::ibv_create_cq(
                self.ctx,
                cqes,
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                0,
            )
        };
        if cq.is_null() {
            tracing::warn!(device = %self.name, "siw mmap-key guard CQ not created");
            return;
        }
        guarded.push(self.ctx as usize);
    }

    /// Device name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Raw pointer (for the layer above; stays owned by `self`).
    pub fn as_raw(&self) -> *mut ffi::ibv_context {
        self.ctx
    }

    /// `ibv_query_device` + `ibv_query_device_ex` + a `create_qp_ex` probe.
    /// Cached after the first successful call.
    pub fn query_device(self: &Arc<Self>) -> Result<DeviceAttr> {
        if let Some(a) = self.attr.get() {
            return Ok(a.clone());
        }
        let attr = self.query_device_uncached()?;
        Ok(self.attr.get_or_init(|| attr).clone())
    }

    fn query_device_uncached(self: &Arc<Self>) -> Result<DeviceAttr> {
        // SAFETY: self.ctx is live for self's lifetime.
        let (ex, extended) = unsafe { ffi::ibv_query_device_ex(self.ctx) }
            .map_err(|e| IbvError::new("ibv_query_device_ex", e.0))?;
        let a = &ex.orig_attr;
        let u = |v: i32| u32::try_from(v).unwrap_or(0);
        let caps = ffi::CapFlagsEx::from_bits(ex.device_cap_flags_ex);
        let attr = DeviceAttr {
            name: self.name.clone(),
            fw_ver: c_chars(&a.fw_ver),
            node_guid: u64::from_be(a.node_guid),
            vendor_id: a.vendor_id,
            vendor_part_id: a.vendor_part_id,
            max_qp: u(a.max_qp),
            max_qp_wr: u(a.max_qp_wr),
            max_sge: u(a.max_sge),
            max_sge_rd: u(a.max_sge_rd),
            max_cq: u(a.max_cq),
            max_cqe: u(a.max_cqe),
            max_mr: u(a.max_mr),
            max_mr_size: a.max_mr_size,
            max_pd: u(a.max_pd),
            max_qp_rd_atom: u(a.max_qp_rd_atom),
            max_qp_init_rd_atom: u(a.max_qp_init_rd_atom),
            atomic_cap: AtomicCap::from_raw(a.atomic_cap),
            phys_port_cnt: a.phys_port_cnt,
            device_cap_flags: a.device_cap_flags,
            device_cap_flags_ex: ex.device_cap_flags_ex,
            extended,
            flush_global: caps.flush_global,
            flush_persistent: caps.flush_persistent,
            atomic_write: caps.atomic_write,
            node_type: self.node_type,
            transport: self.transport,
        };
        tracing::debug!(?attr, "query_device");
        Ok(attr)
    }

    /// `ibv_query_port`.
    pub fn query_port(&self, port: u8) -> Result<PortAttr> {
        let mut pa = ffi::ibv_port_attr::default();
        // SAFETY: ctx is live; pa is a valid out-struct of the header's size.
        let ret = unsafe { ffi::stag_ibv_query_port(self.ctx, port, &mut pa) };
        check("ibv_query_port", ret)?;
        Ok(PortAttr {
            state: pa.state,
            active_mtu: pa.active_mtu,
            lid: pa.lid,
            gid_tbl_len: pa.gid_tbl_len,
            link_layer: pa.link_layer,
        })
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        if self.borrowed_from.is_some() {
            return;
        }
        // SAFETY: ctx was opened by ibv_open_device and every child holds an
        // Arc<Context>, so none is alive any more.
        let ret = unsafe { ffi::ibv_close_device(self.ctx) };
        if ret != 0 {
            tracing::warn!(device = %self.name, ret, "ibv_close_device failed");
        }
    }
}

/// The array `rdma_get_devices` returned, freed when the last context
/// borrowed from it goes.
struct CmDeviceList(*mut *mut ffi::ibv_context);

// SAFETY: the array is only read (at creation) and freed once, on drop.
unsafe impl Send for CmDeviceList {}
// SAFETY: as for Send.
unsafe impl Sync for CmDeviceList {}

impl Drop for CmDeviceList {
    fn drop(&mut self) {
        // SAFETY: the pointer came from rdma_get_devices and is freed once.
        unsafe { ffi::rdma_free_devices(self.0) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sysfs_count() -> usize {
        std::fs::read_dir("/sys/class/infiniband_verbs")
            .map(|rd| {
                rd.filter_map(|e| e.ok())
                    .filter(|e| e.file_name().to_string_lossy().starts_with("uverbs"))
                    .count()
            })
            .unwrap_or(0)
    }

    #[test]
    fn device_list_matches_sysfs() {
        let devs = devices().expect("device list");
        assert_eq!(devs.len(), sysfs_count());
    }

    #[test]
    fn open_missing_device_is_enodev() {
        let err = Context::open("stag-no-such-device0").unwrap_err();
        assert_eq!(err.errno, libc::ENODEV);
        assert_eq!(err.call, "ibv_open_device");
    }

    #[test]
    fn decoders() {
        assert_eq!(NodeType::from_raw(ffi::IBV_NODE_RNIC), NodeType::Rnic);
        assert_eq!(NodeType::from_raw(ffi::IBV_NODE_CA), NodeType::Ca);
        assert_eq!(
            Transport::from_raw(ffi::IBV_TRANSPORT_IWARP),
            Transport::Iwarp
        );
        assert_eq!(Transport::from_raw(99), Transport::Other(99));
        assert_eq!(AtomicCap::from_raw(ffi::IBV_ATOMIC_NONE), AtomicCap::None);
        assert_eq!(AtomicCap::from_raw(ffi::IBV_ATOMIC_GLOB), AtomicCap::Glob);
    }
}
