use proxy_common::Reason;

use crate::maps::STATS_V1;

/// Counts one packet of `len` bytes under `reason`. Per-CPU, so plain adds are race-free.
#[inline(always)]
pub fn count(reason: Reason, len: u32) {
    if let Some(c) = STATS_V1.get_ptr_mut(reason as u32) {
        // SAFETY: per-CPU slot, only this CPU writes it while the program runs.
        unsafe {
            (*c).packets += 1;
            (*c).bytes += u64::from(len);
        }
    }
}
