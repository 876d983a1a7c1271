//! Connection-tracking flags and the lifetime policy the datapath applies on lookup. The map is
//! an LRU, so memory is bounded by eviction; lifetimes decide when a tracked flow stops steering
//! its packets (a reused source port gets a fresh backend choice). The agent removes the flows
//! that have expired by the same policy, with their reply entries (`reply_key_of`, `reply_of`),
//! so that the LRU seldom has to evict.

use crate::{CtEntry, CtKey};

/// `CtEntry::flags`.
pub mod flags {
    /// This entry is keyed on the reply tuple (backend -> client).
    pub const REPLY: u8 = 1 << 0;
    /// A packet went the other way: the flow is established (TCP) or answered (UDP).
    pub const SEEN_REPLY: u8 = 1 << 1;
    /// The client sent FIN.
    pub const FIN_FWD: u8 = 1 << 2;
    /// The backend sent FIN.
    pub const FIN_REV: u8 = 1 << 3;
    /// Either side sent RST.
    pub const RST: u8 = 1 << 4;
    /// The client is its own backend: its source is translated to `HAIRPIN_ADDR` so the
    /// packet it gets back is not from itself, and replies are handled on ingress.
    pub const HAIRPIN: u8 = 1 << 5;
    /// Forward entry: the source was translated to `snat_addr:snat_port` (north-south flow to
    /// a remote backend). Reply entry: the destination is restored to the client in
    /// `nat_addr:nat_port`.
    pub const SNAT: u8 = 1 << 6;
    /// The client's source port was changed, to keep the translated tuple unique: another
    /// flow from the same client port already reached the same backend (through another
    /// Service address), as netfilter's NAT rewrites a clashing source port. Forward entry:
    /// the port it is changed to, in `snat_port`. Reply entry: the client's own port, restored
    /// as destination, in `snat_port`.
    pub const PORT_NAT: u8 = 1 << 7;
}

/// `CtEntry::owner`: whose translation an entry's tuple is.
pub mod owner {
    /// Ours: the datapath translates the flow by the entry.
    pub const DATAPATH: u8 = 0;
    /// netfilter's: a connection kube-proxy's rules translated and masqueraded before the
    /// takeover, whose NAT (the port it chose among them) its conntrack entry keeps. One such
    /// entry at each of the connection's two tuples as they reach the hooks (the client's, and
    /// the backend's reply to the masquerading address), neither with `REPLY`, both with the
    /// backend's id, address and port as a forward entry has them: the hooks pass its packets
    /// to the stack untouched, and refresh the entry as a forward one, so the expiry removes it
    /// once the connection is idle past its lifetime. A UDP packet whose backend is gone is
    /// tracked afresh instead (kube-proxy deletes a removed endpoint's UDP entries).
    pub const NETFILTER: u8 = 1;
    /// Ours once netfilter's entry is replaced: the entries (forward and reply) of a
    /// connection the takeover adopted, whose netfilter entry is being deleted and made again
    /// as our programs' translation leaves it. Translated beside the old entry, its packet
    /// would be tracked by netfilter as a new connection clashing with the old one's reply
    /// tuple, whose NAT moves its source port, and the backend would reset it; and a reply
    /// tracked as new before the new entry is made would meet a CNI's masquerade. So its
    /// packets, both ways, are dropped meanwhile (TCP sends them again; a UDP client asks
    /// again, as for any datagram lost), for at most `HANDOVER_NS` after the entry was written
    /// (`last_seen_ns`, which nothing refreshes meanwhile). The agent makes the entries
    /// `DATAPATH` once netfilter's is replaced; the datapath does past that time (an agent
    /// stopped half-way).
    pub const HANDOVER: u8 = 2;
}

/// How long a connection's packets are held back at its handover (`owner::HANDOVER`) at most.
pub const HANDOVER_NS: u64 = SEC;

/// `ADOPTING_V1`, one slot per family (`ADOPTING_V4`, `ADOPTING_V6`): until when (the
/// datapath's clock, `bpf_ktime_get_coarse_ns`) a takeover may still adopt connections netfilter
/// translated to the frontends already served; 0, none. Meanwhile a TCP segment of a connection
/// under way (no SYN) that finds no entry of ours is dropped rather than balanced afresh: it
/// belongs to a connection kube-proxy's rules sent to some backend after the agent last read
/// the conntrack table, and before the frontend's master made our programs serve it, which the
/// agent adopts at its next read; TCP sends the segment again. The agent moves the time on at
/// each read (`ADOPTING_HOLD_NS` ahead), and at the first sync's end until its trailing read
/// a few seconds later; it sets 0 once the adoption ends, so a stopped agent's hold lapses by
/// itself.
pub const ADOPTING_V4: u32 = 0;
pub const ADOPTING_V6: u32 = 1;
/// How far ahead of each read the agent sets `ADOPTING_V1`'s time.
pub const ADOPTING_HOLD_NS: u64 = 5 * SEC;

