//! Building and dissecting Ethernet/IPv6 frames for packet tables: extension headers, TCP,
//! UDP and ICMPv6, with checksums over RFC 8200's pseudo-header computed here byte by byte
//! (independently of the datapath's arithmetic).

use std::net::{Ipv6Addr, SocketAddrV6};

use crate::packet::{internet_checksum, CLIENT_MAC, NODE_MAC, TCP, UDP};

pub const ICMPV6: u8 = 58;
pub const HOP_BY_HOP: u8 = 0;
pub const ROUTING: u8 = 43;
pub const FRAGMENT: u8 = 44;
pub const DEST_OPTS: u8 = 60;
pub const ESP: u8 = 50;

/// RFC 8200 §8.1: source, destination, upper-layer length (32 bits), three zero bytes, next
/// header.
pub fn pseudo_header(src: Ipv6Addr, dst: Ipv6Addr, proto: u8, len: usize) -> Vec<u8> {
    let mut p = Vec::with_capacity(40);
    p.extend_from_slice(&src.octets());
    p.extend_from_slice(&dst.octets());
    p.extend_from_slice(&(len as u32).to_be_bytes());
    p.extend_from_slice(&[0, 0, 0, proto]);
    p
}

fn l4_checksum(src: Ipv6Addr, dst: Ipv6Addr, proto: u8, l4: &[u8]) -> u16 {
    let mut sum_in = pseudo_header(src, dst, proto, l4.len());
    sum_in.extend_from_slice(l4);
    internet_checksum(&sum_in)
}

/// A TCP segment (20-byte header, no options) with a valid checksum.
pub fn tcp_segment(src: SocketAddrV6, dst: SocketAddrV6, flags: u8, payload: &[u8]) -> Vec<u8> {
    let mut s = Vec::new();
    s.extend_from_slice(&src.port().to_be_bytes());
    s.extend_from_slice(&dst.port().to_be_bytes());
    s.extend_from_slice(&1u32.to_be_bytes());
    s.extend_from_slice(&0u32.to_be_bytes());
    s.push(5 << 4);
    s.push(flags);
    s.extend_from_slice(&64240u16.to_be_bytes());
    s.extend_from_slice(&[0, 0, 0, 0]);
    s.extend_from_slice(payload);
    let c = l4_checksum(*src.ip(), *dst.ip(), TCP, &s);
    s[16..18].copy_from_slice(&c.to_be_bytes());
    s
}

/// A UDP datagram with a valid checksum (mandatory in IPv6).
pub fn udp_datagram(src: SocketAddrV6, dst: SocketAddrV6, payload: &[u8]) -> Vec<u8> {
    let len = 8 + payload.len();
    let mut s = Vec::new();
    s.extend_from_slice(&src.port().to_be_bytes());
    s.extend_from_slice(&dst.port().to_be_bytes());
    s.extend_from_slice(&(len as u16).to_be_bytes());
    s.extend_from_slice(&[0, 0]);
    s.extend_from_slice(payload);
    let c = match l4_checksum(*src.ip(), *dst.ip(), UDP, &s) {
        0 => 0xffff,
        c => c,
    };
    s[6..8].copy_from_slice(&c.to_be_bytes());
    s
}

/// An ICMPv6 message from `src` to `dst` with a valid checksum: type, code, the header's last
/// four bytes (an MTU, a pointer, an echo's identifier and sequence) and the body (an error's
/// quote).
pub fn icmpv6_message(src: Ipv6Addr, dst: Ipv6Addr, kind: u8, code: u8, rest: [u8; 4], body: &[u8]) -> Vec<u8> {
    let mut m = vec![kind, code, 0, 0];
    m.extend_from_slice(&rest);
    m.extend_from_slice(body);
    let c = l4_checksum(src, dst, ICMPV6, &m);
    m[2..4].copy_from_slice(&c.to_be_bytes());
    m
}

/// An IPv6 packet to be framed: the fixed header, extension headers (each given as its
/// protocol number and its bytes after the next-header field), the upper-layer protocol and
/// its bytes.
#[derive(Clone, Debug)]
pub struct Ipv6 {
    pub src: Ipv6Addr,
    pub dst: Ipv6Addr,
    pub hop_limit: u8,
    pub ext: Vec<(u8, Vec<u8>)>,
    pub proto: u8,
    pub payload: Vec<u8>,
}

impl Ipv6 {
    pub fn new(src: Ipv6Addr, dst: Ipv6Addr, proto: u8, payload: Vec<u8>) -> Self {
        Self { src, dst, hop_limit: 64, ext: vec![], proto, payload }
    }

