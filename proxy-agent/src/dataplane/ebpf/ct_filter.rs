//! The conntrack filter's user side (`proxy_common::ct_filter`): filled when the map is created,
//! and rebuilt from the conntrack map's keys so that the bits of entries gone are dropped.
//!
//! The map is mmapable: the agent reads and writes its words in place, with the same atomic
//! operations the datapath uses on them.

use std::{
    io,
    os::fd::{AsFd, AsRawFd, BorrowedFd},
    path::{Path, PathBuf},
    sync::atomic::{AtomicU64, Ordering},
    time::Duration,
};

use aya::{
    maps::MapInfo,
    programs::{links::PinnedLink, ProgramInfo},
};
use proxy_common::{
    ct_filter::{self, CtFilter, HALF_WORDS},
    map_names, CtKey,
};

use super::{batch, loader};

/// A filter map's value, mapped into this process.
struct Mapped(batch::Mapped);

impl Mapped {
    fn of(fd: BorrowedFd<'_>) -> io::Result<Self> {
        batch::Mapped::of(fd, size_of::<CtFilter>()).map(Self)
    }

    /// Word `i` of the halves (`2 * HALF_WORDS` of them), or the control word after them.
    fn word(&self, i: usize) -> &AtomicU64 {
        assert!(i <= 2 * HALF_WORDS);
        // SAFETY: in bounds of the mapping (a `CtFilter`: the halves, then the control word),
        // 8-byte aligned; the datapath changes these words only atomically.
        unsafe { AtomicU64::from_ptr(self.0.ptr().cast::<u64>().add(i)) }
    }

    fn control(&self) -> &AtomicU64 {
        self.word(2 * HALF_WORDS)
    }

    fn half(&self, half: usize) -> impl Iterator<Item = &AtomicU64> {
        (half * HALF_WORDS..(half + 1) * HALF_WORDS).map(|i| self.word(i))
    }

    /// Every word of both halves set to `value` (the control word left alone).
    fn set_halves(&self, value: u64) {
        (0..2).flat_map(|h| self.half(h)).for_each(|w| w.store(value, Ordering::Relaxed));
    }

    /// Bits set in half `half`.
    fn bits(&self, half: usize) -> u64 {
        self.half(half).map(|w| u64::from(w.load(Ordering::Relaxed).count_ones())).sum()
    }

    /// The half lookups read (`None`: the control word is not one).
    fn read_half(&self) -> Option<usize> {
        ct_filter::half(self.control().load(Ordering::Acquire))
    }

    /// Calls `f` with the word (in half 0) and bit of each key of the conntrack map `ct` (keys
    /// of address `A`); returns how many keys it walked.
    fn walk<A: ct_filter::Addr>(ct: BorrowedFd<'_>, ct_value_size: usize, mut f: impl FnMut(usize, u64)) -> io::Result<u64> {
        batch::for_each_key(ct.as_fd(), size_of::<CtKey<A>>(), ct_value_size, |bytes| {
            // SAFETY: `bytes` holds one key of the map, a plain-data `CtKey<A>` (unaligned in
            // the buffer, hence the unaligned read).
            let key: CtKey<A> = unsafe { std::ptr::read_unaligned(bytes.as_ptr().cast()) };
            let (word, bit) = ct_filter::place(ct_filter::hash(&key));
            f(word, bit);
        })
    }
}

/// Fills a filter, lookups reading half 0: with every bit set when the family's conntrack map
/// may hold keys without their bits (`every_bit`), else with none. Done at load to a filter
/// created then: over a conntrack map adopted from pins, its entries have no bits yet, nor
/// have those the programs still attached (an older build's, until this run's links replace
/// them) insert meanwhile, and the first `rebuild` after the programs are replaced drops the
/// rest; a new conntrack map holds nothing. Done again while an older build's link stays
/// attached (`stale_links`).
pub fn fill(fd: BorrowedFd<'_>, every_bit: bool) -> io::Result<()> {
    let m = Mapped::of(fd)?;
    m.set_halves(if every_bit { u64::MAX } else { 0 });
    m.control().store(ct_filter::control(0), Ordering::Release);
    Ok(())
}