/// `CtEntry::l4_csum`: how the flow's packets carried their TCP/UDP checksum.
pub mod l4_csum {
    /// Not learned (the rewrite changed nothing it could tell by): the helpers do every packet.
    pub const UNKNOWN: u8 = 0;
    /// Only the pseudo-header sum (CHECKSUM_PARTIAL: a pod's own stack with offload).
    pub const PARTIAL: u8 = 1;
    /// A complete checksum.
    pub const COMPLETE: u8 = 2;
}

/// Source address of hairpinned flows (a pod reaching itself through a Service). Link-local
/// and never assigned, so the pod routes its replies to the node, where they are translated
/// back. kube-proxy masquerades to the node's address instead; the effect is the same.
pub const HAIRPIN_ADDR: [u8; 4] = [169, 254, 42, 1];

/// The same for IPv6: an address of the discard-only prefix 100::/64 (RFC 6666), never
/// assigned and, unlike a link-local one, routed by the pod to the node instead of resolved
/// on its link.
pub const HAIRPIN_ADDR6: crate::Ip6 = crate::Ip6::from_bytes([0x01, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 169, 254, 42, 1]);

const SEC: u64 = 1_000_000_000;

/// TCP after SYN, before any reply: as nf_conntrack's SYN_SENT.
pub const TCP_SYN_TIMEOUT_NS: u64 = 60 * SEC;
/// TCP established. Cilium uses 6 hours; nf_conntrack 5 days. Long idle connections are common
/// (database pools), so err on the long side; the LRU bounds memory anyway.
pub const TCP_ESTABLISHED_TIMEOUT_NS: u64 = 6 * 3600 * SEC;
/// TCP after RST or FIN from both sides.
pub const TCP_CLOSING_TIMEOUT_NS: u64 = 10 * SEC;
/// UDP and others before a reply (nf_conntrack `udp_timeout`).
pub const UDP_TIMEOUT_NS: u64 = 30 * SEC;
/// UDP and others once answered (nf_conntrack `udp_timeout_stream`).
pub const UDP_STREAM_TIMEOUT_NS: u64 = 120 * SEC;
/// `last_seen_ns` is refreshed only when it is older than this, to keep packets from writing
/// the shared entry on every packet.
pub const REFRESH_NS: u64 = SEC;

/// The period a cached route stays valid in: the coarse clock in units of 2^30 ns (~1.07 s).
#[inline(always)]
pub const fn route_epoch(now_ns: u64) -> u16 {
    (now_ns >> 30) as u16
}

/// Value of `FLOW_GEN_V1` (mmapable): the generation the flow caches (XDP's, TC's) are valid under is the
/// sum of the agent's count and the datapath's, each moved on by its own writer only, with an
/// atomic add (the agent through its mapping of the value).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FlowGen {
    /// Moved on after the agent deleted or wrote over a backend or reverse NAT entry, or
    /// changed what a device takes from XDP.
    pub agent: u32,
    /// Moved on when TC tracks afresh the tuple of a flow that had not expired (a SYN reusing
    /// a closing connection's ports, a flow whose backend went).
    pub datapath: u32,
}

impl FlowGen {
    #[inline(always)]
    pub const fn generation(self) -> u32 {
        self.agent.wrapping_add(self.datapath)
    }
}

/// When the route epoch of `now_ns` ends.
#[inline(always)]
pub const fn route_epoch_end(now_ns: u64) -> u64 {
    ((now_ns >> 30) + 1) << 30
}

/// Marks `CtEntry::route_xdp` as holding the route's device flags (which may be none).
pub const ROUTE_XDP_KNOWN: u8 = 0x80;

/// True when a TCP flow is closing: a RST, or a FIN each way.
#[inline(always)]
pub const fn tcp_closing(f: u8) -> bool {
    f & flags::RST != 0 || (f & flags::FIN_FWD != 0 && f & flags::FIN_REV != 0)
}

