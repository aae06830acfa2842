//! A running listener ([`ListenHandle`]), the connection requests it
//! holds ([`Incoming`]), and the handover of a destroyed id's listener to
//! an id that binds the same address again (see `listen.rs` for why).
//!
//! Below ids and addresses (both hold listeners): it names neither.

use std::any::Any;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use provider::device::Listener;
use provider::thread::SpawnMasked;
use tracing::debug;

use super::lock;

/// A connection request that arrived on a listening id: the child id is
/// made from it when the application takes the event.
#[derive(Debug)]
pub(crate) struct Incoming {
    /// The TCP connection with its MPA Request, waiting for accept/reject.
    pub req: provider::device::ConnRequest,
    /// Our side's address of the connection.
    pub local: std::net::SocketAddr,
}

impl Incoming {
    /// Refuse a connection request nobody will answer (its listener or
    /// child id went away): an MPA reject, which the peer reports as
    /// REJECTED, as the kernel's cm does.
    pub fn refuse(self) {
        if let Err(e) = self.req.reject(&[]) {
            debug!(error = %e, "rdma_cm: refusing a connection request failed");
        }
    }
}

/// How long a destroyed id's listener waits for an id of this process to
/// bind its address again (see the module's comment); what arrives
/// meanwhile and is not taken over waits this long to be refused. Debian's
/// ib_write_bw (4.5-0.17) sleeps 1 s between the destroy and its message
/// exchange, so its re-bind comes 1.0-1.3 s after the destroy on a loaded
/// machine: a grace of 1 s had mostly ended by then (its held connect
/// refused), and the re-bind often fell on the grace's end.
pub(crate) const HANDOVER_GRACE: Duration = Duration::from_secs(3);

/// Where the listener thread delivers: the listening id, or (retired, or
/// its id destroyed) nobody, and then requests are held.
#[derive(Debug)]
pub(crate) struct Target {
    /// The listening `Id` (named by type only where it is made, so that
    /// ids can hold listeners: `listen::target_id`).
    pub id: Weak<dyn Any + Send + Sync>,
    pub held: Vec<Incoming>,
}

/// A running listener; dropping it stops its thread, refuses what it held
/// and closes the port.
#[derive(Debug)]
pub(crate) struct ListenHandle {
    pub stop: Arc<AtomicBool>,
    pub listener: Arc<Listener>,
    pub done: mpsc::Receiver<()>,
    pub target: Arc<Mutex<Target>>,
    pub local: SocketAddr,
    /// The address and IPV6_V6ONLY it was bound with, when the
    /// application named the port: such a listener can be handed over.
    pub key: Option<(SocketAddr, bool)>,
}

impl ListenHandle {
    /// Close the port (the handshake thread ends and its socket with it);
    /// what was already accepted is still held. A retired listener's port
    /// is closed while [`RETIRED`] is locked, before it leaves the table,
    /// so that a re-bind of the address ([`take_retired`]) either takes
    /// it over or finds the port free, never still listening: bind(2)
    /// failed with EADDRINUSE when it came while the grace thread was
    /// closing the listener it had just taken out of the table (perftest's
    /// server re-binding about [`HANDOVER_GRACE`] after the destroy).
    fn close_port(&self) {
        self.stop.store(true, Ordering::Release);
        // The port closes and the thread's accept returns.
        self.listener.shutdown();
    }
}

impl Drop for ListenHandle {
    fn drop(&mut self) {
        self.close_port();
        if self.done.recv_timeout(Duration::from_secs(2)).is_err() {
            debug!("rdma_cm: the listener thread did not stop within 2 s");
        }
        for inc in std::mem::take(&mut lock(&self.target).held) {
            inc.refuse();
        }
    }
}

/// A retired listener: its key, its handle and which retirement it is.
type Retired = HashMap<(SocketAddr, bool), (u64, ListenHandle)>;

static RETIRED: Mutex<Option<Retired>> = Mutex::new(None);
static GENERATION: AtomicU64 = AtomicU64::new(0);

/// The listener of a destroyed id: retired for [`HANDOVER_GRACE`] if its
/// port was named, else closed now.
pub(crate) fn retire(handle: ListenHandle) {
    let Some(key) = handle.key else { return };
    debug!(addr = %key.0, "rdma_cm: listener retired, held for a re-bind");
    lock(&handle.target).id = Weak::<()>::new();
    let generation = GENERATION.fetch_add(1, Ordering::Relaxed);
    let mut retired = lock(&RETIRED);
    let replaced = retired
        .get_or_insert_with(HashMap::new)
        .insert(key, (generation, handle));
    if let Some((_, h)) = &replaced {
        h.close_port();
    }
    drop(retired);
    drop(replaced);
    let spawned = std::thread::Builder::new()
        .name("stag-cm-retired".into())
        .spawn_masked(move || {
            std::thread::sleep(HANDOVER_GRACE);
            let mut retired = lock(&RETIRED);
            let map = retired.get_or_insert_with(HashMap::new);
            if map.get(&key).is_some_and(|(g, _)| *g == generation) {
                let gone = map.remove(&key);
                if let Some((_, h)) = &gone {
                    h.close_port();
                }
                drop(retired);
                debug!(addr = %key.0, "rdma_cm: no id took the listener over; closing it");
                drop(gone);
            }
        });
    if spawned.is_err() {
        // No timer: close it now rather than keep the port.
        let mut retired = lock(&RETIRED);
        let gone = retired.get_or_insert_with(HashMap::new).remove(&key);
        if let Some((_, h)) = &gone {
            h.close_port();
        }
        drop(retired);
        drop(gone);
    }
}

/// For `rdma_bind_addr` of `addr` (with IPV6_V6ONLY `afonly`, sharing the
/// port if `reuse`): the retired listener bound exactly so, if any; every
/// other retired listener on the port is closed, as the kernel's port
/// would be free.
pub(crate) fn take_retired(addr: SocketAddr, afonly: bool, reuse: bool) -> Option<ListenHandle> {
    if addr.port() == 0 {
        return None;
    }
    let mut retired = lock(&RETIRED);
    let map = retired.get_or_insert_with(HashMap::new);
    let taken = if reuse {
        None
    } else {
        map.remove(&(addr, afonly)).map(|(_, h)| h)
    };
    let keys: Vec<_> = map
        .keys()
        .filter(|(a, _)| a.port() == addr.port())
        .copied()
        .collect();
    let closed: Vec<_> = keys.iter().filter_map(|k| map.remove(k)).collect();
    for (_, h) in &closed {
        h.close_port();
    }
    drop(retired);
    drop(closed);
    if taken.is_some() {
        debug!(%addr, "rdma_cm: taking over the listener a destroyed id left on this address");
    }
    taken
}
