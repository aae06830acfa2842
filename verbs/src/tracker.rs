//! The one table of posted work requests.
//!
//! Every WR a backend sees is first an entry here: the entry holds the
//! [`Slice`]s it names (and so their regions) until its completion is
//! taken, so safe code can never unmap memory a device may still touch.
//! The entry's token is the device's wr_id. A [`SendPost`] or [`RecvPost`]
//! — the only things a backend posts — can only be made from a
//! [`Ticket`], which only [`Tracker::insert`] makes: a backend's `post` is
//! safe because of this module.
//!
//! Entries live in a slab (index and generation in the token), so a post
//! allocates nothing once the slab has grown to the queue's depth, and a
//! stale or foreign token finds nothing.

use std::ops::ControlFlow;
use std::sync::Mutex;

use smallvec::SmallVec;

use provider::wr::{SendOp, Sge};

use crate::mr::Slice;

/// The slices a WR holds alive: most WRs name one or two.
pub(crate) type Held = SmallVec<[Slice; 2]>;

/// SGEs as a backend takes them.
pub(crate) type Sges = SmallVec<[Sge; 4]>;

/// Bits of a token: tag (which table) | generation | index.
const INDEX_BITS: u32 = 24;
const GEN_BITS: u32 = 32;
const INDEX_MASK: u64 = (1 << INDEX_BITS) - 1;
const GEN_MASK: u64 = (1 << GEN_BITS) - 1;

/// Which table a token belongs to: a QP's send WRs (and emulation
/// steps), its own receives, or a shared receive queue's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Table {
    Qp = 0,
    Srq = 1,
    /// A QP's receive queue: its entries are a wr_id and slices only, a
    /// third of a send's entry, so a receive's post and completion move
    /// 72 octets through the table where they moved 200 (#20).
    Rq = 2,
}

impl Table {
    fn bits(self) -> u64 {
        (self as u64) << (INDEX_BITS + GEN_BITS)
    }

    /// The table a token came from.
    pub fn of(token: u64) -> Table {
        match token >> (INDEX_BITS + GEN_BITS) {
            1 => Table::Srq,
            2 => Table::Rq,
            _ => Table::Qp,
        }
    }
}

struct Slot<T> {
    generation: u32,
    entry: Option<(T, Held)>,
}

struct Slab<T> {
    slots: Vec<Slot<T>>,
    free: Vec<u32>,
    live: usize,
}

/// Posted WRs by token.
pub(crate) struct Tracker<T> {
    table: Table,
    slab: Mutex<Slab<T>>,
}

impl<T> std::fmt::Debug for Tracker<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tracker")
            .field("table", &self.table)
            .field("live", &self.len())
            .finish()
    }
}

/// A tracked entry, ready to be posted: its token and the SGEs of the
/// slices it holds.
#[derive(Debug)]
pub(crate) struct Ticket {
    token: u64,
    sges: Sges,
}

impl Ticket {
    pub fn token(&self) -> u64 {
        self.token
    }

    /// The send WR the backend posts for this entry.
    pub fn send(&self, op: SendOp, fence: bool) -> SendPost<'_> {
        SendPost {
            token: self.token,
            op,
            sges: &self.sges,
            fence,
            inline: None,
        }
    }

    /// The send WR of an inline payload, for a backend that copies it at
    /// post time ([`crate::backend::QpOps::copies_inline`]): the entry
    /// holds no memory of it.
    pub fn send_inline<'a>(&'a self, op: SendOp, fence: bool, data: &'a [u8]) -> SendPost<'a> {
        SendPost {
            token: self.token,
            op,
            sges: &[],
            fence,
            inline: Some(data),
        }
    }

    /// A send WR that posts only the first `n` SGEs (the others are held
    /// alive, not posted: an emulation step's own slot in front of the
    /// application's slice).
    pub fn send_prefix(&self, n: usize, op: SendOp, fence: bool) -> SendPost<'_> {
        SendPost {
            token: self.token,
            op,
            sges: &self.sges[..n.min(self.sges.len())],
            fence,
            inline: None,
        }
    }

    /// The receive WR the backend posts for this entry.
    pub fn recv(&self) -> RecvPost<'_> {
        RecvPost {
            token: self.token,
            sges: &self.sges,
        }
    }
}

/// A send WR for a backend: its SGEs name memory a tracker entry holds
/// until the WR's completion (fields private: made only from a
/// [`Ticket`]).
#[derive(Debug, Clone, Copy)]
pub(crate) struct SendPost<'a> {
    token: u64,
    op: SendOp,
    sges: &'a [Sge],
    fence: bool,
    /// The payload, copied by the backend before `post_send` returns
    /// (then `sges` is empty).
    inline: Option<&'a [u8]>,
}

