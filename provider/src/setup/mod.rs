//! MPA connection setup (RFC 5044 §7 with RFC 6581's enhanced mode), sans-IO.
//!
//! The initiator sends an MPA Request and waits for the Reply; the responder
//! reads the Request, lets the application decide, and answers with an
//! accepting or rejecting Reply. What both agreed on is a [`Negotiated`],
//! from which [`crate::qp::Connection`] is built. In peer-to-peer mode the
//! initiator then sends the RTR frame and the responder sends nothing until
//! it has arrived (RFC 6581 §4). The IRD/ORD and RTR rules themselves live
//! in [`negotiate`].

use crate::wire::mpa::{self, Frame, FrameKind, FrameReader, FrameRepr, IrdOrd};

pub mod negotiate;
use crate::wire::{Error, Result};
use negotiate::{Agreement, LocalIrdOrd};

pub use crate::wire::mpa::{Rtr, RtrModes};

/// What the local side asks for in the MPA exchange.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MpaParams {
    /// MPA revision to offer (2 = RFC 6581 enhanced, 1 = plain RFC 5044).
    pub revision: u8,
    /// Ask for CRC32c on every FPDU.
    pub crc: bool,
    /// Ask the peer to put markers in what it sends us.
    pub markers: bool,
    /// Inbound RDMA Read / atomic / Commit requests we can hold (IRD).
    pub ird: u16,
    /// Outbound such requests we want to have outstanding (ORD).
    pub ord: u16,
    /// Peer-to-peer mode with these RTR models (revision 2 only). A
    /// responder in client-server mode still answers a peer-to-peer
    /// initiator, with any model it asks for.
    pub p2p: Option<RtrModes>,
    /// Private data for the peer (≤ 512 bytes, less the IRD/ORD word).
    pub private_data: Vec<u8>,
}

impl Default for MpaParams {
    fn default() -> Self {
        MpaParams {
            revision: 2,
            crc: true,
            markers: false,
            ird: 16,
            ord: 16,
            p2p: None,
            private_data: Vec::new(),
        }
    }
}

/// What both sides agreed on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Negotiated {
    /// We sent the MPA Request.
    pub initiator: bool,
    /// The revision in use.
    pub revision: u8,
    /// FPDUs carry a real CRC32c (otherwise the field is zero).
    pub crc: bool,
    /// We insert markers in what we send.
    pub markers_tx: bool,
    /// The peer inserts markers in what it sends.
    pub markers_rx: bool,
    /// Inbound requests we accept at once.
    pub ird: u16,
    /// Outbound requests we may have outstanding.
    pub ord: u16,
    /// Peer-to-peer RTR model, if any.
    pub rtr: Option<Rtr>,
    /// The peer's private data.
    pub peer_private_data: Vec<u8>,
}

/// The IRD/ORD word for our side.
fn word(ird: u16, ord: u16, p2p: Option<RtrModes>) -> IrdOrd {
    let modes = p2p.unwrap_or_default();
    IrdOrd {
        ird: ird.min(mpa::IRD_ORD_NO_NEGOTIATION),
        ord: ord.min(mpa::IRD_ORD_NO_NEGOTIATION),
        peer_to_peer: p2p.is_some(),
        zero_send_rtr: modes.send,
        write_rtr: modes.write,
        read_rtr: modes.read,
    }
}

/// Emit an MPA frame into a new buffer.
fn emit(repr: &FrameRepr) -> Result<Vec<u8>> {
    let mut out = vec![0u8; repr.buffer_len()];
    repr.emit(&mut Frame::new_unchecked(&mut out[..]))?;
    Ok(out)
}

/// The initiator's side of the exchange.
#[derive(Debug)]
pub struct Initiator {
    params: MpaParams,
    sent: Option<IrdOrd>,
    reader: FrameReader,
}

/// How the responder answered.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Answer {
    /// Accepted: the stream may start.
    Accepted(Negotiated),
    /// Rejected, with the responder's private data.
    Rejected(Vec<u8>),
}

impl Initiator {
    /// Start a connection: returns the state and the MPA Request to send.
    pub fn new(params: MpaParams) -> Result<(Initiator, Vec<u8>)> {
        let sent = (params.revision >= 2).then(|| word(params.ird, params.ord, params.p2p));
        let bytes = emit(&FrameRepr {
            kind: FrameKind::Request,
            markers: params.markers,
            crc: params.crc,
            reject: false,
            revision: params.revision,
            enhanced: sent,
            private_data: &params.private_data,
        })?;
        Ok((
            Initiator {
                params,
                sent,
                reader: FrameReader::new(FrameKind::Reply),
            },
            bytes,
        ))
    }

