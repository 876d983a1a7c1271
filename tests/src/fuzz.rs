//! Packet fuzzing: frames built around the Services, flows and addresses a node has, then
//! mutated (truncations, IHL and length lies, fragments, options, TCP flag combinations, ICMP
//! errors quoting garbage, VLAN tags), run through every program with BPF_PROG_TEST_RUN.
//! `tests/tests/fuzz.rs` runs a fixed seed; `cargo xtask fuzz` a longer run with a new seed.

use std::{
    collections::BTreeMap,
    fmt::Write as _,
    net::{Ipv4Addr, SocketAddrV4},
};

use crate::packet::{internet_checksum, pseudo_header, tcp_segment, udp_datagram, Ipv4, ICMP, TCP, UDP};

/// xorshift64*: small, fast, and the same sequence for a seed on every machine.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Self(seed.max(1))
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    /// 0..n
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }

    pub fn chance(&mut self, percent: usize) -> bool {
        self.below(100) < percent
    }

    pub fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.below(items.len())]
    }

    fn bytes(&mut self, n: usize) -> Vec<u8> {
        (0..n).map(|_| self.next_u64() as u8).collect()
    }
}

/// The addresses the generated frames use: those of the Services and backends the fuzz test
/// programs, so that mutations land on real services and tracked flows.
pub struct Addresses {
    pub clients: Vec<Ipv4Addr>,
    /// Service addresses (cluster IPs, the node's NodePort address, load-balancer IPs).
    pub services: Vec<Ipv4Addr>,
    pub backends: Vec<Ipv4Addr>,
    pub ports: Vec<u16>,
    /// Service frontends and backends with their ports and protocols, to build frames of real
    /// flows (a client to a Service, a backend's reply) more often than chance would.
    pub frontends: Vec<(SocketAddrV4, u8)>,
    pub endpoints: Vec<(SocketAddrV4, u8)>,
}

impl Addresses {
    fn any(&self, rng: &mut Rng) -> Ipv4Addr {
        match rng.below(10) {
            0..=2 => *rng.pick(&self.clients),
            3..=5 => *rng.pick(&self.services),
            6..=8 => *rng.pick(&self.backends),
            _ => Ipv4Addr::from(rng.next_u64() as u32),
        }
    }

    fn port(&self, rng: &mut Rng) -> u16 {
        if rng.chance(80) {
            *rng.pick(&self.ports)
        } else {
            rng.next_u64() as u16
        }
    }

    fn sock(&self, rng: &mut Rng) -> SocketAddrV4 {
        SocketAddrV4::new(self.any(rng), self.port(rng))
    }
}

const TCP_FLAG_SETS: [u8; 10] = [0x02, 0x12, 0x10, 0x18, 0x11, 0x04, 0x14, 0x01, 0x00, 0x3f];

