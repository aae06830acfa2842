//! Devices, contexts and protection domains over both backends.

use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, Mutex, Weak};

use serde::Serialize;
use tracing::debug;

use crate::caps::{Capabilities, OpKind, OpSet, PostPath};
use crate::cq::CompletionQueue;
use crate::error::{Error, Result};
use crate::ibv;
use crate::mr::{Access, MemoryRegion, MrInner};
pub use provider::engine::{ParseProgressError, Progress, PROGRESS_ENV};

/// The name of the userspace provider's device.
pub const USERSPACE_DEVICE: &str = "stag0";

/// The environment variable that names the default device.
pub const DEVICE_ENV: &str = "STAG_DEVICE";

/// Which implementation runs a device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Backend {
    /// stag's userspace iWARP provider over TCP.
    Userspace,
    /// A libibverbs device (physical RNIC, rxe, siw, …).
    Ibverbs,
}

/// A device as listed by [`devices`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct DeviceInfo {
    /// Name to open it by.
    pub name: String,
    /// Who runs it.
    pub backend: Backend,
    /// Transport as the device reports it.
    pub transport: String,
}

/// Every device: libibverbs devices first, then the userspace provider.
pub fn devices() -> Vec<DeviceInfo> {
    let mut out: Vec<DeviceInfo> = match ibv::devices() {
        Ok(list) => list
            .into_iter()
            .map(|d| DeviceInfo {
                name: d.name,
                backend: Backend::Ibverbs,
                transport: format!("{:?}", d.transport),
            })
            .collect(),
        Err(e) => {
            debug!(error = %e, "no libibverbs devices");
            Vec::new()
        }
    };
    out.push(DeviceInfo {
        name: USERSPACE_DEVICE.to_owned(),
        backend: Backend::Userspace,
        transport: "iWARP (userspace)".to_owned(),
    });
    out
}

/// The device to use when none is named: `$STAG_DEVICE`, else the first
/// libibverbs device, else the userspace provider.
pub fn default_device() -> String {
    if let Ok(name) = std::env::var(DEVICE_ENV) {
        if !name.is_empty() {
            return name;
        }
    }
    devices()
        .into_iter()
        .next()
        .map(|d| d.name)
        .unwrap_or_else(|| USERSPACE_DEVICE.to_owned())
}

/// Options for opening a device.
#[derive(Debug, Clone, Default)]
pub struct ContextOptions {
    /// Run these operations through the emulation layer even where the
    /// device has them natively (for tests and cost measurements).
    pub force_emulation: Vec<OpKind>,
    /// Post with `ibv_post_send` even where the provider has the extended
    /// `ibv_wr_*` API (to compare the two paths).
    pub legacy_post: bool,
    /// Userspace provider only: run as an RFC 5040 RNIC, as kernel siw
    /// does — no Atomics, Immediate Data or Commit on the wire (they are
    /// emulated as on siw, and peers' requests for them are refused with a
    /// Terminate). Lets one machine test what a siw peer means.
    pub rfc5040_only: bool,
    /// Userspace provider only: how its progress engine waits for input
    /// (`None`: `$STAG_PROGRESS`, else adaptive). See [`Progress`].
    pub progress: Option<Progress>,
}

/// An open device.
#[derive(Debug, Clone)]
pub struct Context {
    inner: Arc<ContextInner>,
}

#[derive(Debug)]
struct ContextInner {
    name: String,
    backend: ContextBackend,
    caps: Capabilities,
    /// The device's own matrix (no forced emulation), which connections
    /// resolve against their peer.
    device_caps: Capabilities,
    /// Operations the options forced through emulation.
    forced: Vec<OpKind>,
    /// The `send_ops_flags` its QPs are created with (`None`: legacy
    /// `ibv_create_qp` and `ibv_post_send`).
    wr_ops: Option<ibv::SendOps>,
    /// Regions by rkey, for the agent executing a peer's requests.
    mrs: Mutex<HashMap<u32, Weak<MrInner>>>,
}

#[derive(Debug)]
pub(crate) enum ContextBackend {
    User(provider::device::Device),
    Ibv(Arc<ibv::Context>),
}

impl Context {
    /// Open a device by name.
    pub fn open(name: &str) -> Result<Context> {
        Self::open_with(name, &ContextOptions::default())
    }

    /// Open the default device ([`default_device`]).
    pub fn open_default() -> Result<Context> {
        Self::open(&default_device())
    }

    /// Open a device with options.
    pub fn open_with(name: &str, options: &ContextOptions) -> Result<Context> {
        let (backend, mut caps, mut wr_ops) = if name == USERSPACE_DEVICE {
            let progress = options.progress.unwrap_or_else(Progress::from_env);
            let dev = provider::device::Device::open_with(name, progress)?;
            let caps = if options.rfc5040_only {
                Capabilities::userspace_rfc5040(name)
            } else {
                Capabilities::userspace(name)
            };
            (ContextBackend::User(dev), caps, None)
        } else {
            // librdmacm's own context, so that QPs created on rdma_cm ids
            // share it with our PDs and CQs.
            let ctx = ibv::Context::open_for_cm(name).map_err(|e| {
                if e.errno == libc::ENODEV {
                    Error::NoDevice(name.to_owned())
                } else {
                    e.into()
                }
            })?;
            let attr = ctx.query_device()?;
            let caps = Capabilities::ibverbs(name, &attr);
            let mut ops = attr.wr_ops;
            if caps.get(OpKind::AtomicWrite) == &crate::caps::Support::Native {
                ops = ops | ibv::SendOps::ATOMIC_WRITE;
            }
            if caps.get(OpKind::Commit).is_native() {
                ops = ops | ibv::SendOps::FLUSH;
            }
            let wr_ops = attr.wr_api().then_some(ops);
            (ContextBackend::Ibv(ctx), caps, wr_ops)
        };
        if options.legacy_post && caps.post_path == PostPath::Extended {
            caps.on_legacy_post();
            wr_ops = None;
        }
        let device_caps = caps.clone();
        caps.force_emulation(&options.force_emulation);
        Ok(Context {
            inner: Arc::new(ContextInner {
                name: name.to_owned(),
                backend,
                caps,
                device_caps,
                forced: options.force_emulation.clone(),
                wr_ops,
                mrs: Mutex::new(HashMap::new()),
            }),
        })
    }