    /// Feed stream bytes; returns the answer once the whole Reply is there.
    /// Bytes after the Reply stay in `input`.
    pub fn handle_bytes(&mut self, input: &mut &[u8]) -> Result<Option<Answer>> {
        let Some(reply) = self.reader.read(input)? else {
            return Ok(None);
        };
        if reply.reject {
            return Ok(Some(Answer::Rejected(reply.private_data.to_vec())));
        }
        if reply.revision > self.params.revision {
            return Err(Error::MpaRevision(reply.revision));
        }
        let local = LocalIrdOrd {
            ird: self.params.ird,
            ord: self.params.ord,
            min_ord: 0,
        };
        let agreed = match (self.sent, reply.enhanced) {
            (Some(sent), Some(answer)) => negotiate::initiator_negotiate(&sent, &answer, &local)?,
            // A revision 1 peer negotiates nothing: both sides keep their
            // own values, and peer-to-peer is not possible.
            _ if self.params.p2p.is_some() => return Err(Error::NoMatchingRtr),
            _ => Agreement {
                ird: local.ird,
                ord: local.ord,
                rtr: None,
            },
        };
        Ok(Some(Answer::Accepted(Negotiated {
            initiator: true,
            revision: reply.revision,
            // The responder's C is the verdict (it sets C when either side
            // asked for CRC, RFC 5044 §7.1).
            crc: reply.crc || self.params.crc,
            markers_tx: reply.markers,
            markers_rx: self.params.markers,
            ird: agreed.ird,
            ord: agreed.ord,
            rtr: agreed.rtr,
            peer_private_data: reply.private_data.to_vec(),
        })))
    }
}

/// A received MPA Request, owned, for the application to judge.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    /// The request's revision.
    pub revision: u8,
    /// The initiator asks for CRC.
    pub crc: bool,
    /// The initiator asks for markers.
    pub markers: bool,
    /// The enhanced IRD/ORD word, for revision 2 with the S bit.
    pub ird_ord: Option<IrdOrd>,
    /// The initiator's private data.
    pub private_data: Vec<u8>,
}

impl Request {
    /// A reader that collects one MPA Request from the stream.
    pub fn reader() -> FrameReader {
        FrameReader::new(FrameKind::Request)
    }

    /// Own the parts of a parsed Request.
    pub fn from_repr(repr: &FrameRepr) -> Request {
        Request {
            revision: repr.revision,
            crc: repr.crc,
            markers: repr.markers,
            ird_ord: repr.enhanced,
            private_data: repr.private_data.to_vec(),
        }
    }

    /// Accept: returns what was agreed and the Reply to send. Fails (and
    /// the caller should reject) when RFC 6581's rules leave no agreement.
    pub fn accept(&self, params: &MpaParams) -> Result<(Negotiated, Vec<u8>)> {
        // Answer with the request's revision (as siw does), never more than
        // we were configured for.
        let revision = self.revision.min(params.revision.max(1));
        let local = LocalIrdOrd {
            ird: params.ird,
            ord: params.ord,
            min_ord: 0,
        };
        let (reply_word, agreed) = match self.ird_ord {
            Some(req) if revision >= 2 => {
                let supported = params.p2p.unwrap_or(RtrModes::ALL);
                let (reply, agreed) = negotiate::responder_negotiate(&req, &local, supported)?;
                if req.peer_to_peer && agreed.rtr.is_none() {
                    // No model in common: rather than guess which of our
                    // offers the initiator will pick, refuse.
                    return Err(Error::NoMatchingRtr);
                }
                (Some(reply), agreed)
            }
            _ => (
                None,
                Agreement {
                    ird: local.ird,
                    ord: local.ord,
                    rtr: None,
                },
            ),
        };
        let crc = self.crc || params.crc;
        let reply = emit(&FrameRepr {
            kind: FrameKind::Reply,
            markers: params.markers,
            crc,
            reject: false,
            revision,
            enhanced: reply_word,
            private_data: &params.private_data,
        })?;
        let neg = Negotiated {
            initiator: false,
            revision,
            crc,
            markers_tx: self.markers,
            markers_rx: params.markers,
            ird: agreed.ird,
            ord: agreed.ord,
            rtr: agreed.rtr,
            peer_private_data: self.private_data.clone(),
        };
        Ok((neg, reply))
    }

