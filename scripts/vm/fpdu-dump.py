#!/usr/bin/env python3
"""Decode the iWARP streams in a pcap (as scripts/vm/interop.sh writes them
with STAG_INTEROP_PCAP=DIR): per TCP direction, the MPA Request/Reply and
then every FPDU's length, DDP/RDMAP control, opcode, header and CRC field.

    scripts/vm/fpdu-dump.py CAPTURE.pcap [MAX_FPDUS_PER_STREAM]

Assumes an unmarked stream (no MPA markers: siw never uses them) and a
capture without lost segments. Standard library only.
"""
import struct
import sys

OPS = {0: "Write", 1: "ReadReq", 2: "ReadResp", 3: "Send", 4: "SendInv",
       5: "SendSE", 6: "SendSEInv", 7: "Terminate"}


def streams(path):
    """Reassembled payload bytes per (sport, dport), from the SYN on."""
    d = open(path, "rb").read()
    (magic,) = struct.unpack("<I", d[:4])
    if magic != 0xA1B2C3D4:
        sys.exit(f"{path}: not a little-endian microsecond pcap")
    (linktype,) = struct.unpack("<I", d[20:24])
    skip = {1: 14, 113: 16, 276: 20}.get(linktype, 0)
    off, segs = 24, {}
    while off + 16 <= len(d):
        _, _, caplen, _ = struct.unpack("<IIII", d[off:off + 16])
        p = d[off + 16 + skip:off + 16 + caplen]
        off += 16 + caplen
        if len(p) < 20 or p[0] >> 4 != 4 or p[9] != 6:
            continue
        ihl = (p[0] & 15) * 4
        (total,) = struct.unpack(">H", p[2:4])
        t = p[ihl:total]
        sport, dport, seq = struct.unpack(">HHI", t[:8])
        s = segs.setdefault((sport, dport), {"isn": None, "data": {}})
        if t[13] & 2:  # SYN
            s["isn"] = seq + 1
            continue
        payload = t[(t[12] >> 4) * 4:]
        if payload:
            s["data"].setdefault(seq, payload)
    out = {}
    for key, s in segs.items():
        if s["isn"] is None:
            continue
        buf, nxt = bytearray(), s["isn"]
        for seq in sorted(s["data"]):
            pay = s["data"][seq]
            if seq > nxt:
                print(f"{key}: gap in the capture at {nxt}", file=sys.stderr)
                break
            buf += pay[nxt - seq:]
            nxt = max(nxt, seq + len(pay))
        out[key] = bytes(buf)
    return out


def dump(b, name, limit):
    if b[:4] == b"MPA ":
        flags, pdlen = struct.unpack(">HH", b[16:20])
        print(f"{name} {b[:16].decode()} flags {flags:04x} pd_len {pdlen} "
              f"pd {b[20:20 + pdlen].hex()}")
        b = b[20 + pdlen:]
    off = n = 0
    while off + 4 <= len(b) and n < limit:
        ulen, ctl = struct.unpack(">HH", b[off:off + 4])
        end = 2 + ulen
        pad = -end % 4
        op = ctl & 15
        hlen = {1: 48, 7: 28}.get(op, 16 if ctl & 0x8000 else 20)
        fr = b[off:off + end + pad + 4]
        print(f"{name} len {ulen} ctl {ctl:04x} {OPS.get(op, op)} "
              f"T{int(bool(ctl & 0x8000))} L{int(bool(ctl & 0x4000))} "
              f"hdr {fr[:min(hlen, end)].hex()} pad {pad} crc {fr[-4:].hex()}")
        off += end + pad + 4
        n += 1
    if off < len(b) and n < limit:
        print(f"{name} {len(b) - off} trailing bytes: {b[off:off + 64].hex()}")


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    limit = int(sys.argv[2]) if len(sys.argv) > 2 else 1 << 30
    for (sport, dport), b in streams(sys.argv[1]).items():
        print(f"--- {sport} > {dport}: {len(b)} bytes")
        dump(b, f"{sport}>{dport}", limit)


if __name__ == "__main__":
    main()