/// One frame: a well-formed packet of some kind, then zero to three mutations. The label says
/// what was built and done, for a failure's message.
pub fn frame(rng: &mut Rng, a: &Addresses) -> (Vec<u8>, String) {
    let mut label = String::new();
    let (mut src, mut dst) = (a.sock(rng), a.sock(rng));
    let mut shape = rng.below(10);
    if rng.chance(60) {
        // A packet of a real flow: a client to a Service, or a backend's reply to a client.
        let client = SocketAddrV4::new(*rng.pick(&a.clients), *rng.pick(&[40000, 40001, 40002]));
        let (at, proto) = if rng.chance(60) { *rng.pick(&a.frontends) } else { *rng.pick(&a.endpoints) };
        (src, dst) = if rng.chance(60) { (client, at) } else { (at, client) };
        if !matches!(shape, 7 | 8) {
            shape = if proto == TCP { 0 } else { 4 };
        }
    }
    let mut ip = match shape {
        0..=3 => {
            let flags = if rng.chance(80) { *rng.pick(&TCP_FLAG_SETS) } else { rng.next_u64() as u8 };
            let payload = {
                let n = rng.below(3) * rng.below(700);
                rng.bytes(n)
            };
            let _ = write!(label, "tcp {src}->{dst} flags {flags:#x} +{}", payload.len());
            Ipv4::new(*src.ip(), *dst.ip(), TCP, tcp_segment(src, dst, flags, &payload))
        }
        4..=6 => {
            let payload = {
                let n = rng.below(600);
                rng.bytes(n)
            };
            let with_csum = rng.chance(80);
            let _ = write!(label, "udp {src}->{dst} +{} csum {with_csum}", payload.len());
            Ipv4::new(*src.ip(), *dst.ip(), UDP, udp_datagram(src, dst, &payload, with_csum))
        }
        7..=8 => {
            // An ICMP error from `dst`'s side about a datagram src -> dst (or garbage).
            let inner_proto = *rng.pick(&[TCP, UDP, ICMP, 47]);
            let inner_l4 = if inner_proto == TCP {
                tcp_segment(src, dst, 0x02, b"")[..8].to_vec()
            } else if inner_proto == UDP {
                udp_datagram(src, dst, b"q", true)[..8].to_vec()
            } else {
                rng.bytes(8)
            };
            let mut inner = Ipv4::new(*src.ip(), *dst.ip(), inner_proto, inner_l4);
            if rng.chance(20) {
                inner.options = vec![1, 1, 1, 1];
            }
            let mut quoted = inner.header();
            quoted.extend_from_slice(&inner.payload);
            if rng.chance(30) {
                let n = rng.below(quoted.len() + 1);
                quoted.truncate(n);
            }
            if rng.chance(20) {
                quoted = {
                    let n = rng.below(64);
                    rng.bytes(n)
                };
            }
            let (kind, code) = *rng.pick(&[(3u8, 3u8), (3, 4), (3, 1), (11, 0), (12, 0), (8, 0), (0, 0)]);
            let mut icmp = vec![kind, code, 0, 0, 0, 0, 0x05, 0xdc];
            icmp.extend_from_slice(&quoted);
            let c = internet_checksum(&icmp);
            icmp[2..4].copy_from_slice(&c.to_be_bytes());
            let from = a.any(rng);
            let _ = write!(label, "icmp {kind}/{code} {from}->{} quoting {inner_proto} {src}->{dst} ({} bytes)", src.ip(), quoted.len());
            Ipv4::new(from, *src.ip(), ICMP, icmp)
        }
        _ => {
            let proto = rng.next_u64() as u8;
            let _ = write!(label, "proto {proto} {}->{}", src.ip(), dst.ip());
            Ipv4::new(*src.ip(), *dst.ip(), proto, {
                let n = rng.below(80);
                rng.bytes(n)
            })
        }
    };
    if rng.chance(15) {
        let n = 4 * (1 + rng.below(10));
        ip.options = if rng.chance(50) { vec![1; n] } else { rng.bytes(n) };
        let _ = write!(label, ", {n} bytes of options");
    }
    if rng.chance(15) {
        // A fragment: first (MF), later (offset), or last; the payload cut to suit.
        ip.frag = match rng.below(3) {
            0 => 0x2000,
            1 => 0x2000 | (1 + rng.below(200)) as u16,
            _ => (1 + rng.below(200)) as u16,
        };
        if ip.frag & 0x1fff == 0 && ip.payload.len() > 16 {
            ip.payload.truncate(8 * (ip.payload.len() / 16).max(1));
        }
        let _ = write!(label, ", fragment {:#x}", ip.frag);
    }
    if rng.chance(5) {
        ip.ttl = rng.below(3) as u8;
        let _ = write!(label, ", ttl {}", ip.ttl);
    }
    let mut f = ip.frame();
    let mutations = if rng.chance(30) { 0 } else { 1 + rng.below(3) };
    for _ in 0..mutations {
        mutate(rng, &mut f, &mut label);
    }
    (f, label)
}

fn mutate(rng: &mut Rng, f: &mut Vec<u8>, label: &mut String) {
    const IP: usize = 14;
    match rng.below(9) {
        0 if f.len() > 14 => {
            let n = 14 + rng.below(f.len() - 14);
            f.truncate(n);
            let _ = write!(label, ", cut to {n}");
        }
        1 if f.len() > IP => {
            f[IP] = 0x40 | rng.below(16) as u8;
            let _ = write!(label, ", IHL {}", f[IP] & 0xf);
            fix_ip_checksum(f, rng);
        }
        2 if f.len() > IP + 4 => {
            let len = match rng.below(3) {
                0 => rng.next_u64() as u16,
                1 => (f.len() - IP + rng.below(40)) as u16,
                _ => (f.len() - IP).saturating_sub(1 + rng.below(40)) as u16,
            };
            f[IP + 2..IP + 4].copy_from_slice(&len.to_be_bytes());
            let _ = write!(label, ", total length {len}");
            fix_ip_checksum(f, rng);
        }
        3 if f.len() > IP + 8 => {
            let frag = rng.next_u64() as u16;
            f[IP + 6..IP + 8].copy_from_slice(&frag.to_be_bytes());
            let _ = write!(label, ", frag field {frag:#x}");
            fix_ip_checksum(f, rng);
        }
        4 if f.len() > IP + 33 => {
            // TCP flags byte at a 20-byte header's place.
            f[IP + 33] = rng.next_u64() as u8;
            let _ = write!(label, ", byte 47 = {:#x}", f[IP + 33]);
        }
        5 => {
            // A VLAN tag (802.1Q, or 802.1ad outside it).
            let tpid: [u8; 2] = if rng.chance(70) { [0x81, 0x00] } else { [0x88, 0xa8] };
            let tag = [tpid[0], tpid[1], 0, rng.below(4095) as u8];
            f.splice(12..12, tag);
            let _ = write!(label, ", vlan {tpid:02x?}");
        }
        6 if !f.is_empty() => {
            for _ in 0..1 + rng.below(4) {
                let i = rng.below(f.len());
                f[i] ^= 1 << rng.below(8);
            }
            let _ = write!(label, ", bits flipped");
        }
        7 => {
            let n = rng.below(300);
            f.extend(rng.bytes(n));
            let _ = write!(label, ", {n} bytes of trailer");
        }
        _ if f.len() > 13 => {
            let t = *rng.pick(&[[0x08u8, 0x06], [0x86, 0xdd], [0x08, 0x00], [0x88, 0xb5]]);
            f[12..14].copy_from_slice(&t);
            let _ = write!(label, ", ethertype {t:02x?}");
        }
        _ => {}
    }
}