/// How long an entry stays valid after its last packet, per state. The agent sets them when it
/// loads the programs (from kube-proxy's conntrack settings); `DEFAULT` holds otherwise.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Lifetimes {
    pub tcp_syn_ns: u64,
    pub tcp_established_ns: u64,
    /// One side sent FIN (nf_conntrack's CLOSE_WAIT): the other may go on sending.
    pub tcp_half_closed_ns: u64,
    pub tcp_closing_ns: u64,
    pub udp_ns: u64,
    pub udp_stream_ns: u64,
}
const _: () = assert!(size_of::<Lifetimes>() == 48);

impl Lifetimes {
    pub const DEFAULT: Self = Self {
        tcp_syn_ns: TCP_SYN_TIMEOUT_NS,
        tcp_established_ns: TCP_ESTABLISHED_TIMEOUT_NS,
        tcp_half_closed_ns: TCP_ESTABLISHED_TIMEOUT_NS,
        tcp_closing_ns: TCP_CLOSING_TIMEOUT_NS,
        udp_ns: UDP_TIMEOUT_NS,
        udp_stream_ns: UDP_STREAM_TIMEOUT_NS,
    };
}

impl Default for Lifetimes {
    fn default() -> Self {
        Self::DEFAULT
    }
}

impl Lifetimes {
    /// Which lifetime applies to an entry with flags `f`: its field's place among the
    /// struct's `u64`s (so a reader can load that field alone).
    #[inline(always)]
    pub const fn index(proto: u8, f: u8) -> usize {
        if proto == crate::IPPROTO_TCP {
            if tcp_closing(f) {
                3
            } else if f & flags::SEEN_REPLY != 0 && f & (flags::FIN_FWD | flags::FIN_REV) != 0 {
                2
            } else if f & flags::SEEN_REPLY != 0 {
                1
            } else {
                0
            }
        } else if f & flags::SEEN_REPLY != 0 {
            5
        } else {
            4
        }
    }
}

/// How long an entry with `flags` stays valid after its last packet.
#[inline(always)]
pub const fn lifetime_ns(proto: u8, f: u8, lt: &Lifetimes) -> u64 {
    match Lifetimes::index(proto, f) {
        0 => lt.tcp_syn_ns,
        1 => lt.tcp_established_ns,
        2 => lt.tcp_half_closed_ns,
        3 => lt.tcp_closing_ns,
        4 => lt.udp_ns,
        _ => lt.udp_stream_ns,
    }
}

/// True when the entry no longer steers packets at time `now_ns`.
#[inline(always)]
pub const fn expired(proto: u8, f: u8, last_seen_ns: u64, now_ns: u64, lt: &Lifetimes) -> bool {
    now_ns.saturating_sub(last_seen_ns) > lifetime_ns(proto, f, lt)
}

/// The reply tuple of the flow the forward entry `e`, at key `k`, tracks: what its backend's
/// answers carry (the datapath's `reply_key`, `snat_reply_key` and the port moved by
/// `PORT_NAT`). `hairpin`: the family's hairpin address (`HAIRPIN_ADDR`, `HAIRPIN_ADDR6`).
#[inline(always)]
pub fn reply_key_of<A: Copy>(k: &CtKey<A>, e: &CtEntry<A>, hairpin: A) -> CtKey<A> {
    let snat = e.flags & flags::SNAT != 0;
    CtKey {
        saddr: e.nat_addr,
        daddr: if snat {
            e.snat_addr
        } else if e.flags & flags::HAIRPIN != 0 {
            hairpin
        } else {
            k.saddr
        },
        sport: e.nat_port,
        dport: if e.flags & (flags::SNAT | flags::PORT_NAT) != 0 { e.snat_port } else { k.sport },
        proto: k.proto,
        _pad: 0,
        _pad2: 0,
    }
}

/// The forward tuple of the flow the reply entry `r`, at key `rk`, belongs to, given its
/// Service's address and port (`RevNat`): the client, at the port it sent from. As the
/// datapath finds it for a reply (`forward_key_of_reply`, `snat_forward_key`, a hairpinned
/// reply's, where the client is the backend itself).
#[inline(always)]
pub fn forward_key_of<A: Copy>(rk: &CtKey<A>, r: &CtEntry<A>, vip: A, vport: [u8; 2]) -> CtKey<A> {
    let (saddr, sport) = if r.flags & flags::SNAT != 0 {
        (r.nat_addr, r.nat_port)
    } else if r.flags & flags::HAIRPIN != 0 {
        (rk.saddr, rk.dport)
    } else if r.flags & flags::PORT_NAT != 0 {
        (rk.daddr, r.snat_port)
    } else {
        (rk.daddr, rk.dport)
    };
    CtKey { saddr, daddr: vip, sport, dport: vport, proto: rk.proto, _pad: 0, _pad2: 0 }
}

