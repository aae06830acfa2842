//! RFC 6581 §9: how two ends turn their IRD/ORD words and RTR models into
//! the Read-queue depths each configures and the RTR message the initiator
//! sends. Pure functions of the words; [`super::Initiator`] and
//! [`super::Request`] call them during the MPA exchange.

use crate::wire::mpa::{IrdOrd, Rtr, RtrModes, IRD_ORD_NO_NEGOTIATION};
use crate::wire::{Error, Result};

/// One endpoint's own Read-queue resources and needs, the input to
/// negotiation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct LocalIrdOrd {
    /// Inbound Read requests this endpoint can hold at most (its IRD).
    pub ird: u16,
    /// Outbound Read requests the ULP would like to have outstanding.
    pub ord: u16,
    /// The fewest outbound Reads the ULP can live with (responder only): a
    /// peer IRD below this refuses the connection.
    pub min_ord: u16,
}

/// The IRD/ORD (and RTR) one end configures on its QP after negotiation;
/// the rest of what both ends agreed on is [`super::Negotiated`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Agreement {
    /// Inbound Read queue depth to configure.
    pub ird: u16,
    /// Outbound Read queue depth to configure.
    pub ord: u16,
    /// The RTR message the initiator sends (initiator), or expects to
    /// receive first (responder, `None` if the reply offers several); `None`
    /// in the client-server model.
    pub rtr: Option<Rtr>,
}

/// Responder side of RFC 6581 §9: from the initiator's IRD/ORD word, our
/// resources and the RTR models we support, the word to put in the Reply and
/// the values to configure locally.
///
/// - Our IRD is the initiator's ORD, limited by our `ird` (the initiator then
///   lowers its ORD to it); our ORD is our wanted `ord`, limited by the
///   initiator's IRD. 0x3FFF from the initiator leaves the local value alone
///   and is echoed back (§9.1).
/// - Refuses with [`Error::InsufficientIrd`] (MPA error 0x06) when the
///   initiator's IRD is below `local.min_ord`.
/// - Peer-to-peer: answers with A and one model from the intersection
///   (Write, then Read, then Send); when there is none it offers every
///   model it supports, as §9.2 requires, and the initiator decides. A
///   zero-length Read RTR raises our IRD to at least 1. Supporting no model
///   at all is a local misconfiguration: [`Error::MpaLocalCatastrophic`]
///   (0x05).
pub fn responder_negotiate(
    request: &IrdOrd,
    local: &LocalIrdOrd,
    supported: RtrModes,
) -> Result<(IrdOrd, Agreement)> {
    let mut reply = IrdOrd::default();
    let mut negotiated = Agreement {
        ird: local.ird,
        ord: local.ord,
        rtr: None,
    };
    if request.ord == IRD_ORD_NO_NEGOTIATION {
        reply.ird = IRD_ORD_NO_NEGOTIATION;
    } else {
        negotiated.ird = request.ord.min(local.ird);
        reply.ird = negotiated.ird;
    }
    if request.ird == IRD_ORD_NO_NEGOTIATION {
        reply.ord = IRD_ORD_NO_NEGOTIATION;
    } else {
        if request.ird < local.min_ord {
            return Err(Error::InsufficientIrd);
        }
        negotiated.ord = local.ord.min(request.ird);
        reply.ord = negotiated.ord;
    }
    if request.peer_to_peer {
        if supported.is_empty() {
            return Err(Error::MpaLocalCatastrophic);
        }
        reply.peer_to_peer = true;
        let common = request.rtr_modes().intersection(supported);
        match common.preferred() {
            Some(rtr) => {
                reply.set_rtr_modes(RtrModes::only(rtr));
                negotiated.rtr = Some(rtr);
            }
            None => reply.set_rtr_modes(supported),
        }
        if reply.read_rtr && negotiated.ird == 0 {
            negotiated.ird = 1;
            if reply.ird != IRD_ORD_NO_NEGOTIATION {
                reply.ird = 1;
            }
        }
    }
    Ok((reply, negotiated))
}