impl<'a> SendPost<'a> {
    pub fn token(&self) -> u64 {
        self.token
    }
    pub fn op(&self) -> SendOp {
        self.op
    }
    pub fn sges(&self) -> &'a [Sge] {
        self.sges
    }
    pub fn fence(&self) -> bool {
        self.fence
    }
    pub fn inline(&self) -> Option<&'a [u8]> {
        self.inline
    }
    /// The inline payload as a gather list of one part (none without).
    pub fn inline_parts(&self) -> &[&'a [u8]] {
        self.inline.as_slice()
    }
}

/// A receive WR for a backend (see [`SendPost`]).
#[derive(Debug, Clone, Copy)]
pub(crate) struct RecvPost<'a> {
    token: u64,
    sges: &'a [Sge],
}

impl RecvPost<'_> {
    pub fn token(&self) -> u64 {
        self.token
    }
    pub fn sges(&self) -> &[Sge] {
        self.sges
    }
}

impl<T> Tracker<T> {
    pub fn new(table: Table) -> Tracker<T> {
        Tracker {
            table,
            slab: Mutex::new(Slab {
                slots: Vec::new(),
                free: Vec::new(),
                live: 0,
            }),
        }
    }

    /// Track `entry`, holding `held` until [`Tracker::remove`].
    ///
    /// This, `remove` and their `_in` halves are inlined into every
    /// caller: called, a send's 200-octet entry went through two `memcpy`
    /// calls each way (into the argument, then the slot; out of the slot,
    /// then to the caller). Inlined, it is written and read in place: 165
    /// fewer instructions per `stag lat send` round trip (callgrind; with
    /// [`Table::Rq`], the client's turnaround per message is 45 ns shorter,
    /// #20).
    #[inline(always)]
    pub fn insert(&self, entry: T, held: Held) -> Ticket {
        let mut slab = self.slab.lock().unwrap_or_else(|p| p.into_inner());
        self.insert_in(&mut slab, entry, held)
    }

    /// Track each of `entries` under one lock of the table (a post list's
    /// WRs), handing each ticket to `each` in order.
    pub fn insert_all(
        &self,
        entries: impl IntoIterator<Item = (T, Held)>,
        mut each: impl FnMut(Ticket),
    ) {
        let mut slab = self.slab.lock().unwrap_or_else(|p| p.into_inner());
        for (entry, held) in entries {
            each(self.insert_in(&mut slab, entry, held));
        }
    }

    #[inline(always)]
    fn insert_in(&self, slab: &mut Slab<T>, entry: T, held: Held) -> Ticket {
        // Pushed one by one: SmallVec's `collect` (a size hint, a reserve
        // and a general extend) cost an 8-octet Write's post 41 more
        // instructions (callgrind) for the one or two slices a WR holds.
        let mut sges = Sges::new();
        for slice in &held {
            sges.push(slice.sge());
        }
        let index = match slab.free.pop() {
            Some(i) => i,
            None => {
                slab.slots.push(Slot {
                    generation: 0,
                    entry: None,
                });
                (slab.slots.len() - 1) as u32
            }
        };
        let slot = &mut slab.slots[index as usize];
        slot.entry = Some((entry, held));
        let generation = slot.generation;
        slab.live += 1;
        Ticket {
            token: self.table.bits()
                | (u64::from(generation) & GEN_MASK) << INDEX_BITS
                | u64::from(index),
            sges,
        }
    }

    /// The entry of `token` (its completion arrived, or its post failed),
    /// if it is still here.
    #[inline(always)]
    pub fn remove(&self, token: u64) -> Option<(T, Held)> {
        let mut slab = self.slab.lock().unwrap_or_else(|p| p.into_inner());
        self.remove_in(&mut slab, token)
    }

    /// [`remove`](Self::remove) of each of `tokens` in order, under one
    /// lock of the table (a run of completions), handing each entry (or
    /// `None`, as `remove` would) to `each` until it says to stop; returns
    /// how many tokens it took. `each` runs under the table's lock: it must
    /// not reach this tracker.
    pub fn remove_each(
        &self,
        tokens: impl IntoIterator<Item = u64>,
        mut each: impl FnMut(Option<(T, Held)>) -> ControlFlow<()>,
    ) -> usize {
        let mut slab = self.slab.lock().unwrap_or_else(|p| p.into_inner());
        let mut taken = 0;
        for token in tokens {
            taken += 1;
            if each(self.remove_in(&mut slab, token)).is_break() {
                break;
            }
        }
        taken
    }

    #[inline(always)]
    fn remove_in(&self, slab: &mut Slab<T>, token: u64) -> Option<(T, Held)> {
        if Table::of(token) != self.table {
            return None;
        }
        let index = (token & INDEX_MASK) as usize;
        let generation = ((token >> INDEX_BITS) & GEN_MASK) as u32;
        let slot = slab.slots.get_mut(index)?;
        if slot.generation != generation || slot.entry.is_none() {
            return None;
        }
        let entry = slot.entry.take();
        slot.generation = slot.generation.wrapping_add(1) & GEN_MASK as u32;
        slab.free.push(index as u32);
        slab.live -= 1;
        entry
    }

