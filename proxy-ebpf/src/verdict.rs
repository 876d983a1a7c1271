//! What a TC program does with a packet: the action it returns and the reason it is counted
//! under. A leaf module, so the programs' parts (`pod_ingress`, `egress`, `icmp`, `ext`) share it
//! without depending on each other for it.

use aya_ebpf::bindings::TC_ACT_OK;
use proxy_common::Reason;

pub struct Verdict {
    pub action: i32,
    pub reason: Reason,
}

impl Verdict {
    #[inline(always)]
    pub const fn pass(reason: Reason) -> Self {
        Self { action: TC_ACT_OK, reason }
    }
}