    /// Reject with `private_data`: the Reply to send before closing.
    pub fn reject(&self, private_data: &[u8]) -> Result<Vec<u8>> {
        let revision = self.revision.clamp(1, 2);
        emit(&FrameRepr {
            kind: FrameKind::Reply,
            markers: false,
            crc: false,
            reject: true,
            revision,
            enhanced: (revision >= 2 && self.ird_ord.is_some()).then(|| word(0, 0, None)),
            private_data,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn exchange(c: MpaParams, s: MpaParams) -> Result<(Negotiated, Negotiated)> {
        let (mut init, request) = Initiator::new(c)?;
        let mut reader = Request::reader();
        let mut input = &request[..];
        let req = Request::from_repr(&reader.read(&mut input)?.expect("whole request"));
        assert!(input.is_empty());
        let (resp, reply) = req.accept(&s)?;
        let mut input = &reply[..];
        match init.handle_bytes(&mut input)? {
            Some(Answer::Accepted(n)) => Ok((n, resp)),
            other => panic!("unexpected answer {other:?}"),
        }
    }

    #[test]
    fn ird_ord_meet_in_the_middle() {
        let c = MpaParams {
            ird: 4,
            ord: 8,
            ..MpaParams::default()
        };
        let s = MpaParams {
            ird: 2,
            ord: 3,
            ..MpaParams::default()
        };
        let (ci, si) = exchange(c, s).unwrap();
        // The responder holds at most 2 inbound, so we send at most 2.
        assert_eq!((si.ird, ci.ord), (2, 2));
        // The responder sends at most 3, which our IRD of 4 covers.
        assert_eq!((si.ord, ci.ird), (3, 3));
    }

    #[test]
    fn crc_and_markers_are_per_direction() {
        let c = MpaParams {
            crc: false,
            markers: true,
            ..MpaParams::default()
        };
        let s = MpaParams {
            crc: false,
            ..MpaParams::default()
        };
        let (ci, si) = exchange(c, s).unwrap();
        assert!(!ci.crc && !si.crc);
        assert!(ci.markers_rx && si.markers_tx);
        assert!(!ci.markers_tx && !si.markers_rx);
    }

    #[test]
    fn p2p_picks_one_model() {
        let read_only = RtrModes {
            read: true,
            ..RtrModes::default()
        };
        let c = MpaParams {
            p2p: Some(RtrModes::ALL),
            ..MpaParams::default()
        };
        let s = MpaParams {
            p2p: Some(read_only),
            ..MpaParams::default()
        };
        let (ci, si) = exchange(c, s).unwrap();
        assert_eq!(ci.rtr, Some(Rtr::ZeroLengthRead));
        assert_eq!(si.rtr, Some(Rtr::ZeroLengthRead));
    }

    #[test]
    fn p2p_without_common_model_is_refused() {
        let send_only = RtrModes {
            send: true,
            ..RtrModes::default()
        };
        let write_only = RtrModes {
            write: true,
            ..RtrModes::default()
        };
        let c = MpaParams {
            p2p: Some(send_only),
            ..MpaParams::default()
        };
        let s = MpaParams {
            p2p: Some(write_only),
            ..MpaParams::default()
        };
        let err = exchange(c, s).unwrap_err();
        assert_eq!(err, Error::NoMatchingRtr);
        assert_eq!(err.terminate_cause().ecode, 0x07);
    }

    #[test]
    fn reject_carries_private_data() {
        let (mut init, request) = Initiator::new(MpaParams::default()).unwrap();
        let mut input = &request[..];
        let req = Request::from_repr(&Request::reader().read(&mut input).unwrap().unwrap());
        let reply = req.reject(b"busy").unwrap();
        let mut input = &reply[..];
        assert_eq!(
            init.handle_bytes(&mut input).unwrap(),
            Some(Answer::Rejected(b"busy".to_vec()))
        );
    }

    #[test]
    fn revision_1_keeps_local_values() {
        let c = MpaParams {
            revision: 1,
            ird: 5,
            ord: 6,
            ..MpaParams::default()
        };
        let (ci, si) = exchange(c, MpaParams::default()).unwrap();
        assert_eq!((ci.revision, si.revision), (1, 1));
        assert_eq!((ci.ird, ci.ord), (5, 6));
        assert_eq!(si.rtr, None);
    }
}
