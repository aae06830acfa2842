//! RC's ordering rule for one send queue: completions come out in posting
//! order, whatever path each work request took (native, the CmpSwap loop,
//! the peer's agent, the mailbox). A WR that finishes early waits behind
//! an earlier one still out; an unsignaled success releases its place
//! without a completion.

use std::collections::VecDeque;

use crate::cq::Completion;

/// Send-queue sequence numbers and what has finished.
#[derive(Debug, Default)]
pub(crate) struct SendOrder {
    /// The sequence number of `done[0]`.
    released: u64,
    /// Per outstanding sequence number: `None` still out, `Some(c)`
    /// finished (`c` its completion, if it has one).
    done: VecDeque<Option<Option<Completion>>>,
}

impl SendOrder {
    /// The next WR's place.
    pub fn next(&mut self) -> u64 {
        self.done.push_back(None);
        self.released + self.done.len() as u64 - 1
    }

    /// WR `seq` finished; completions now in order go to `out`.
    pub fn finish(
        &mut self,
        seq: u64,
        completion: Option<Completion>,
        out: &mut impl Extend<Completion>,
    ) {
        let Some(i) = seq.checked_sub(self.released) else {
            return;
        };
        if i == 0 && self.done.len() == 1 && self.done[0].is_none() {
            // The only WR out finished (a ping-pong's every WR): it leaves
            // at once, not through its slot (#20: moving the completion in
            // and out of the slot was half of this call).
            self.done.clear();
            self.released += 1;
            if let Some(c) = completion {
                // An array, which the queue extends by its exact length
                // (an `Option` went through the general extend).
                out.extend([c]);
            }
            return;
        }
        match self.done.get_mut(i as usize) {
            Some(slot @ None) => *slot = Some(completion),
            // Finished twice or never placed: the first word stands.
            _ => return,
        }
        while let Some(Some(_)) = self.done.front() {
            if let Some(Some(c)) = self.done.pop_front() {
                out.extend(c);
            }
            self.released += 1;
        }
    }

    /// WRs placed and not yet released.
    #[cfg(test)]
    pub fn outstanding(&self) -> usize {
        self.done.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cq::tests::{c, ids};

    #[test]
    fn a_late_wr_holds_back_later_ones_then_all_leave_in_order() {
        let mut o = SendOrder::default();
        let s: Vec<u64> = (0..4).map(|_| o.next()).collect();
        let mut out = Vec::new();
        o.finish(s[1], Some(c(1)), &mut out);
        o.finish(s[3], Some(c(3)), &mut out);
        assert!(out.is_empty(), "0 is still out");
        o.finish(s[0], Some(c(0)), &mut out);
        assert_eq!(ids(&out), [0, 1]);
        o.finish(s[2], None, &mut out);
        assert_eq!(
            ids(&out),
            [0, 1, 3],
            "an unsignaled success leaves no completion"
        );
        assert_eq!(o.outstanding(), 0);
    }

    #[test]
    fn a_lone_wr_leaves_at_once_and_numbering_goes_on() {
        let mut o = SendOrder::default();
        let mut out = Vec::new();
        let a = o.next();
        o.finish(a, None, &mut out);
        assert!(out.is_empty(), "an unsignaled success leaves nothing");
        assert_eq!(o.outstanding(), 0);
        let b = o.next();
        assert_eq!(b, a + 1, "numbers go on after a lone release");
        o.finish(b, Some(c(2)), &mut out);
        let d = o.next();
        let e = o.next();
        o.finish(e, Some(c(4)), &mut out);
        assert_eq!(ids(&out), [2], "4 waits behind 3");
        o.finish(d, Some(c(3)), &mut out);
        assert_eq!(ids(&out), [2, 3, 4]);
        assert_eq!(o.outstanding(), 0);
    }

    #[test]
    fn finishing_twice_or_unknown_numbers_change_nothing() {
        let mut o = SendOrder::default();
        let a = o.next();
        let mut out = Vec::new();
        o.finish(a, Some(c(7)), &mut out);
        o.finish(a, Some(c(8)), &mut out);
        o.finish(99, Some(c(9)), &mut out);
        assert_eq!(ids(&out), [7]);
    }
}