/// A filter mapped for the agent's own inserts into its conntrack map (the connections a
/// takeover adopts, `adopt`): each key's bit is set in both halves before its entry goes in,
/// as the datapath sets them (a rebuild running meanwhile is kept off by `RebuildLock`).
pub struct Marker(Mapped);

impl Marker {
    pub fn of(fd: BorrowedFd<'_>) -> io::Result<Self> {
        Mapped::of(fd).map(Self)
    }

    pub fn mark<A: ct_filter::Addr>(&self, key: &CtKey<A>) {
        let (word, bit) = ct_filter::place(ct_filter::hash(key));
        for half in 0..2 {
            self.0.word(half * HALF_WORDS + word).fetch_or(bit, Ordering::Relaxed);
        }
    }
}

/// What a rebuild found.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Rebuilt {
    /// Keys of the conntrack map it walked (its entries).
    pub keys: u64,
    /// Bits set in the half lookups now read, just after the walk.
    pub bits: u64,
}

/// Rebuilds the half of `filter` that lookups do not read from the keys `ct` holds (a
/// conntrack map with keys of address `A`), then turns lookups to it. See
/// `proxy_common::ct_filter` for why no tracked key is ever without its bit in the half read.
/// A failed walk leaves lookups where they were.
pub fn rebuild<A: ct_filter::Addr>(filter: BorrowedFd<'_>, ct: BorrowedFd<'_>, ct_value_size: usize) -> io::Result<Rebuilt> {
    let m = Mapped::of(filter)?;
    // An unwritten control word (the filter says "maybe" everywhere): half 0 is rebuilt.
    let target = m.read_half().map_or(0, |read| 1 - read);
    m.half(target).for_each(|w| w.store(0, Ordering::Relaxed));
    // A program that set a bit of this half before it was cleared may not have inserted its
    // key yet: once every run that began before the clear is over, that key is in the map
    // for the walk to find.
    grace_period();
    let keys = Mapped::walk::<A>(ct, ct_value_size, |word, bit| {
        m.word(target * HALF_WORDS + word).fetch_or(bit, Ordering::Relaxed);
    })?;
    let bits = m.bits(target);
    m.control().store(ct_filter::control(target), Ordering::Release);
    // The next rebuild clears the half just left: the runs that read it must be over first.
    grace_period();
    Ok(Rebuilt { keys, bits })
}

/// Waits until every BPF program run that began before the call is over. The programs run
/// inside RCU read-side sections (softirq, or with preemption off), so an RCU grace period is
/// one: `membarrier(MEMBARRIER_CMD_GLOBAL)` waits for one (`synchronize_rcu`). Where it is
/// refused (a `nohz_full` kernel, a seccomp policy), a second is far longer than any run.
fn grace_period() {
    const MEMBARRIER_CMD_GLOBAL: libc::c_int = 1;
    static SAID: std::sync::Once = std::sync::Once::new();
    // SAFETY: plain syscall without pointers.
    let rc = unsafe { libc::syscall(libc::SYS_membarrier, MEMBARRIER_CMD_GLOBAL, 0, 0) };
    if rc != 0 {
        let e = io::Error::last_os_error();
        SAID.call_once(
            || tracing::info!(error = %e, "membarrier(MEMBARRIER_CMD_GLOBAL) refused; the conntrack filter's rebuilds wait 1 s instead"),
        );
        std::thread::sleep(Duration::from_secs(1));
    }
}