/// Most lies are told with a valid header checksum, as a buggy or hostile sender would.
fn fix_ip_checksum(f: &mut [u8], rng: &mut Rng) {
    let ihl = usize::from(f[14] & 0xf) * 4;
    if ihl >= 20 && f.len() >= 14 + ihl && rng.chance(80) {
        f[24..26].copy_from_slice(&[0, 0]);
        let c = internet_checksum(&f[14..14 + ihl]);
        f[24..26].copy_from_slice(&c.to_be_bytes());
    }
}

/// What can be checked of an IPv4 frame without trusting it: `None` when it is not a whole,
/// plain (untagged) IPv4 frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Checksums {
    pub ip_ok: bool,
    /// The TCP/UDP/ICMP checksum over the whole L4 part; None when it cannot be computed here
    /// (a fragment, a UDP datagram without checksum, another protocol).
    pub l4_ok: Option<bool>,
    pub proto: u8,
}

pub fn checksums(f: &[u8]) -> Option<Checksums> {
    if f.len() < 34 || f[12..14] != [0x08, 0x00] || f[14] >> 4 != 4 {
        return None;
    }
    let ip = &f[14..];
    let ihl = usize::from(ip[0] & 0xf) * 4;
    let total = usize::from(u16::from_be_bytes([ip[2], ip[3]]));
    if ihl < 20 || total < ihl || total > ip.len() {
        return None;
    }
    let proto = ip[9];
    let ip_ok = internet_checksum(&ip[..ihl]) == 0;
    let frag = u16::from_be_bytes([ip[6], ip[7]]);
    let l4 = &ip[ihl..total];
    let src = Ipv4Addr::new(ip[12], ip[13], ip[14], ip[15]);
    let dst = Ipv4Addr::new(ip[16], ip[17], ip[18], ip[19]);
    let l4_ok = if frag & 0x3fff != 0 {
        None
    } else {
        match proto {
            TCP if l4.len() >= 20 => Some(l4_sum_ok(src, dst, proto, l4)),
            UDP if l4.len() >= 8 && usize::from(u16::from_be_bytes([l4[4], l4[5]])) == l4.len() && l4[6..8] != [0, 0] => {
                Some(l4_sum_ok(src, dst, proto, l4))
            }
            ICMP if l4.len() >= 8 => Some(internet_checksum(l4) == 0),
            _ => None,
        }
    };
    Some(Checksums { ip_ok, l4_ok, proto })
}

fn l4_sum_ok(src: Ipv4Addr, dst: Ipv4Addr, proto: u8, l4: &[u8]) -> bool {
    let mut sum_in = pseudo_header(src, dst, proto, l4.len());
    sum_in.extend_from_slice(l4);
    internet_checksum(&sum_in) == 0
}

