//! Removing the flows whose conntrack entries have expired, each with its reply entry, by the
//! lifetimes the datapath applies (`proxy_common::ct::expired`), as nf_conntrack and Cilium's
//! conntrack GC do. The datapath only ignores an expired entry (the next packet of its tuple
//! is tracked afresh): left there, such entries fill the LRU map, which then evicts on every
//! new flow, a cost on the packet's path, and evicts by last use, so an idle live connection
//! (a database pool's) goes before flows that ended a while after it was last used. Removed,
//! their filter bits also go at the next rebuild (`ct_filter`).

use std::{io, os::fd::BorrowedFd};

use proxy_common::{
    ct::{self, flags, Lifetimes},
    user::MapAddr,
    CtEntry, CtKey, Ip6,
};

use super::batch;

/// How long past its lifetime a flow is left before it is removed. A packet that finds an
/// expired entry tracks its tuple afresh, writing new entries at the same keys; the margin
/// tells those (seen since) from the expired ones (see `remove_flow`).
pub const MARGIN_NS: u64 = 5_000_000_000;

/// What a collection removed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Collected {
    /// Expired flows (forward entries) removed.
    pub flows: u64,
    /// Their reply entries removed with them (a reply entry a later flow took stays).
    pub replies: u64,
}

/// Whether the forward entry `e` at `k` is past its lifetime, and the margin, at `now`.
fn gone<A>(k: &CtKey<A>, e: &CtEntry<A>, lt: &Lifetimes, now: u64) -> bool {
    e.flags & flags::REPLY == 0 && ct::expired(k.proto, e.flags, e.last_seen_ns, now.saturating_sub(MARGIN_NS), lt)
}

/// Removes the expired flows of the conntrack map `ct` (keys of address `A`): `now` is the
/// datapath's clock (`CLOCK_MONOTONIC_COARSE`, which `bpf_ktime_get_coarse_ns` reads) and `lt`
/// the lifetimes its programs were loaded with.
pub fn collect<A: MapAddr>(ct: BorrowedFd<'_>, lt: &Lifetimes, now: u64) -> io::Result<Collected> {
    let mut out = Collected::default();
    let mut failed = None;
    batch::for_each_entry(ct, size_of::<CtKey<A>>(), size_of::<CtEntry<A>>(), |kb, vb| {
        // SAFETY: one key and one value of the map, plain data (unaligned in the buffers).
        let (k, e): (CtKey<A>, CtEntry<A>) =
            unsafe { (std::ptr::read_unaligned(kb.as_ptr().cast()), std::ptr::read_unaligned(vb.as_ptr().cast())) };
        if failed.is_some() || !gone(&k, &e, lt, now) {
            return;
        }
        match remove_flow(ct, &k, lt, now) {
            Ok((flow, reply)) => {
                out.flows += u64::from(flow);
                out.replies += u64::from(reply);
            }
            Err(e) => failed = Some(e),
        }
    })?;
    failed.map_or(Ok(out), Err)
}

/// Removes the forward entry at `k`, read again (a packet may have tracked the tuple afresh
/// since the walk read it), if it is still expired; then its reply entry, if that is still its
/// own: a packet that tracks the tuple afresh meanwhile writes a reply entry seen after the
/// forward one was (its `last_seen_ns` later than the forward's by the lifetime and the
/// margin), which stays. Between the read and the removal of the forward entry, a syscall
/// apart, a new flow on the same tuple would lose its forward entry (its next packet then
/// chooses a backend again): the one case a removal can touch a live flow.
fn remove_flow<A: MapAddr>(ct: BorrowedFd<'_>, k: &CtKey<A>, lt: &Lifetimes, now: u64) -> io::Result<(bool, bool)> {
    let Some(e) = batch::lookup::<_, CtEntry<A>>(ct, k)? else { return Ok((false, false)) };
    if !gone(k, &e, lt, now) || !batch::delete(ct, k)? {
        return Ok((false, false));
    }
    let rk = ct::reply_key_of(k, &e, A::HAIRPIN);
    let own = |r: &CtEntry<A>| ct::reply_of(r, k, &e) && r.last_seen_ns <= e.last_seen_ns.saturating_add(ct::REFRESH_NS);
    let reply = match batch::lookup::<_, CtEntry<A>>(ct, &rk)? {
        Some(r) if own(&r) => batch::delete(ct, &rk)?,
        _ => false,
    };
    Ok((true, reply))
}

/// `collect` on both families' conntrack maps, IPv4's then IPv6's.
pub fn collect_families(cts: [BorrowedFd<'_>; 2], lt: &Lifetimes, now: u64) -> io::Result<[Collected; 2]> {
    Ok([collect::<[u8; 4]>(cts[0], lt, now)?, collect::<Ip6>(cts[1], lt, now)?])
}

/// The clock the datapath stamps entries with.
pub fn monotonic_coarse_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: valid out-pointer.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC_COARSE, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}