    pub(crate) fn remember_mr(&self, mr: &MemoryRegion) {
        let mut mrs = self.inner.mrs.lock().unwrap_or_else(|p| p.into_inner());
        mrs.retain(|_, w| w.strong_count() > 0);
        mrs.insert(mr.rkey(), mr.downgrade());
    }

    /// The live region with this rkey, if any.
    pub(crate) fn mr_by_rkey(&self, rkey: u32) -> Option<MemoryRegion> {
        let mrs = self.inner.mrs.lock().unwrap_or_else(|p| p.into_inner());
        mrs.get(&rkey).and_then(MemoryRegion::upgrade)
    }

    /// The device name.
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// What the device can do, natively or emulated.
    pub fn capabilities(&self) -> &Capabilities {
        &self.inner.caps
    }

    /// What the device executes natively, forced emulation aside (what a
    /// peer may send it).
    pub fn native_ops(&self) -> OpSet {
        self.inner.device_caps.native_ops()
    }

    /// The matrix of a connection to a peer whose device executes
    /// `peer_native` (`None`: the peer runs no stag).
    pub(crate) fn connection_caps(&self, peer_native: Option<OpSet>) -> Capabilities {
        self.inner
            .device_caps
            .for_connection(&self.inner.forced, peer_native)
    }

    /// Whether a peer's device FLUSH can be a Commit into its regions: a
    /// libibverbs device whose Commit is native (FLUSH global advertised
    /// and posted). Forced emulation does not change what the device
    /// executes for a peer.
    pub(crate) fn flush_target(&self) -> bool {
        matches!(self.inner.backend, ContextBackend::Ibv(_))
            && self.inner.device_caps.get(OpKind::Commit).is_native()
    }

    /// Whether its QPs run the RDMAP extensions on the wire (userspace
    /// provider; see [`ContextOptions::rfc5040_only`]).
    pub(crate) fn rdmap_extensions(&self) -> bool {
        self.inner.device_caps.get(OpKind::FetchAdd) == &crate::caps::Support::Native
    }

    /// The `send_ops_flags` QPs are created with on the extended path.
    pub(crate) fn wr_ops(&self) -> Option<ibv::SendOps> {
        self.inner.wr_ops
    }

    /// Which backend runs it.
    pub fn backend_kind(&self) -> Backend {
        match self.inner.backend {
            ContextBackend::User(_) => Backend::Userspace,
            ContextBackend::Ibv(_) => Backend::Ibverbs,
        }
    }

    pub(crate) fn backend(&self) -> &ContextBackend {
        &self.inner.backend
    }

    /// `ibv_alloc_pd`.
    pub fn alloc_pd(&self) -> Result<ProtectionDomain> {
        let backend = match &self.inner.backend {
            ContextBackend::User(dev) => PdBackend::User(dev.alloc_pd()),
            ContextBackend::Ibv(ctx) => PdBackend::Ibv(ctx.alloc_pd()?),
        };
        Ok(ProtectionDomain {
            ctx: self.clone(),
            backend: Arc::new(backend),
        })
    }

    /// `ibv_create_cq` with room for `depth` completions.
    pub fn create_cq(&self, depth: u32) -> Result<CompletionQueue> {
        CompletionQueue::new(self, depth)
    }

    pub(crate) fn same(&self, other: &Context) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }
}

/// A protection domain.
#[derive(Debug, Clone)]
pub struct ProtectionDomain {
    ctx: Context,
    backend: Arc<PdBackend>,
}

#[derive(Debug)]
pub(crate) enum PdBackend {
    User(provider::device::ProtectionDomain),
    Ibv(Arc<ibv::ProtectionDomain>),
}

impl ProtectionDomain {
    /// The device context.
    pub fn context(&self) -> &Context {
        &self.ctx
    }

    pub(crate) fn backend(&self) -> &PdBackend {
        &self.backend
    }

    /// Identifies the PD (regions remember it for the agent's PD check).
    pub(crate) fn key(&self) -> usize {
        Arc::as_ptr(&self.backend) as usize
    }

    /// Allocate and register `len` zeroed bytes.
    pub fn alloc_mr(&self, len: usize, access: Access) -> Result<MemoryRegion> {
        MemoryRegion::alloc(self, len, access)
    }

    /// Map and register `len` bytes of a file: a durable region.
    pub fn alloc_file_mr(&self, path: &Path, len: usize, access: Access) -> Result<MemoryRegion> {
        MemoryRegion::alloc_file(self, path, len, access)
    }
}
