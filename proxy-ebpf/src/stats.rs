use proxy_common::Reason;

use crate::maps::STATS_V1;

/// Counts one packet of `len` bytes under `reason`. Per-CPU, so plain adds are race-free.
#[inline(always)]
pub fn count(reason: Reason, len: u32) {
    // SAFETY: taken once per count. The socket hooks count too; a TC or XDP program
    // interrupting one on its CPU can make a count lose an increment.
    if let Some(c) = unsafe { crate::value::per_cpu(&STATS_V1, reason as u32) } {
        c.packets += 1;
        c.bytes += u64::from(len);
    }
}
