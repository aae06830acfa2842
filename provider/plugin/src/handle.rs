//! The one place a C handle is checked, as rdma-core's rxe keeps its
//! `to_rxxx` in `rxe.h`.
//!
//! libibverbs hands every verb the pointer the application passed: NULL,
//! an object of another provider's device (a program with an mlx5 and a
//! stag0 context), or one of ours. Each object of ours is a `#[repr(C)]`
//! struct that starts with the C struct libibverbs knows ([`Object`]);
//! [`from_raw`] turns a C pointer into it after checking that the object
//! lives on a stag context, and [`context`] does the same for a context.
//! Completion channels are allocated by the plugin itself (`stag run`
//! interposes `ibv_create_comp_channel`), so they have no struct of ours
//! around them: they are ours when [`comp_channels`] holds them. rdma_cm
//! ids and event channels are librdmacm's objects, not libibverbs': their
//! one check is the registry lookup (`cm::id::Id::lookup`,
//! `cm::channel::Channel::lookup`).
//!
//! This module names no verb and no ops table: every other module may
//! use it.

use std::collections::HashMap;
use std::ptr;
use std::sync::atomic::{AtomicPtr, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use provider::device::Device;

use crate::async_events::AsyncEvents;
use crate::comp_channel::Channel;
use crate::ffi::*;

/// The plugin's context: libibverbs' `verbs_context` first, then ours.
#[repr(C)]
pub(crate) struct StagContext {
    pub(crate) vctx: verbs_context,
    pub(crate) state: *mut ContextState,
}

/// What a context holds besides libibverbs' part.
pub(crate) struct ContextState {
    /// The process's userspace RNIC.
    pub(crate) device: Device,
    /// The async event queue (`context->async_fd` is its application
    /// end). Held by the objects that post events, so that `async_fd`
    /// never reads as EOF (readable forever to a poller) while they live.
    pub(crate) async_events: Arc<AsyncEvents>,
    /// Posts IBV_EVENT_DEVICE_FATAL if the RNIC breaks
    /// ([`provider::fatal`]); registered while the context lives.
    pub(crate) _fatal: Arc<provider::fatal::FatalHook>,
}

/// The device ops table of the stag device, as read from the first device
/// libibverbs asked us to open a context on: a context is ours when its
/// device has this table. NULL until then, when no context can be ours.
static STAG_DEVICE_OPS: AtomicPtr<verbs_device_ops> = AtomicPtr::new(ptr::null_mut());

/// Note `dev` as the stag device: libibverbs called our `alloc_context`
/// on it, which it does only for devices our driver matched.
///
/// # Safety
/// `dev` is a live `ibv_device` from libibverbs.
pub(crate) unsafe fn adopt_device(dev: *const ibv_device) {
    // SAFETY: every ibv_device libibverbs hands out is the first member of
    // a verbs_device (driver.h: "Must be first").
    let ops = unsafe { (*dev.cast::<verbs_device>()).ops };
    STAG_DEVICE_OPS.store(ops.cast_mut(), Ordering::Release);
}

/// Whether `ctx` is a context of stag's device.
pub(crate) fn is_stag_context(ctx: *const ibv_context) -> bool {
    if ctx.is_null() {
        return false;
    }
    let ours = STAG_DEVICE_OPS.load(Ordering::Acquire);
    // SAFETY: a non-NULL ibv_context from libibverbs has a valid device.
    let dev = unsafe { (*ctx).device };
    if ours.is_null() || dev.is_null() {
        return false;
    }
    // SAFETY: as in adopt_device, whoever's driver made the device.
    let ops = unsafe { (*dev.cast::<verbs_device>()).ops };
    ptr::eq(ops, ours)
}

/// The [`StagContext`] of one of our contexts.
///
/// # Safety
/// `ctx` must be one of ours ([`is_stag_context`]).
pub(crate) unsafe fn stag_context(ctx: *const ibv_context) -> *mut StagContext {
    let off =
        std::mem::offset_of!(StagContext, vctx) + std::mem::offset_of!(verbs_context, context);
    // SAFETY: our contexts are StagContexts (alloc_context), and `context`
    // sits `off` bytes in.
    unsafe { ctx.cast::<u8>().sub(off).cast::<StagContext>().cast_mut() }
}

/// The plugin state of `ctx`, if it is one of our contexts.
///
/// # Safety
/// `ctx` must be NULL or a live `ibv_context` from libibverbs.
pub(crate) unsafe fn context<'a>(ctx: *const ibv_context) -> Option<&'a ContextState> {
    if !is_stag_context(ctx) {
        return None;
    }
    // SAFETY: ours (checked); `state` is set before libibverbs sees the
    // context and freed only by free_context.
    unsafe { (*stag_context(ctx)).state.as_ref() }
}

/// A C object libibverbs knows, which names its context.
pub(crate) trait CObject {
    /// The object's context.
    ///
    /// # Safety
    /// `this` is a live object from libibverbs.
    unsafe fn context_of(this: *const Self) -> *const ibv_context;
}

macro_rules! c_objects {
    ($($t:ty),*) => {$(
        impl CObject for $t {
            unsafe fn context_of(this: *const Self) -> *const ibv_context {
                // SAFETY: a live object (caller).
                unsafe { (*this).context }
            }
        }
    )*};
}
c_objects!(ibv_pd, ibv_mr, ibv_cq, ibv_qp, ibv_srq);

/// A plugin object: a `#[repr(C)]` struct that starts with the C object
/// (`Self::C`) libibverbs hands back.
///
/// # Safety
/// The implementor is `#[repr(C)]` with its `Self::C` at offset 0, and
/// every `Self::C` on a stag context was allocated as a `Self`.
pub(crate) unsafe trait Object: Sized {
    /// The C struct the application holds.
    type C: CObject;
}

/// The object of ours behind `c`, or `None` for NULL or another
/// provider's object.
///
/// # Safety
/// `c` must be NULL or a live `T::C` from libibverbs, and stay live for
/// `'a`.
pub(crate) unsafe fn from_raw<'a, T: Object>(c: *const T::C) -> Option<&'a T> {
    // SAFETY: a live object has a live context (caller).
    if c.is_null() || !is_stag_context(unsafe { T::C::context_of(c) }) {
        return None;
    }
    // SAFETY: ours (checked), and T starts with its T::C (Object).
    Some(unsafe { &*c.cast::<T>() })
}

/// The completion channels this plugin made, by channel address. A
/// channel not in here is libibverbs' own.
pub(crate) fn comp_channels() -> &'static Mutex<HashMap<usize, Arc<Channel>>> {
    static CHANNELS: OnceLock<Mutex<HashMap<usize, Arc<Channel>>>> = OnceLock::new();
    CHANNELS.get_or_init(Default::default)
}