/// Whether `r`, the entry at `reply_key_of(k, e)`, is the reply entry of the forward entry `e`
/// at `k`, and not one a later flow put at the same tuple (which then must be left alone).
#[inline(always)]
pub fn reply_of<A: PartialEq>(r: &CtEntry<A>, k: &CtKey<A>, e: &CtEntry<A>) -> bool {
    if r.flags & flags::REPLY == 0 || r.backend_id != e.backend_id || r.service_id != e.service_id {
        return false;
    }
    if e.flags & flags::SNAT != 0 {
        // The client, as the reply entry restores it.
        return r.flags & flags::SNAT != 0 && r.nat_addr == k.saddr && r.nat_port == k.sport;
    }
    // The Service address and port, as the reply entry restores them, and the client's own
    // port where it was moved.
    let moved = e.flags & flags::PORT_NAT != 0;
    r.flags & flags::SNAT == 0
        && r.nat_addr == k.daddr
        && r.nat_port == k.dport
        && (r.flags & flags::PORT_NAT != 0) == moved
        && (!moved || r.snat_port == k.sport)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{IPPROTO_TCP, IPPROTO_UDP};

    const D: &Lifetimes = &Lifetimes::DEFAULT;

    #[test]
    fn tcp_lifetimes_follow_state() {
        assert_eq!(lifetime_ns(IPPROTO_TCP, 0, D), TCP_SYN_TIMEOUT_NS);
        assert_eq!(lifetime_ns(IPPROTO_TCP, flags::SEEN_REPLY, D), TCP_ESTABLISHED_TIMEOUT_NS);
        // One FIN is a half-close: the other side may keep sending for a long time.
        assert_eq!(lifetime_ns(IPPROTO_TCP, flags::SEEN_REPLY | flags::FIN_FWD, D), TCP_ESTABLISHED_TIMEOUT_NS);
        assert_eq!(lifetime_ns(IPPROTO_TCP, flags::SEEN_REPLY | flags::FIN_FWD | flags::FIN_REV, D), TCP_CLOSING_TIMEOUT_NS);
        assert_eq!(lifetime_ns(IPPROTO_TCP, flags::RST, D), TCP_CLOSING_TIMEOUT_NS);
    }

    #[test]
    fn configured_lifetimes_apply_to_their_state() {
        let lt = Lifetimes {
            tcp_established_ns: 7 * SEC,
            tcp_half_closed_ns: 3 * SEC,
            udp_ns: 11 * SEC,
            udp_stream_ns: 13 * SEC,
            ..Lifetimes::DEFAULT
        };
        assert_eq!(lifetime_ns(IPPROTO_TCP, flags::SEEN_REPLY, &lt), 7 * SEC);
        assert_eq!(lifetime_ns(IPPROTO_TCP, flags::SEEN_REPLY | flags::FIN_REV, &lt), 3 * SEC);
        assert_eq!(lifetime_ns(IPPROTO_TCP, 0, &lt), TCP_SYN_TIMEOUT_NS);
        assert_eq!(lifetime_ns(IPPROTO_UDP, 0, &lt), 11 * SEC);
        assert_eq!(lifetime_ns(IPPROTO_UDP, flags::SEEN_REPLY, &lt), 13 * SEC);
    }

    #[test]
    fn udp_lifetimes_grow_once_answered() {
        assert_eq!(lifetime_ns(IPPROTO_UDP, 0, D), UDP_TIMEOUT_NS);
        assert_eq!(lifetime_ns(IPPROTO_UDP, flags::SEEN_REPLY, D), UDP_STREAM_TIMEOUT_NS);
    }

    #[test]
    fn expiry_is_strictly_after_lifetime() {
        let t0 = 5 * SEC;
        assert!(!expired(IPPROTO_UDP, 0, t0, t0 + UDP_TIMEOUT_NS, D));
        assert!(expired(IPPROTO_UDP, 0, t0, t0 + UDP_TIMEOUT_NS + 1, D));
        // A clock that reads earlier than last_seen (another CPU refreshed it) is not expiry.
        assert!(!expired(IPPROTO_UDP, 0, t0, t0 - 1, D));
    }
}
