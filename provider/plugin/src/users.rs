//! Which objects are in use by others, so that destroying one of them
//! fails with `EBUSY`, as the kernel's uverbs does: a PD with MRs, QPs or
//! SRQs on it, a CQ that a QP completes into, an SRQ a QP receives from.
//! The C object of the user holds a [`Use`] (so it ends with
//! `ibv_destroy_qp`/`ibv_dereg_mr`, whatever the RNIC still holds).

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

/// How many objects use this one.
#[derive(Debug, Default)]
pub(crate) struct Users(AtomicU32);

/// One object's use of another, ended when dropped.
#[derive(Debug)]
pub(crate) struct Use(Arc<Users>);

impl Users {
    /// A new count, with no users.
    pub(crate) fn new() -> Arc<Users> {
        Arc::default()
    }

    /// Count one more user until the [`Use`] drops.
    pub(crate) fn hold(self: &Arc<Self>) -> Use {
        self.0.fetch_add(1, Ordering::AcqRel);
        Use(self.clone())
    }

    /// Whether anything uses the object: its destroy answers `EBUSY`.
    pub(crate) fn in_use(&self) -> bool {
        self.0.load(Ordering::Acquire) != 0
    }
}

impl Drop for Use {
    fn drop(&mut self) {
        self.0 .0.fetch_sub(1, Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn in_use_while_a_use_lives() {
        let u = Users::new();
        assert!(!u.in_use());
        let a = u.hold();
        let b = u.hold();
        assert!(u.in_use());
        drop(a);
        assert!(u.in_use());
        drop(b);
        assert!(!u.in_use());
    }
}