    /// Entries outstanding.
    pub fn len(&self) -> usize {
        self.slab.lock().unwrap_or_else(|p| p.into_inner()).live
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_find_their_entry_once_and_stale_tokens_find_nothing() {
        let t: Tracker<u32> = Tracker::new(Table::Qp);
        let a = t.insert(1, Held::new()).token();
        let b = t.insert(2, Held::new()).token();
        assert_ne!(a, b);
        assert_eq!(t.len(), 2);
        assert_eq!(t.remove(a).map(|e| e.0), Some(1));
        assert!(t.remove(a).is_none(), "a token completes once");
        // The slot is reused under a new generation: the old token misses.
        let c = t.insert(3, Held::new()).token();
        assert_eq!(c & INDEX_MASK, a & INDEX_MASK);
        assert_ne!(c, a);
        assert!(t.remove(a).is_none());
        assert_eq!(t.remove(c).map(|e| e.0), Some(3));
        assert_eq!(t.remove(b).map(|e| e.0), Some(2));
        assert_eq!(t.len(), 0);
    }

    /// A list inserted under one lock gets the tickets one by one would:
    /// distinct tokens, in order, each finding its own entry.
    #[test]
    fn a_list_inserted_at_once_finds_each_entry() {
        let t: Tracker<u32> = Tracker::new(Table::Qp);
        let lone = t.insert(0, Held::new()).token();
        let mut tokens = Vec::new();
        t.insert_all((1..=5).map(|i| (i, Held::new())), |ticket| {
            tokens.push(ticket.token())
        });
        assert_eq!(t.len(), 6);
        assert!(!tokens.contains(&lone));
        for (i, tok) in tokens.iter().enumerate() {
            assert_eq!(t.remove(*tok).map(|e| e.0), Some(i as u32 + 1));
        }
        assert_eq!(t.remove(lone).map(|e| e.0), Some(0));
        assert_eq!(t.len(), 0);
    }

    /// A run removed under one lock finds each live entry once, in order,
    /// misses stale and foreign tokens as `remove` does, and stops where
    /// told, leaving the tokens after that in the table.
    #[test]
    fn a_run_removed_at_once_finds_each_entry_until_told_to_stop() {
        let t: Tracker<u32> = Tracker::new(Table::Qp);
        let tokens: Vec<u64> = (0..5).map(|i| t.insert(i, Held::new()).token()).collect();
        assert!(t.remove(tokens[1]).is_some());
        let foreign = Table::Srq.bits() | (tokens[0] & INDEX_MASK);
        let run = [
            tokens[0], tokens[1], foreign, tokens[2], tokens[3], tokens[4],
        ];
        let mut seen = Vec::new();
        let taken = t.remove_each(run, |entry| {
            let entry = entry.map(|e| e.0);
            seen.push(entry);
            if entry == Some(3) {
                ControlFlow::Break(())
            } else {
                ControlFlow::Continue(())
            }
        });
        assert_eq!(taken, 5);
        assert_eq!(seen, [Some(0), None, None, Some(2), Some(3)]);
        assert_eq!(t.len(), 1);
        assert!(t.remove(tokens[3]).is_none(), "removed once");
        assert_eq!(t.remove(tokens[4]).map(|e| e.0), Some(4));
    }

    #[test]
    fn tables_do_not_take_each_others_tokens() {
        let tables = [Table::Qp, Table::Srq, Table::Rq];
        let trackers: Vec<Tracker<u32>> = tables.iter().map(|&t| Tracker::new(t)).collect();
        // The same slot index and generation in each table.
        let tokens: Vec<u64> = trackers
            .iter()
            .zip(0..)
            .map(|(t, i)| t.insert(i, Held::new()).token())
            .collect();
        for (i, &tok) in tokens.iter().enumerate() {
            assert_eq!(Table::of(tok), tables[i]);
            for (j, t) in trackers.iter().enumerate() {
                if i != j {
                    assert!(
                        t.remove(tok).is_none(),
                        "{:?} took a {:?} token",
                        tables[j],
                        tables[i]
                    );
                }
            }
        }
        for (i, t) in trackers.iter().enumerate() {
            assert_eq!(t.remove(tokens[i]).map(|e| e.0), Some(i as u32));
        }
    }

    #[test]
    fn the_slab_stops_growing_at_the_depth_in_use() {
        let t: Tracker<u64> = Tracker::new(Table::Qp);
        for round in 0..1000u64 {
            let toks: Vec<u64> = (0..8)
                .map(|i| t.insert(round * 8 + i, Held::new()).token())
                .collect();
            for tok in toks {
                assert!(t.remove(tok).is_some());
            }
        }
        assert_eq!(t.slab.lock().unwrap().slots.len(), 8);
    }
}