/// TC and XDP link pins under `root` whose program looks a conntrack map of these pins up
/// without that family's conntrack filter beside it, on an interface that still exists: an
/// older build's, which this run has not replaced (XDP now off, an interface no longer
/// matched, or matched in another role, or an older agent beside this one). Such a program
/// tracks flows without setting their bits: while it stays attached, lookups could miss its
/// flows after a rebuild.
pub fn stale_links(root: &Path) -> io::Result<Vec<PathBuf>> {
    let id = |name: &str| MapInfo::from_pin(loader::maps_dir(root).join(name)).map(|i| i.id()).map_err(io::Error::other);
    let pairs = [(id(map_names::CT)?, id(map_names::CT_FILTER)?), (id(map_names::CT6)?, id(map_names::CT_FILTER6)?)];
    let Ok(dir) = std::fs::read_dir(loader::links_dir(root)) else { return Ok(Vec::new()) };
    let mut programs: Option<Vec<ProgramInfo>> = None;
    let mut stale = Vec::new();
    for entry in dir.flatten() {
        let Some((_, ifindex, _)) = entry.file_name().to_str().and_then(super::attach::parse_pin_hook) else { continue };
        // The kernel detached the link with its interface: it runs nothing.
        if !interface_exists(ifindex) {
            continue;
        }
        let Ok(link) = PinnedLink::from_pin(entry.path()) else { continue };
        let Ok(info) = aya::programs::links::FdLink::from(link).info() else { continue };
        let programs = programs.get_or_insert_with(|| aya::programs::loaded_programs().flatten().collect());
        let maps = programs.iter().find(|p| p.id() == info.program_id()).and_then(|p| p.map_ids().ok().flatten()).unwrap_or_default();
        if pairs.iter().any(|(ct, filter)| maps.contains(ct) && !maps.contains(filter)) {
            stale.push(entry.path());
        }
    }
    stale.sort();
    Ok(stale)
}

/// True when this network namespace has an interface of index `ifindex`.
fn interface_exists(ifindex: u32) -> bool {
    let mut name = [0 as libc::c_char; libc::IF_NAMESIZE];
    // SAFETY: the buffer has the IF_NAMESIZE bytes the call may write.
    !unsafe { libc::if_indextoname(ifindex, name.as_mut_ptr()) }.is_null()
}

/// Held while a rebuild runs: two agents on one node (a rollout that surges) must not rebuild
/// the same filter at once, or one could clear the half the other just turned lookups to.
pub struct RebuildLock {
    _dir: std::fs::File,
}

impl RebuildLock {
    /// The lock of the pins under `root` (on their maps directory), if no one else holds it.
    pub fn try_take(root: &Path) -> io::Result<Option<Self>> {
        let dir = std::fs::File::open(loader::maps_dir(root))?;
        // SAFETY: plain syscall on a descriptor this function owns.
        if unsafe { libc::flock(dir.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
            let e = io::Error::last_os_error();
            return if e.raw_os_error() == Some(libc::EWOULDBLOCK) { Ok(None) } else { Err(e) };
        }
        // Released when the descriptor closes.
        Ok(Some(Self { _dir: dir }))
    }
}

/// Keys of `ct` whose bit is clear in the half lookups read: packets of those flows would be
/// taken for packets of no flow. None, ever, is the filter's promise; for tests and diagnosis.
pub fn untracked_keys<A: ct_filter::Addr>(filter: BorrowedFd<'_>, ct: BorrowedFd<'_>, ct_value_size: usize) -> io::Result<u64> {
    let m = Mapped::of(filter)?;
    let Some(read) = m.read_half() else { return Ok(0) };
    let mut missing = 0;
    Mapped::walk::<A>(ct, ct_value_size, |word, bit| {
        if m.word(read * HALF_WORDS + word).load(Ordering::Relaxed) & bit == 0 {
            missing += 1;
        }
    })?;
    Ok(missing)
}

/// Clears every bit, the control word kept: the filter then says nothing is tracked. For
/// tests, which show with it that the datapath heeds the filter.
pub fn clear(filter: BorrowedFd<'_>) -> io::Result<()> {
    Mapped::of(filter)?.set_halves(0);
    Ok(())
}

/// Bits set in the half lookups read; `None` when the control word is not one (the filter
/// says "maybe" for every key).
pub fn bits_read(filter: BorrowedFd<'_>) -> io::Result<Option<u64>> {
    let m = Mapped::of(filter)?;
    Ok(m.read_half().map(|read| m.bits(read)))
}

/// Rebuilds both families' filters, IPv4's then IPv6's (`rebuild`): `filters` and `cts` are
/// the families' filter and conntrack maps, in that order.
pub fn rebuild_families(filters: [BorrowedFd<'_>; 2], cts: [BorrowedFd<'_>; 2]) -> io::Result<[Rebuilt; 2]> {
    use proxy_common::{CtEntry, Ip6};
    Ok([rebuild::<[u8; 4]>(filters[0], cts[0], size_of::<CtEntry>())?, rebuild::<Ip6>(filters[1], cts[1], size_of::<CtEntry<Ip6>>())?])
}
