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
/// entries left without their flow, adding what it removed to `out` (also when it fails on
/// the way): `revnat` is the family's reverse NAT map (a Service's address and port by id),
/// `now` the datapath's clock (`monotonic_coarse_ns`) and `lt` the lifetimes its programs
/// were loaded with.
pub fn collect<A: MapAddr>(ct: BorrowedFd<'_>, revnat: BorrowedFd<'_>, lt: &Lifetimes, now: u64, out: &mut Collected) -> io::Result<()> {
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
    failed.map_or(Ok(()), Err)
}

/// Takes the entry at `k` out if it is still `seen` (read just before): the check and the
/// removal are one step for the map, so an entry a packet wrote since the read is not lost; a
/// value that changed in between (a packet's write) is put back, unless a packet wrote the
/// key again meanwhile. True when it was removed.
fn take_if_unchanged<A: MapAddr>(ct: BorrowedFd<'_>, k: &CtKey<A>, seen: &CtEntry<A>) -> io::Result<bool> {
    let Some(taken) = batch::take::<_, CtEntry<A>>(ct, k)? else { return Ok(false) };
    if taken == *seen {
        return Ok(true);
    }
    batch::put_back(ct, k, &taken)?;
    Ok(false)
}

/// Removes the forward entry at `k` if it is still expired (read again: a packet may have
/// tracked the tuple afresh since the walk read it), then its reply entry if that is still
/// its own (same Service, backend and client, and not written later than the flow was last
/// seen: a later flow that took the tuple wrote one seen after the lifetime and the margin).
/// Each entry is read, checked, and taken out only if it is what was checked
/// (`take_if_unchanged`): a packet that writes it between the read and the removal, a
/// syscall apart, has its entry out for as long as the put back takes.
fn remove_flow<A: MapAddr>(ct: BorrowedFd<'_>, k: &CtKey<A>, lt: &Lifetimes, now: u64) -> io::Result<(bool, bool)> {
    let Some(e) = batch::lookup::<_, CtEntry<A>>(ct, k)? else { return Ok((false, false)) };
    if e.flags & flags::REPLY != 0 || !expired(k, &e, lt, now) || !take_if_unchanged(ct, k, &e)? {
        return Ok((false, false));
    }
    let rk = ct::reply_key_of(k, &e, A::HAIRPIN);
    let own = batch::lookup::<_, CtEntry<A>>(ct, &rk)?
        .filter(|r| ct::reply_of(r, k, &e) && r.last_seen_ns <= e.last_seen_ns.saturating_add(ct::REFRESH_NS));
    let reply = match own {
        Some(r) => take_if_unchanged(ct, &rk, &r)?,
        None => false,
    };
    Ok((true, reply))
}

/// Removes the reply entry `r` at `rk`, past its own lifetime, unless a forward entry still
/// claims it (that flow's own expiry decides then, in `remove_flow`): a reply entry whose
/// forward entry is gone, or names another backend now, translates nothing any more (the
/// datapath removes it at a reply due a refresh), and its tuple, a SNAT port among them, is
/// held for nothing. Left if it changed since the walk read it.
fn remove_orphan<A: MapAddr>(ct: BorrowedFd<'_>, revnat: BorrowedFd<'_>, rk: &CtKey<A>, r: &CtEntry<A>) -> io::Result<bool> {
    if let Some(rn) = batch::lookup::<u32, RevNat<A>>(revnat, &r.service_id)? {
        let fk = ct::forward_key_of(rk, r, rn.addr, rn.port);
        let claimed = batch::lookup::<_, CtEntry<A>>(ct, &fk)?
            .is_some_and(|f| f.flags & flags::REPLY == 0 && ct::reply_key_of(&fk, &f, A::HAIRPIN) == *rk && ct::reply_of(r, &fk, &f));
        if claimed {
            return Ok(false);
        }
    }
    take_if_unchanged(ct, rk, r)
}

/// `collect` on both families' conntrack maps, IPv4's then IPv6's (`cts`; `revnats`: their
/// reverse NAT maps, or why one could not be opened): what each removed, and the errors met
/// (a family's does not keep the other's removal from running).
pub fn collect_families(
    cts: [BorrowedFd<'_>; 2],
    revnats: [io::Result<BorrowedFd<'_>>; 2],
    lt: &Lifetimes,
    now: u64,
) -> ([Collected; 2], Vec<io::Error>) {
    let mut out = [Collected::default(); 2];
    let [rn4, rn6] = revnats;
    let results = [
        rn4.and_then(|rn| collect::<[u8; 4]>(cts[0], rn, lt, now, &mut out[0])),
        rn6.and_then(|rn| collect::<Ip6>(cts[1], rn, lt, now, &mut out[1])),
    ];
    (out, results.into_iter().filter_map(Result::err).collect())
}

/// The clock the datapath stamps entries with.
pub fn monotonic_coarse_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: valid out-pointer.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC_COARSE, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}