/// Initiator side of RFC 6581 §9 on receipt of an accepting Reply: the
/// values to configure and the RTR message to send.
///
/// - Our IRD becomes the responder's ORD, which must not exceed the IRD we
///   can hold (`local.ird`), else [`Error::InsufficientIrd`] (MPA error
///   0x06); our ORD is our wanted `ord`, at most the responder's IRD. 0x3FFF
///   from the responder leaves the local value alone (§9.1).
/// - The Reply must keep our connection model (A); in the peer-to-peer model
///   we send one of the Reply's RTR models that we offered, preferring
///   Write, then Read, then Send; none in common is [`Error::NoMatchingRtr`]
///   (MPA error 0x07).
pub fn initiator_negotiate(
    request: &IrdOrd,
    reply: &IrdOrd,
    local: &LocalIrdOrd,
) -> Result<Agreement> {
    let mut negotiated = Agreement {
        ird: local.ird,
        ord: local.ord,
        rtr: None,
    };
    if reply.ord != IRD_ORD_NO_NEGOTIATION {
        if reply.ord > local.ird {
            return Err(Error::InsufficientIrd);
        }
        negotiated.ird = reply.ord;
    }
    if reply.ird != IRD_ORD_NO_NEGOTIATION {
        negotiated.ord = local.ord.min(reply.ird);
    }
    if request.peer_to_peer != reply.peer_to_peer {
        return Err(Error::NoMatchingRtr);
    }
    if request.peer_to_peer {
        let rtr = reply
            .rtr_modes()
            .intersection(request.rtr_modes())
            .preferred()
            .ok_or(Error::NoMatchingRtr)?;
        if rtr == Rtr::ZeroLengthRead && negotiated.ord == 0 {
            // The RTR Read itself needs one outbound Read credit; the
            // responder raised its IRD for it if it offered Read.
            if reply.ird == 0 {
                return Err(Error::NoMatchingRtr);
            }
            negotiated.ord = 1;
        }
        negotiated.rtr = Some(rtr);
    }
    Ok(negotiated)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn word(ird: u16, ord: u16) -> IrdOrd {
        IrdOrd {
            ird,
            ord,
            ..IrdOrd::default()
        }
    }

    fn p2p(ird: u16, ord: u16, modes: RtrModes) -> IrdOrd {
        let mut w = IrdOrd {
            ird,
            ord,
            peer_to_peer: true,
            ..IrdOrd::default()
        };
        w.set_rtr_modes(modes);
        w
    }

    #[test]
    fn test_responder_ird_ord() {
        let local = LocalIrdOrd {
            ird: 8,
            ord: 4,
            min_ord: 0,
        };
        // Initiator ORD 16 > our IRD 8: we answer 8, it lowers its ORD.
        let (reply, n) = responder_negotiate(&word(2, 16), &local, RtrModes::SIW).unwrap();
        assert_eq!(reply, word(8, 2));
        assert_eq!((n.ird, n.ord, n.rtr), (8, 2, None));
        // Initiator ORD 3 fits: IRD 3; its IRD 10 allows our ORD 4.
        let (reply, n) = responder_negotiate(&word(10, 3), &local, RtrModes::SIW).unwrap();
        assert_eq!(reply, word(3, 4));
        assert_eq!((n.ird, n.ord), (3, 4));
        // 0x3FFF: leave local values, echo 0x3FFF.
        let (reply, n) = responder_negotiate(&word(0x3fff, 0x3fff), &local, RtrModes::SIW).unwrap();
        assert_eq!(reply, word(0x3fff, 0x3fff));
        assert_eq!((n.ird, n.ord), (8, 4));
        // ULP needs ORD 2 but the initiator's IRD is 1: refuse (0x06).
        let needy = LocalIrdOrd {
            min_ord: 2,
            ..local
        };
        assert_eq!(
            responder_negotiate(&word(1, 1), &needy, RtrModes::SIW),
            Err(Error::InsufficientIrd)
        );
    }

    #[test]
    fn test_responder_rtr() {
        let local = LocalIrdOrd {
            ird: 8,
            ord: 4,
            min_ord: 0,
        };
        let all = RtrModes {
            send: true,
            write: true,
            read: true,
        };
        let read_only = RtrModes {
            read: true,
            ..RtrModes::default()
        };
        let send_only = RtrModes {
            send: true,
            ..RtrModes::default()
        };
        // siw's request offers Write and Read: answer Write only (as siw).
        let (reply, n) = responder_negotiate(&p2p(8, 1, RtrModes::SIW), &local, all).unwrap();
        assert!(reply.peer_to_peer && reply.write_rtr && !reply.read_rtr && !reply.zero_send_rtr);
        assert_eq!(n.rtr, Some(Rtr::ZeroLengthWrite));
        // Read RTR with initiator ORD 0: our IRD becomes 1 for it.
        let (reply, n) = responder_negotiate(&p2p(8, 0, read_only), &local, all).unwrap();
        assert_eq!(reply, p2p(1, 4, read_only));
        assert_eq!((n.ird, n.rtr), (1, Some(Rtr::ZeroLengthRead)));
        // Nothing in common: offer what we support, the initiator decides.
        let (reply, n) = responder_negotiate(&p2p(8, 1, send_only), &local, RtrModes::SIW).unwrap();
        assert_eq!(reply.rtr_modes(), RtrModes::SIW);
        assert_eq!(n.rtr, None);
        // No model supported at all is a local error (0x05).
        assert_eq!(
            responder_negotiate(&p2p(8, 1, all), &local, RtrModes::default()),
            Err(Error::MpaLocalCatastrophic)
        );
        // Client-server request: no A, no flags in the reply.
        let (reply, _) = responder_negotiate(&word(8, 1), &local, all).unwrap();
        assert!(!reply.peer_to_peer && reply.rtr_modes().is_empty());
    }

    #[test]
    fn test_initiator() {
        let local = LocalIrdOrd {
            ird: 8,
            ord: 4,
            min_ord: 0,
        };
        let req = p2p(8, 4, RtrModes::SIW);
        let write_only = RtrModes {
            write: true,
            ..RtrModes::default()
        };
        let n = initiator_negotiate(&req, &p2p(2, 6, write_only), &local).unwrap();
        assert_eq!(
            n,
            Agreement {
                ird: 6,
                ord: 2,
                rtr: Some(Rtr::ZeroLengthWrite)
            }
        );
        // Responder ORD above what we can hold: 0x06.
        assert_eq!(
            initiator_negotiate(&req, &p2p(2, 9, write_only), &local),
            Err(Error::InsufficientIrd)
        );
        // 0x3FFF leaves local values alone.
        let n = initiator_negotiate(&req, &p2p(0x3fff, 0x3fff, write_only), &local).unwrap();
        assert_eq!((n.ird, n.ord), (8, 4));
        // Only Send offered back, we offered Write/Read: 0x07.
        let send_only = RtrModes {
            send: true,
            ..RtrModes::default()
        };
        assert_eq!(
            initiator_negotiate(&req, &p2p(4, 4, send_only), &local),
            Err(Error::NoMatchingRtr)
        );
        // Model mismatch: 0x07.
        assert_eq!(
            initiator_negotiate(&req, &word(4, 4), &local),
            Err(Error::NoMatchingRtr)
        );
        // Client-server: no RTR.
        let n = initiator_negotiate(&word(8, 4), &word(4, 4), &local).unwrap();
        assert_eq!(
            n,
            Agreement {
                ird: 4,
                ord: 4,
                rtr: None
            }
        );
    }

    /// Responder and initiator together agree on both ends.
    #[test]
    fn test_negotiation_round_trip() {
        let initiator = LocalIrdOrd {
            ird: 4,
            ord: 0,
            min_ord: 0,
        };
        let responder = LocalIrdOrd {
            ird: 16,
            ord: 2,
            min_ord: 1,
        };
        let read_only = RtrModes {
            read: true,
            ..RtrModes::default()
        };
        let request = p2p(initiator.ird, initiator.ord, read_only);
        let (reply, r) = responder_negotiate(&request, &responder, RtrModes::SIW).unwrap();
        let i = initiator_negotiate(&request, &reply, &initiator).unwrap();
        assert_eq!(i.rtr, Some(Rtr::ZeroLengthRead));
        assert_eq!(r.rtr, Some(Rtr::ZeroLengthRead));
        assert!(i.ord <= r.ird && r.ord <= i.ird);
        assert_eq!((i.ird, i.ord, r.ird, r.ord), (2, 1, 1, 2));
    }
}