    /// With an extension header of `kind` (its bytes after the next-header byte: length and
    /// content, the whole a multiple of 8 bytes with the next-header byte).
    pub fn with_ext(mut self, kind: u8, body: Vec<u8>) -> Self {
        self.ext.push((kind, body));
        self
    }

    /// A Hop-by-Hop or Destination Options header of 8 bytes holding one PadN option.
    pub fn padding_options() -> Vec<u8> {
        vec![0, 1, 4, 0, 0, 0, 0]
    }

    /// A Fragment header's bytes after its next-header byte: reserved, offset (8-byte units)
    /// with the M flag, identification.
    pub fn fragment(offset_units: u16, more: bool, id: u32) -> Vec<u8> {
        let mut b = vec![0];
        b.extend_from_slice(&((offset_units << 3) | u16::from(more)).to_be_bytes());
        b.extend_from_slice(&id.to_be_bytes());
        b
    }

    /// Everything after the fixed header.
    fn body(&self) -> Vec<u8> {
        let mut b = Vec::new();
        for (i, (_, bytes)) in self.ext.iter().enumerate() {
            let next = self.ext.get(i + 1).map_or(self.proto, |(k, _)| *k);
            b.push(next);
            b.extend_from_slice(bytes);
        }
        b.extend_from_slice(&self.payload);
        b
    }

    /// The Ethernet frame client -> node.
    pub fn frame(&self) -> Vec<u8> {
        let body = self.body();
        let mut f = Vec::new();
        f.extend_from_slice(&NODE_MAC);
        f.extend_from_slice(&CLIENT_MAC);
        f.extend_from_slice(&[0x86, 0xdd]);
        f.extend_from_slice(&[0x60, 0, 0, 0]);
        f.extend_from_slice(&(body.len() as u16).to_be_bytes());
        f.push(self.ext.first().map_or(self.proto, |(k, _)| *k));
        f.push(self.hop_limit);
        f.extend_from_slice(&self.src.octets());
        f.extend_from_slice(&self.dst.octets());
        f.extend_from_slice(&body);
        f
    }
}

pub fn tcp_frame(src: SocketAddrV6, dst: SocketAddrV6, flags: u8) -> Vec<u8> {
    Ipv6::new(*src.ip(), *dst.ip(), TCP, tcp_segment(src, dst, flags, &[])).frame()
}

pub fn udp_frame(src: SocketAddrV6, dst: SocketAddrV6, payload: &[u8]) -> Vec<u8> {
    Ipv6::new(*src.ip(), *dst.ip(), UDP, udp_datagram(src, dst, payload)).frame()
}

#[derive(Clone, Debug)]
pub struct Dissected {
    pub src: Ipv6Addr,
    pub dst: Ipv6Addr,
    /// The upper-layer protocol, after the extension headers.
    pub proto: u8,
    /// Offset of the upper-layer header in the IPv6 packet.
    pub l4_off: usize,
    pub sport: Option<u16>,
    pub dport: Option<u16>,
    /// The upper-layer checksum over the pseudo-header; None for a non-first fragment or a
    /// first fragment (the checksum spans fragments).
    pub l4_checksum_ok: Option<bool>,
    /// ICMPv6 type and code, and the bytes after its 8-byte header.
    pub icmp: Option<(u8, u8, Vec<u8>)>,
}

impl Dissected {
    pub fn src_sock(&self) -> SocketAddrV6 {
        SocketAddrV6::new(self.src, self.sport.expect("L4 header present"), 0, 0)
    }

    pub fn dst_sock(&self) -> SocketAddrV6 {
        SocketAddrV6::new(self.dst, self.dport.expect("L4 header present"), 0, 0)
    }
}

