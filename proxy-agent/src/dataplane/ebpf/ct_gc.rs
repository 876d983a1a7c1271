//! Removing the flows whose conntrack entries have expired, each with its reply entry, by the
//! lifetimes the datapath applies (`proxy_common::ct::expired`), as nf_conntrack and Cilium's
//! conntrack GC do. The datapath only ignores an expired entry (the next packet of its tuple
//! is tracked afresh): left there, such entries fill the LRU map, which then evicts on every
//! new flow, a cost on the packet's path, and evicts by last use, so an idle live connection
//! (a database pool's) goes before flows that ended a while after it was last used. Removed,
//! their filter bits also go at the next rebuild (`ct_filter`). Reply entries past their own
//! lifetime that no flow claims any more go too.
//!
//! The lifetimes are this run's: an agent beside another with other conntrack timeouts (a
//! rollout that surges and changes them at once) removes by its own, which the other's
//! programs may not apply. Inside a time namespace with an offset (Kubernetes makes none), the
//! agent's clock would not be the datapath's.

use std::{io, os::fd::BorrowedFd};

use proxy_common::{
    ct::{self, flags, Lifetimes},
    user::MapAddr,
    CtEntry, CtKey, Ip6, RevNat,
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
    /// Reply entries past their own lifetime whose flow is gone (its forward entry evicted, or
    /// naming another backend now), removed on their own.
    pub orphans: u64,
}

/// Whether the entry `e` at `k` is past its lifetime, and the margin, at `now`.
fn expired<A>(k: &CtKey<A>, e: &CtEntry<A>, lt: &Lifetimes, now: u64) -> bool {
    ct::expired(k.proto, e.flags, e.last_seen_ns, now.saturating_sub(MARGIN_NS), lt)
}

/// Removes the expired flows of the conntrack map `ct` (keys of address `A`), and the reply
/// entries left without their flow: `revnat` is the family's reverse NAT map (a Service's
/// address and port by id), `now` the datapath's clock (`monotonic_coarse_ns`) and `lt` the
/// lifetimes its programs were loaded with.
pub fn collect<A: MapAddr>(ct: BorrowedFd<'_>, revnat: BorrowedFd<'_>, lt: &Lifetimes, now: u64) -> io::Result<Collected> {
    let mut out = Collected::default();
    let mut failed = None;
    batch::for_each_entry(ct, size_of::<CtKey<A>>(), size_of::<CtEntry<A>>(), |kb, vb| {
        // SAFETY: one key and one value of the map, plain data (unaligned in the buffers).
        let (k, e): (CtKey<A>, CtEntry<A>) =
            unsafe { (std::ptr::read_unaligned(kb.as_ptr().cast()), std::ptr::read_unaligned(vb.as_ptr().cast())) };
        if failed.is_some() || !expired(&k, &e, lt, now) {
            return;
        }
        let done = if e.flags & flags::REPLY == 0 {
            remove_flow(ct, &k, lt, now).map(|(flow, reply)| {
                out.flows += u64::from(flow);
                out.replies += u64::from(reply);
            })
        } else {
            remove_orphan(ct, revnat, &k, &e).map(|gone| out.orphans += u64::from(gone))
        };
        if let Err(e) = done {
            failed = Some(e);
        }
    })?;
    failed.map_or(Ok(out), Err)
}

/// Removes the forward entry at `k` if it is still expired when taken out (a packet may have
/// tracked the tuple afresh since the walk read it: that entry is put back), then its reply
/// entry if that is still its own (same Service, backend and client, and not written later
/// than the flow was last seen: a packet that tracked the tuple afresh meanwhile wrote one
/// seen after the lifetime and the margin), else that is put back. Each entry is taken out and
/// read in one step, so a removal never takes what a packet wrote after it was read; a packet
/// of a flow whose entry is out for the moment between a take and a put back (a flow seen
/// since the walk, the rare case) is tracked as a new flow.
fn remove_flow<A: MapAddr>(ct: BorrowedFd<'_>, k: &CtKey<A>, lt: &Lifetimes, now: u64) -> io::Result<(bool, bool)> {
    let Some(e) = batch::take::<_, CtEntry<A>>(ct, k)? else { return Ok((false, false)) };
    if e.flags & flags::REPLY != 0 || !expired(k, &e, lt, now) {
        batch::put_back(ct, k, &e)?;
        return Ok((false, false));
    }
    let rk = ct::reply_key_of(k, &e, A::HAIRPIN);
    let Some(r) = batch::take::<_, CtEntry<A>>(ct, &rk)? else { return Ok((true, false)) };
    if ct::reply_of(&r, k, &e) && r.last_seen_ns <= e.last_seen_ns.saturating_add(ct::REFRESH_NS) {
        return Ok((true, true));
    }
    batch::put_back(ct, &rk, &r)?;
    Ok((true, false))
}

/// Removes the reply entry `r` at `rk`, past its own lifetime, unless a forward entry still
/// claims it (that flow's own expiry decides then, in `remove_flow`): a reply entry whose
/// forward entry is gone, or names another backend now, translates nothing any more (the
/// datapath removes it at its next reply), and its tuple, a SNAT port among them, is held for
/// nothing. Put back if it changed since the walk read it.
fn remove_orphan<A: MapAddr>(ct: BorrowedFd<'_>, revnat: BorrowedFd<'_>, rk: &CtKey<A>, r: &CtEntry<A>) -> io::Result<bool> {
    if let Some(rn) = batch::lookup::<u32, RevNat<A>>(revnat, &r.service_id)? {
        let fk = ct::forward_key_of(rk, r, rn.addr, rn.port);
        let claimed = batch::lookup::<_, CtEntry<A>>(ct, &fk)?
            .is_some_and(|f| f.flags & flags::REPLY == 0 && ct::reply_key_of(&fk, &f, A::HAIRPIN) == *rk && ct::reply_of(r, &fk, &f));
        if claimed {
            return Ok(false);
        }
    }
    let Some(taken) = batch::take::<_, CtEntry<A>>(ct, rk)? else { return Ok(false) };
    if taken != *r {
        batch::put_back(ct, rk, &taken)?;
        return Ok(false);
    }
    Ok(true)
}

/// `collect` on both families' conntrack maps, IPv4's then IPv6's: `cts` and `revnats` are
/// the families' conntrack and reverse NAT maps, in that order.
pub fn collect_families(cts: [BorrowedFd<'_>; 2], revnats: [BorrowedFd<'_>; 2], lt: &Lifetimes, now: u64) -> io::Result<[Collected; 2]> {
    Ok([collect::<[u8; 4]>(cts[0], revnats[0], lt, now)?, collect::<Ip6>(cts[1], revnats[1], lt, now)?])
}

/// The clock the datapath stamps entries with.
pub fn monotonic_coarse_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: valid out-pointer.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC_COARSE, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}
