//! IPv4 fragments. Only the first fragment carries ports, so a translated datagram's first
//! fragment records them here and the later fragments pick them up and follow the same
//! conntrack entry. A later fragment that overtakes its first fragment cannot be matched and is
//! left untouched and counted as `PassFragmentUnknown`.

use aya_ebpf::bindings::BPF_ANY;
use proxy_common::{FragKey, FragPorts};

use crate::{
    maps::FRAG4_V1,
    parse::{Frag, Packet},
};

#[inline(always)]
fn key(pkt: &Packet) -> FragKey {
    FragKey { saddr: pkt.saddr, daddr: pkt.daddr, id: pkt.ip_id, proto: pkt.proto, _pad: 0 }
}

/// Fills in the ports of a later fragment. False when its first fragment was not seen.
#[inline(always)]
pub fn resolve_ports(pkt: &mut Packet) -> bool {
    match FRAG4_V1.get_ptr(key(pkt)) {
        Some(p) => {
            // SAFETY: a valid map value pointer; FragPorts is plain bytes.
            let ports = unsafe { *p };
            pkt.sport = ports.sport;
            pkt.dport = ports.dport;
            true
        }
        None => false,
    }
}

/// Records the ports of a first fragment that is being translated.
#[inline(always)]
pub fn remember(pkt: &Packet) {
    if pkt.frag == Frag::First {
        // A full LRU evicts; failure only means later fragments are not translated.
        let _ = FRAG4_V1.insert(key(pkt), FragPorts { sport: pkt.sport, dport: pkt.dport }, BPF_ANY as u64);
    }
}