/// Dissects an Ethernet/IPv6 frame, walking its extension headers. Panics with a description
/// if it is not one.
pub fn dissect(frame: &[u8]) -> Dissected {
    assert!(frame.len() >= 54, "frame of {} bytes is too short for Ethernet + IPv6", frame.len());
    assert_eq!(&frame[12..14], &[0x86, 0xdd], "not an IPv6 frame");
    let ip = &frame[14..];
    assert_eq!(ip[0] >> 4, 6, "IP version");
    let payload_len = usize::from(u16::from_be_bytes([ip[4], ip[5]]));
    assert!(40 + payload_len <= ip.len(), "payload length {payload_len} exceeds the bytes present");
    let ip = &ip[..40 + payload_len];
    let src = Ipv6Addr::from(<[u8; 16]>::try_from(&ip[8..24]).unwrap());
    let dst = Ipv6Addr::from(<[u8; 16]>::try_from(&ip[24..40]).unwrap());
    let (mut next, mut off, mut fragmented, mut later) = (ip[6], 40, false, false);
    while matches!(next, HOP_BY_HOP | ROUTING | DEST_OPTS | FRAGMENT) {
        let h = &ip[off..];
        if next == FRAGMENT {
            let fo = u16::from_be_bytes([h[2], h[3]]);
            fragmented = fo & 0xfff9 != 0;
            later = fo & 0xfff8 != 0;
            next = h[0];
            off += 8;
        } else {
            next = h[0];
            off += (usize::from(h[1]) + 1) * 8;
        }
    }
    let mut d = Dissected { src, dst, proto: next, l4_off: off, sport: None, dport: None, l4_checksum_ok: None, icmp: None };
    if later {
        return d;
    }
    let l4 = &ip[off..];
    match next {
        TCP | UDP => {
            d.sport = Some(u16::from_be_bytes([l4[0], l4[1]]));
            d.dport = Some(u16::from_be_bytes([l4[2], l4[3]]));
            if !fragmented {
                d.l4_checksum_ok = Some(l4_checksum(src, dst, next, l4) == 0);
            }
        }
        ICMPV6 => {
            assert_eq!(l4_checksum(src, dst, ICMPV6, l4), 0, "ICMPv6 checksum");
            d.icmp = Some((l4[0], l4[1], l4[8..].to_vec()));
        }
        _ => {}
    }
    d
}

/// The upper-layer checksum of a first fragment, given the whole reassembled payload.
pub fn l4_checksum_ok_over(src: Ipv6Addr, dst: Ipv6Addr, proto: u8, l4: &[u8]) -> bool {
    l4_checksum(src, dst, proto, l4) == 0
}

/// For fuzzing: the upper-layer protocol of a whole IPv6 frame and whether its checksum holds
/// (None: a fragment, or a protocol without one here); None when the frame is not a whole
/// IPv6 packet with its extension headers walkable.
pub fn checksum_state(frame: &[u8]) -> Option<(u8, Option<bool>)> {
    if frame.len() < 54 || frame[12..14] != [0x86, 0xdd] || frame[14] >> 4 != 6 {
        return None;
    }
    let ip = &frame[14..];
    let end = 40 + usize::from(u16::from_be_bytes([ip[4], ip[5]]));
    let ip = ip.get(..end)?;
    let src = Ipv6Addr::from(<[u8; 16]>::try_from(&ip[8..24]).ok()?);
    let dst = Ipv6Addr::from(<[u8; 16]>::try_from(&ip[24..40]).ok()?);
    let (mut next, mut off, mut fragment) = (ip[6], 40, false);
    for _ in 0..16 {
        if !matches!(next, HOP_BY_HOP | ROUTING | DEST_OPTS | FRAGMENT) {
            break;
        }
        let h = ip.get(off..off + 8)?;
        if next == FRAGMENT {
            fragment |= u16::from_be_bytes([h[2], h[3]]) & 0xfff9 != 0;
            off += 8;
        } else {
            off += (usize::from(h[1]) + 1) * 8;
        }
        next = h[0];
    }
    let l4 = ip.get(off..)?;
    let ok = match next {
        TCP if !fragment && l4.len() >= 20 => Some(l4_checksum(src, dst, next, l4) == 0),
        UDP if !fragment && l4.len() >= 8 => Some(l4_checksum(src, dst, next, l4) == 0),
        ICMPV6 if !fragment && l4.len() >= 8 => Some(l4_checksum(src, dst, next, l4) == 0),
        _ => None,
    };
    Some((next, ok))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn built_frames_dissect_with_valid_checksums_through_extension_headers() {
        let c: SocketAddrV6 = "[fd00:10:244::5]:40000".parse().unwrap();
        let s: SocketAddrV6 = "[fd00:10:96::10]:80".parse().unwrap();
        let f = Ipv6::new(*c.ip(), *s.ip(), TCP, tcp_segment(c, s, crate::packet::SYN, b"x"))
            .with_ext(HOP_BY_HOP, Ipv6::padding_options())
            .with_ext(DEST_OPTS, Ipv6::padding_options())
            .frame();
        let d = dissect(&f);
        assert_eq!((d.src_sock(), d.dst_sock(), d.l4_off), (c, s, 56));
        assert_eq!(d.l4_checksum_ok, Some(true));
        let mut bad = f.clone();
        let last = bad.len() - 1;
        bad[last] ^= 1;
        assert_eq!(dissect(&bad).l4_checksum_ok, Some(false));
    }
}
