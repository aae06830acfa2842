//! Devices and contexts over both backends.

use std::sync::Arc;

use crate::backend::{self, ContextOps};
use crate::caps::{Capabilities, OpKind, OpSet};
use crate::error::Result;
use crate::mr::Registry;

pub use crate::backend::{Backend, ContextOptions, DeviceInfo, USERSPACE_DEVICE};
pub use provider::engine::{ParseProgressError, Progress, PROGRESS_ENV};

/// The environment variable that names the default device.
pub const DEVICE_ENV: &str = "STAG_DEVICE";

/// Every device: libibverbs devices first, then the userspace provider.
pub fn devices() -> Vec<DeviceInfo> {
    backend::devices()
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

/// An open device.
#[derive(Debug, Clone)]
pub struct Context {
    inner: Arc<ContextInner>,
}

#[derive(Debug)]
struct ContextInner {
    name: String,
    ops: Arc<dyn ContextOps>,
    caps: Capabilities,
    /// The device's own matrix (no forced emulation), which connections
    /// resolve against their peer.
    device_caps: Capabilities,
    /// Operations the options forced through emulation.
    forced: Vec<OpKind>,
    /// Regions by rkey, for the agent executing a peer's requests.
    registry: Arc<Registry>,
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
        let backend::Opened { context, mut caps } = backend::open(name, options)?;
        let device_caps = caps.clone();
        caps.force_emulation(&options.force_emulation);
        Ok(Context {
            inner: Arc::new(ContextInner {
                name: name.to_owned(),
                ops: context,
                caps,
                device_caps,
                forced: options.force_emulation.clone(),
                registry: Arc::new(Registry::default()),
            }),
        })
    }

    pub(crate) fn ops(&self) -> &Arc<dyn ContextOps> {
        &self.inner.ops
    }

    pub(crate) fn registry(&self) -> &Arc<Registry> {
        &self.inner.registry
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

    /// Which backend runs it.
    pub fn backend_kind(&self) -> Backend {
        self.inner.ops.kind()
    }

    pub(crate) fn same(&self, other: &Context) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }
}
