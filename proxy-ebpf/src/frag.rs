//! Fragments. Only the first fragment carries ports, so a translated datagram's first fragment
//! records them here and the later fragments pick them up and follow the same conntrack entry.
//! A later fragment that overtakes its first fragment cannot be matched and is left untouched
//! and counted as `PassFragmentUnknown`. Each family keys its own map (`Family::frag_key`).

use aya_ebpf::bindings::BPF_ANY;
use proxy_common::FragPorts;

use crate::{
    family::Family,
    parse::{Frag, Packet},
};

/// Fills in the ports of a later fragment. False when its first fragment was not seen.
#[inline(always)]
pub fn resolve_ports<A: Family>(pkt: &mut Packet<A>) -> bool {
    match crate::value::copy(A::frags(), A::frag_key(pkt)) {
        Some(ports) => {
            pkt.sport = ports.sport;
            pkt.dport = ports.dport;
            true
        }
        None => false,
    }
}

/// Records the ports of a first fragment that is being translated.
#[inline(always)]
pub fn remember<A: Family>(pkt: &Packet<A>) {
    if pkt.frag == Frag::First {
        // A full LRU evicts; failure only means later fragments are not translated.
        let _ = A::frags().insert(A::frag_key(pkt), FragPorts { sport: pkt.sport, dport: pkt.dport }, BPF_ANY as u64);
    }
}