/// Checks one program's output against its input: a verdict the hook allows, and a rewritten
/// frame that is whole IPv4 with every checksum that was valid still valid (a frame the program
/// made itself, an ICMP reject, must be valid throughout).
pub fn judge(input: &[u8], action: i32, allowed: &[i32], output: &[u8]) -> Result<(), String> {
    if !allowed.contains(&action) {
        return Err(format!("verdict {action}, expected one of {allowed:?}"));
    }
    if output == input {
        return Ok(());
    }
    let Some(out) = checksums(output) else {
        return Err(format!("rewritten into something that is not a whole IPv4 frame ({} bytes)", output.len()));
    };
    match checksums(input) {
        Some(inp) if inp.proto == out.proto => {
            if inp.ip_ok && !out.ip_ok {
                return Err("a valid IP header checksum was broken".into());
            }
            if inp.l4_ok == Some(true) && out.l4_ok == Some(false) {
                return Err(format!("a valid protocol {} checksum was broken", out.proto));
            }
        }
        // Built by the program (an ICMP reject): every checksum must hold.
        _ => {
            if !out.ip_ok || out.l4_ok == Some(false) {
                return Err(format!("a frame the program built has a bad checksum: {out:?}"));
            }
        }
    }
    Ok(())
}

/// Tallies a run, by program and verdict, for the report a run prints.
#[derive(Default)]
pub struct Tally {
    pub by_verdict: BTreeMap<(&'static str, i32), u64>,
    pub rewritten: BTreeMap<&'static str, u64>,
    /// Frames the kernel itself refused to run (shorter than the headers it insists on).
    pub refused: u64,
}

impl Tally {
    pub fn report(&self) -> String {
        let mut s = String::new();
        for ((prog, v), n) in &self.by_verdict {
            let _ = writeln!(s, "  {prog:<12} verdict {v}: {n}");
        }
        for (prog, n) in &self.rewritten {
            let _ = writeln!(s, "  {prog:<12} rewritten: {n}");
        }
        let _ = writeln!(s, "  refused by BPF_PROG_TEST_RUN: {}", self.refused);
        s
    }
}

/// An IPv6 frame for the IPv6 fuzz tests, and what was done to it: between one of `clients`
/// and one of `ends` (address, protocol) either way, now and then of another protocol or an
/// ICMPv6 message quoting a packet from the client to one of `quoted` (address, protocol: an error about a
/// translated flow, a ping, neighbour discovery), with extension headers, then mutated
/// (truncated, a length lie, flipped bits, a trailer, another version).
pub fn ipv6_frame(
    rng: &mut Rng,
    clients: &[std::net::SocketAddrV6],
    ends: &[(std::net::SocketAddrV6, u8)],
    quoted: &[(std::net::SocketAddrV6, u8)],
) -> (Vec<u8>, String) {
    use crate::packet::{ACK, SYN};
    use crate::packet6::{self, Ipv6, DEST_OPTS, ESP, FRAGMENT, HOP_BY_HOP, ICMPV6, ROUTING};
    let client = *rng.pick(clients);
    let (end, proto) = *rng.pick(ends);
    let (src, dst) = if rng.chance(60) { (client, end) } else { (end, client) };
    let mut label = format!("{src} -> {dst}");
    let other = rng.next_u64() as u8;
    let proto = if rng.chance(85) { proto } else { *rng.pick(&[ICMPV6, ESP, 59, 47, other]) };
    let l4 = match proto {
        TCP => {
            let flags = *rng.pick(&[SYN, ACK, SYN | ACK, 0x11, 0x04, 0x18, 0x3f]);
            let n = rng.below(3) * rng.below(300);
            packet6::tcp_segment(src, dst, flags, &vec![9u8; n])
        }
        UDP => {
            let n = rng.below(400);
            packet6::udp_datagram(src, dst, &vec![3u8; n])
        }
        ICMPV6 if rng.chance(70) => {
            // An ICMPv6 message quoting a packet from a client to a backend: an error about
            // a translated flow where one is tracked (rewritten on egress), a ping, or
            // neighbour discovery.
            let (b, quoted_proto) = *rng.pick(quoted);
            let n = rng.below(300);
            let inner = if quoted_proto == UDP {
                Ipv6::new(*client.ip(), *b.ip(), UDP, packet6::udp_datagram(client, b, &vec![5u8; n]))
            } else {
                Ipv6::new(*client.ip(), *b.ip(), TCP, packet6::tcp_segment(client, b, ACK, &vec![5u8; n]))
            };
            let kind = *rng.pick(&[1, 2, 3, 4, 128, 135]);
            label.push_str(&format!(", ICMPv6 type {kind} quoting {client} -> {b}"));
            packet6::icmpv6_message(*src.ip(), *dst.ip(), kind, 0, [0, 0, 5, 0], &inner.frame()[14..])
        }
        _ => {
            let n = rng.below(64);
            (0..n).map(|_| rng.next_u64() as u8).collect()
        }
    };
    let mut ip = Ipv6::new(*src.ip(), *dst.ip(), proto, l4);
    for _ in 0..if rng.chance(40) { rng.below(9) } else { 0 } {
        let kind = *rng.pick(&[HOP_BY_HOP, DEST_OPTS, ROUTING, FRAGMENT]);
        let body = match kind {
            FRAGMENT => {
                let offset = if rng.chance(50) { 0 } else { rng.below(200) as u16 };
                Ipv6::fragment(offset, rng.chance(50), rng.next_u64() as u32)
            }
            _ => {
                let units = rng.below(3);
                let mut b = vec![units as u8];
                b.extend((0..6 + 8 * units).map(|_| if rng.chance(70) { 0 } else { rng.next_u64() as u8 }));
                b
            }
        };
        label.push_str(&format!(", ext {kind}"));
        ip = ip.with_ext(kind, body);
    }
    let mut f = ip.frame();
    for _ in 0..if rng.chance(30) { 0 } else { 1 + rng.below(3) } {
        match rng.below(5) {
            0 if f.len() > 70 => {
                let n = 70 + rng.below(f.len() - 70);
                f.truncate(n);
                label.push_str(&format!(", cut to {n}"));
            }
            1 => {
                let len = rng.next_u64() as u16 % 1600;
                f[18..20].copy_from_slice(&len.to_be_bytes());
                label.push_str(&format!(", payload length {len}"));
            }
            2 => {
                for _ in 0..1 + rng.below(4) {
                    let at = 14 + rng.below(f.len() - 14);
                    f[at] ^= 1 << rng.below(8);
                }
                label.push_str(", bits flipped");
            }
            3 => {
                let n = rng.below(200);
                f.extend((0..n).map(|_| rng.next_u64() as u8));
                label.push_str(&format!(", {n} bytes of trailer"));
            }
            _ => {
                f[14] = (rng.below(16) as u8) << 4;
                label.push_str(&format!(", version {}", f[14] >> 4));
            }
        }
    }
    (f, label)
}

/// Checks a program's output for an IPv6 input frame: a verdict in `allowed` (the hook's),
/// and a rewritten frame whole IPv6 with each checksum that was valid still valid (one the
/// program built valid). Ok(true): the frame was rewritten.
pub fn check_ipv6_output(input: &[u8], action: i32, output: &[u8], allowed: &[i32]) -> Result<bool, String> {
    use crate::packet6;
    if !allowed.contains(&action) {
        return Err(format!("verdict {action}"));
    }
    if output == input {
        return Ok(false);
    }
    let Some((out_proto, out_ok)) = packet6::checksum_state(output) else {
        return Err("rewritten into something that is not whole IPv6".into());
    };
    match packet6::checksum_state(input) {
        Some((in_proto, in_ok)) if in_proto == out_proto => {
            if in_ok == Some(true) && out_ok == Some(false) {
                return Err("a valid checksum was broken".into());
            }
            Ok(true)
        }
        _ if out_ok != Some(true) => Err("a frame the program built has a bad checksum".into()),
        _ => Ok(true),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_seed_gives_the_same_frames_and_they_vary() {
        let a = Addresses {
            clients: vec![Ipv4Addr::new(10, 244, 0, 5)],
            services: vec![Ipv4Addr::new(10, 96, 0, 10)],
            backends: vec![Ipv4Addr::new(10, 244, 1, 2)],
            ports: vec![80, 8080],
            frontends: vec![("10.96.0.10:80".parse().unwrap(), TCP)],
            endpoints: vec![("10.244.1.2:8080".parse().unwrap(), TCP)],
        };
        let run = |seed| {
            let mut rng = Rng::new(seed);
            (0..200).map(|_| frame(&mut rng, &a).0).collect::<Vec<_>>()
        };
        assert_eq!(run(7), run(7));
        assert_ne!(run(7), run(8));
        let frames = run(7);
        let whole = frames.iter().filter(|f| checksums(f).is_some_and(|c| c.ip_ok)).count();
        assert!(whole > 50 && whole < 200, "a mix of sound and broken frames: {whole} of 200 sound");
    }

    #[test]
    fn judge_catches_a_broken_checksum_and_a_bad_verdict() {
        let c = SocketAddrV4::new(Ipv4Addr::new(10, 0, 0, 1), 40000);
        let s = SocketAddrV4::new(Ipv4Addr::new(10, 96, 0, 1), 80);
        let f = crate::packet::tcp_frame(c, s, 0x02);
        assert!(judge(&f, 0, &[0], &f).is_ok());
        assert!(judge(&f, 1, &[0], &f).is_err());
        let mut broken = f.clone();
        broken[14 + 20 + 2] ^= 1;
        assert!(judge(&f, 0, &[0], &broken).unwrap_err().contains("checksum"));
        assert!(judge(&f, 0, &[0], &f[..20]).is_err());
    }
}
