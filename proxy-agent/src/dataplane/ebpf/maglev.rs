//! Maglev consistent hashing for north-south backend selection (Eisenbud et al., NSDI 2016).
//!
//! Each backend gets a pseudo-random permutation of the table's M positions (an offset and a
//! skip derived from its address and port); backends take turns claiming their next free
//! position until the table is full. Every node computes the same table from the same backends,
//! so a flow picks the same backend whichever node it reaches, and a change of one backend in N
//! moves about 1/N of the positions.
//!
//! Tables live in inner arrays of `LB4_MAGLEV_V1` or `LB6_MAGLEV_V1` (one per Service port's
//! external view of the family; an IPv6 member is its 16-byte address and port), made
//! memory-mappable so a change writes only the positions that differ, with plain 32-bit stores
//! the datapath sees atomically.

use std::{
    collections::{BTreeMap, BTreeSet},
    io,
    os::fd::{AsFd as _, AsRawFd as _, FromRawFd as _, OwnedFd},
    sync::atomic::{AtomicU32, Ordering},
};

use aya::maps::MapData;

use super::{
    batch::{sys_bpf, ElemAttr},
    ids::IdAllocator,
};
use crate::model::FrontendKey;

const BPF_MAP_CREATE: libc::c_long = 0;
const BPF_MAP_LOOKUP_ELEM: libc::c_long = 1;
const BPF_MAP_UPDATE_ELEM: libc::c_long = 2;
const BPF_MAP_DELETE_ELEM: libc::c_long = 3;
const BPF_MAP_GET_NEXT_KEY: libc::c_long = 4;
const BPF_MAP_GET_FD_BY_ID: libc::c_long = 14;
const BPF_MAP_TYPE_ARRAY: u32 = 2;
const BPF_F_MMAPABLE: u32 = 1 << 10;
const BPF_F_INNER_MAP: u32 = 1 << 12;
/// Must equal the flags of the inner-map template in the eBPF object.
pub const INNER_FLAGS: u32 = BPF_F_INNER_MAP | BPF_F_MMAPABLE;
/// Table entry of a position no backend holds (only in a table without backends).
pub const EMPTY: u32 = u32::MAX;

const OFFSET_SEED: u64 = 0x6d61_676c_6576_0001;
const SKIP_SEED: u64 = 0x6d61_676c_6576_0002;

/// The identity a backend's permutation is derived from: address and port, network order (6
/// bytes for IPv4, 18 for IPv6; its hashes cover those bytes only, so IPv4 tables are what
/// they were before IPv6 had them).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Member {
    bytes: [u8; 18],
    len: u8,
}

impl Member {
    pub fn bytes(&self) -> &[u8] {
        &self.bytes[..usize::from(self.len)]
    }
}

pub fn member(addr: std::net::IpAddr, port: u16) -> Member {
    let mut m = Member { bytes: [0; 18], len: 0 };
    let n = match addr {
        std::net::IpAddr::V4(a) => {
            m.bytes[..4].copy_from_slice(&a.octets());
            4
        }
        std::net::IpAddr::V6(a) => {
            m.bytes[..16].copy_from_slice(&a.octets());
            16
        }
    };
    m.bytes[n..n + 2].copy_from_slice(&port.to_be_bytes());
    m.len = n as u8 + 2;
    m
}

pub fn is_prime(n: u32) -> bool {
    n >= 2 && (2..).take_while(|d: &u32| u64::from(*d) * u64::from(*d) <= u64::from(n)).all(|d| !n.is_multiple_of(d))
}

/// The Maglev table of size `m` (a prime) for `members`: for each position, the index of the
/// member that holds it. The order of `members` matters (ties go to the earlier one), so every
/// node must pass them in the same order; callers sort them.
pub fn compute(members: &[Member], m: u32) -> Vec<u32> {
    let size = m as usize;
    let mut table = vec![EMPTY; size];
    if members.is_empty() || size == 0 {
        return table;
    }
    let m64 = u64::from(m);
    let perms: Vec<(u64, u64)> = members
        .iter()
        .map(|b| {
            let offset = proxy_common::hash::bytes64(OFFSET_SEED, b.bytes()) % m64;
            let skip = if m64 > 1 { proxy_common::hash::bytes64(SKIP_SEED, b.bytes()) % (m64 - 1) + 1 } else { 1 };
            (offset, skip)
        })
        .collect();
    let mut next = vec![0u64; members.len()];
    let mut filled = 0;
    loop {
        for (i, (offset, skip)) in perms.iter().enumerate() {
            // With m prime and 0 < skip < m the permutation visits every position, so a free
            // one is always found.
            loop {
                let pos = ((offset + next[i] * skip) % m64) as usize;
                next[i] += 1;
                if table[pos] == EMPTY {
                    table[pos] = i as u32;
                    filled += 1;
                    break;
                }
            }
            if filled == size {
                return table;
            }
        }
    }
}

#[repr(C)]
#[derive(Default)]
struct CreateAttr {
    map_type: u32,
    key_size: u32,
    value_size: u32,
    max_entries: u32,
    map_flags: u32,
    inner_map_fd: u32,
    numa_node: u32,
    map_name: [u8; 16],
}

fn elem(fd: i32, cmd: libc::c_long, key: &u32, value: Option<&mut u32>, flags: u64) -> io::Result<()> {
    let mut attr =
        ElemAttr { map_fd: fd as u32, _pad: 0, key: key as *const u32 as u64, value: value.map_or(0, |v| v as *mut u32 as u64), flags };
    sys_bpf(cmd, &mut attr).map(|_| ())
}

/// The kernel lays array elements out 8-byte aligned: a 4-byte value takes 8 in the mapping.
const ELEM_STRIDE: usize = 8;

/// One table: an mmapped array of backend ids.
struct Inner {
    /// None: a table in process memory only (`Maglev::in_memory`).
    fd: Option<OwnedFd>,
    ptr: *mut u32,
    entries: usize,
    bytes: usize,
}

// SAFETY: the mapping is owned by this value and only written through &mut self.
unsafe impl Send for Inner {}

impl Inner {
    fn create(m: u32) -> io::Result<Self> {
        let mut name = [0u8; 16];
        name[..10].copy_from_slice(b"MAGLEV_TBL");
        let mut attr = CreateAttr {
            map_type: BPF_MAP_TYPE_ARRAY,
            key_size: 4,
            value_size: 4,
            max_entries: m,
            map_flags: INNER_FLAGS,
            map_name: name,
            ..Default::default()
        };
        let fd = sys_bpf(BPF_MAP_CREATE, &mut attr)?;
        // SAFETY: the kernel just returned this fd to us.
        Self::map(unsafe { OwnedFd::from_raw_fd(fd as i32) }, m as usize)
    }

    /// The table with kernel id `id`; None when its size is not `m`.
    fn open(id: u32, m: u32) -> io::Result<Option<Self>> {
        #[repr(C)]
        struct ById {
            id: u32,
            next_id: u32,
            open_flags: u32,
        }
        let fd = sys_bpf(BPF_MAP_GET_FD_BY_ID, &mut ById { id, next_id: 0, open_flags: 0 })?;
        // SAFETY: the kernel just returned this fd to us.
        let fd = unsafe { OwnedFd::from_raw_fd(fd as i32) };
        let info = MapData::from_fd(fd.try_clone()?).and_then(|d| d.info()).map_err(io::Error::other)?;
        if info.max_entries() != m || info.value_size() != 4 {
            return Ok(None);
        }
        Self::map(fd, m as usize).map(Some)
    }

    fn map(fd: OwnedFd, entries: usize) -> io::Result<Self> {
        // SAFETY: sysconf has no preconditions.
        let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) } as usize;
        let bytes = (entries * ELEM_STRIDE).div_ceil(page) * page;
        // SAFETY: maps `bytes` of an mmapable array map, shared with the kernel.
        let ptr =
            unsafe { libc::mmap(std::ptr::null_mut(), bytes, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED, fd.as_raw_fd(), 0) };
        if ptr == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(Self { fd: Some(fd), ptr: ptr.cast(), entries, bytes })
    }

    /// A table of `m` entries in process memory, for `Maglev::in_memory`.
    fn anonymous(m: u32) -> io::Result<Self> {
        // SAFETY: sysconf has no preconditions.
        let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) } as usize;
        let bytes = (m as usize * ELEM_STRIDE).div_ceil(page) * page;
        // SAFETY: a private anonymous mapping of `bytes`, unmapped by Drop as `map`'s are.
        let ptr = unsafe {
            libc::mmap(std::ptr::null_mut(), bytes, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS, -1, 0)
        };
        if ptr == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(Self { fd: None, ptr: ptr.cast(), entries: m as usize, bytes })
    }

    fn get(&self, i: usize) -> u32 {
        assert!(i < self.entries);
        // SAFETY: in bounds of the mapping; the kernel side only reads it.
        unsafe { AtomicU32::from_ptr(self.ptr.byte_add(i * ELEM_STRIDE)) }.load(Ordering::Relaxed)
    }

    fn set(&mut self, i: usize, v: u32) {
        assert!(i < self.entries);
        // SAFETY: in bounds of the mapping; a 32-bit aligned store the datapath reads whole.
        unsafe { AtomicU32::from_ptr(self.ptr.byte_add(i * ELEM_STRIDE)) }.store(v, Ordering::Relaxed);
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        // SAFETY: unmaps exactly what `map` mapped.
        unsafe { libc::munmap(self.ptr.cast(), self.bytes) };
    }
}

pub struct Table {
    pub id: u32,
    /// Sorted members and their backend ids (the references the table holds).
    pub members: Vec<Member>,
    pub backend_ids: Vec<u32>,
    pub users: BTreeSet<FrontendKey>,
    inner: Inner,
    /// The table must be rebuilt (adopted with another size, or unreadable).
    stale: bool,
}

impl Table {
    /// Backend id at each position (for `trace`, tests and the disruption figures).
    pub fn entries(&self) -> Vec<u32> {
        (0..self.inner.entries).map(|i| self.inner.get(i)).collect()
    }
}

pub struct Maglev {
    /// None: the tables live in process memory only (`in_memory`).
    outer: Option<MapData>,
    size: u32,
    ids: IdAllocator,
    /// By Service port name.
    pub tables: BTreeMap<String, Table>,
    /// Found in the map at start and not claimed by a frontend yet.
    unclaimed: BTreeMap<u32, Option<Inner>>,
}

impl Maglev {
    /// Opens the outer map and everything a previous run left in it.
    pub fn adopt(outer: MapData, size: u32, limit: u32) -> io::Result<Self> {
        let mut me = Self { outer: Some(outer), size, ids: IdAllocator::new(limit), tables: BTreeMap::new(), unclaimed: BTreeMap::new() };
        let fd = me.outer.as_ref().expect("just set").fd().as_fd().as_raw_fd();
        let mut key: Option<u32> = None;
        loop {
            let mut next = 0u32;
            #[repr(C)]
            struct NextAttr {
                map_fd: u32,
                _pad: u32,
                key: u64,
                next_key: u64,
            }
            let mut attr = NextAttr {
                map_fd: fd as u32,
                _pad: 0,
                key: key.as_ref().map_or(0, |k| k as *const u32 as u64),
                next_key: &mut next as *mut u32 as u64,
            };
            match sys_bpf(BPF_MAP_GET_NEXT_KEY, &mut attr) {
                Ok(_) => {}
                Err(e) if e.raw_os_error() == Some(libc::ENOENT) => break,
                Err(e) => return Err(e),
            }
            let mut inner_id = 0u32;
            let inner = match elem(fd, BPF_MAP_LOOKUP_ELEM, &next, Some(&mut inner_id), 0) {
                Ok(()) => Inner::open(inner_id, size).unwrap_or(None),
                Err(_) => None,
            };
            me.ids.claim(next);
            me.unclaimed.insert(next, inner);
            key = Some(next);
        }
        Ok(me)
    }

    /// Tables kept in process memory, with no map beneath: what the map writer's unit tests
    /// run on (`tables`).
    pub fn in_memory(size: u32, limit: u32) -> Self {
        Self { outer: None, size, ids: IdAllocator::new(limit), tables: BTreeMap::new(), unclaimed: BTreeMap::new() }
    }

    fn new_inner(&self) -> io::Result<Inner> {
        match self.outer {
            Some(_) => Inner::create(self.size),
            None => Inner::anonymous(self.size),
        }
    }

    /// Makes `inner` the table at `id` in the outer map.
    fn attach(&self, id: u32, inner: &Inner) -> io::Result<()> {
        match (&self.outer, &inner.fd) {
            (Some(outer), Some(fd)) => {
                elem(outer.fd().as_fd().as_raw_fd(), BPF_MAP_UPDATE_ELEM, &id, Some(&mut (fd.as_raw_fd() as u32)), 0)
            }
            _ => Ok(()),
        }
    }

    fn detach(&self, id: u32) {
        if let Some(outer) = &self.outer {
            let _ = elem(outer.fd().as_fd().as_raw_fd(), BPF_MAP_DELETE_ELEM, &id, None, 0);
        }
    }

    pub fn size(&self) -> u32 {
        self.size
    }

    /// A frontend found programmed with table `id`: the table becomes `name`'s. `member_of`
    /// names the backend behind an id. Returns the backend ids the table holds, for the caller
    /// to count as references.
    pub fn claim(&mut self, id: u32, name: &str, user: FrontendKey, member_of: impl Fn(u32) -> Option<Member>) -> Vec<u32> {
        if let Some(t) = self.tables.get_mut(name) {
            t.users.insert(user);
            return Vec::new();
        }
        let Some(inner) = self.unclaimed.remove(&id) else { return Vec::new() };
        let (inner, stale) = match inner {
            Some(i) => (i, false),
            None => match self.new_inner() {
                // A table of another size (or unreadable): start a new one, swapped in on the
                // next write.
                Ok(i) => (i, true),
                Err(_) => return Vec::new(),
            },
        };
        let mut pairs: Vec<(Member, u32)> = Vec::new();
        if !stale {
            let mut seen = BTreeSet::new();
            for i in 0..inner.entries {
                let b = inner.get(i);
                if b != 0 && b != EMPTY && seen.insert(b) {
                    match member_of(b) {
                        Some(m) => pairs.push((m, b)),
                        None => {
                            pairs.clear();
                            break;
                        }
                    }
                }
            }
        }
        pairs.sort();
        let stale = stale || pairs.is_empty();
        let (members, backend_ids): (Vec<Member>, Vec<u32>) = pairs.into_iter().unzip();
        self.tables
            .insert(name.to_string(), Table { id, members, backend_ids: backend_ids.clone(), users: BTreeSet::from([user]), inner, stale });
        backend_ids
    }

    /// True when `name`'s table holds exactly these members with these ids.
    pub fn is_current(&self, name: &str, members: &[Member], ids: &[u32]) -> bool {
        self.tables.get(name).is_some_and(|t| !t.stale && t.members == members && t.backend_ids == ids)
    }

    pub fn table_id(&self, name: &str) -> Option<u32> {
        self.tables.get(name).map(|t| t.id)
    }

    /// Makes `name`'s table hold `members` (sorted) with backend ids `ids`, for which the caller
    /// holds one reference each, and adds `user`. Returns the table id and the ids whose
    /// references the caller must release now (the table's previous ones, or the new ones when
    /// nothing changed).
    pub fn write(&mut self, name: &str, members: &[Member], ids: &[u32], user: FrontendKey) -> io::Result<(u32, Vec<u32>)> {
        debug_assert!(members.windows(2).all(|w| w[0] < w[1]));
        let layout = compute(members, self.size);
        let wanted: Vec<u32> = layout
            .iter()
            .map(|i| match *i {
                EMPTY => 0,
                i => ids[i as usize],
            })
            .collect();
        // A stale table is replaced whole: a new one is filled, then swapped in.
        let replacement = match self.tables.get(name) {
            Some(t) if t.stale => Some(self.filled(t.id, &wanted)?),
            _ => None,
        };
        if let Some(t) = self.tables.get_mut(name) {
            t.users.insert(user);
            if let Some(inner) = replacement {
                t.inner = inner;
                t.stale = false;
            } else if t.members == members && t.backend_ids == ids {
                return Ok((t.id, ids.to_vec()));
            } else {
                for (pos, v) in wanted.iter().enumerate() {
                    if t.inner.get(pos) != *v {
                        t.inner.set(pos, *v);
                    }
                }
            }
            t.members = members.to_vec();
            let released = std::mem::replace(&mut t.backend_ids, ids.to_vec());
            return Ok((t.id, released));
        }
        let id = self.ids.alloc().ok_or_else(|| io::Error::other("no free Maglev table id"))?;
        match self.filled(id, &wanted) {
            Ok(inner) => {
                self.tables.insert(
                    name.to_string(),
                    Table { id, members: members.to_vec(), backend_ids: ids.to_vec(), users: BTreeSet::from([user]), inner, stale: false },
                );
                Ok((id, Vec::new()))
            }
            Err(e) => {
                self.ids.free(id);
                Err(e)
            }
        }
    }

    /// A new table holding `entries`, attached at `id`.
    fn filled(&self, id: u32, entries: &[u32]) -> io::Result<Inner> {
        let mut inner = self.new_inner()?;
        for (pos, v) in entries.iter().enumerate() {
            inner.set(pos, *v);
        }
        self.attach(id, &inner)?;
        Ok(inner)
    }

    /// `user` no longer uses `name`'s table. When it was the last, the table goes and the
    /// backend ids it held are returned for the caller to release.
    pub fn release(&mut self, name: &str, user: &FrontendKey) -> Vec<u32> {
        let Some(t) = self.tables.get_mut(name) else { return Vec::new() };
        t.users.remove(user);
        if !t.users.is_empty() {
            return Vec::new();
        }
        let t = self.tables.remove(name).expect("present");
        self.detach(t.id);
        self.ids.free(t.id);
        t.backend_ids
    }

    /// Deletes tables a previous run left that no frontend claimed.
    pub fn collect_garbage(&mut self) -> usize {
        let stray = std::mem::take(&mut self.unclaimed);
        for id in stray.keys() {
            if self.tables.values().any(|t| t.id == *id) {
                continue;
            }
            self.detach(*id);
            self.ids.free(*id);
        }
        stray.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const PINNED_V4: [u32; 13] = [2, 1, 2, 0, 1, 4, 2, 3, 4, 0, 1, 0, 3];
    const PINNED_V6: [u32; 13] = [1, 2, 4, 1, 0, 0, 0, 1, 4, 3, 3, 2, 2];

    fn members(n: u8) -> Vec<Member> {
        let mut v: Vec<Member> = (1..=n).map(|i| member(std::net::Ipv4Addr::new(10, 244, i / 100, i % 100 + 1).into(), 8080)).collect();
        v.sort();
        v
    }

    /// The tables are ABI: every node, of this build or an older one, must compute the same
    /// table from the same backends (an IPv4 member hashes its 6 bytes, as before IPv6 had
    /// Maglev).
    #[test]
    fn tables_are_pinned_for_both_families() {
        assert_eq!(compute(&members(5), 13), PINNED_V4, "IPv4");
        let mut v6: Vec<Member> =
            (1..=5u16).map(|i| member(std::net::Ipv6Addr::new(0xfd00, 0x244, 0, 0, 0, 0, 0, i).into(), 8080)).collect();
        v6.sort();
        assert_eq!(compute(&v6, 13), PINNED_V6, "IPv6");
        assert_eq!(member(std::net::Ipv4Addr::new(10, 0, 0, 1).into(), 80).bytes(), [10, 0, 0, 1, 0, 80]);
    }

    #[test]
    fn primes() {
        assert!(is_prime(16381) && is_prime(2) && is_prime(65537));
        assert!(!is_prime(16383) && !is_prime(1) && !is_prime(0) && !is_prime(65535));
    }

    #[test]
    fn every_position_is_held_and_shares_are_even() {
        let m = 16381;
        for n in [1u8, 3, 7, 100] {
            let t = compute(&members(n), m);
            assert_eq!(t.len(), m as usize, "n={n}: a position for every entry");
            assert!(t.iter().all(|i| (*i as usize) < usize::from(n)));
            let mut share = vec![0u32; usize::from(n)];
            t.iter().for_each(|i| share[*i as usize] += 1);
            let ideal = m / u32::from(n);
            // Maglev's fill order caps the imbalance at one position per round.
            assert!(share.iter().all(|s| s.abs_diff(ideal) <= 1), "n={n}: {share:?}");
        }
        let empty = compute(&[], m);
        assert!(empty.len() == m as usize && empty.iter().all(|e| *e == EMPTY), "no members: every position empty");
    }

    #[test]
    fn removing_one_backend_of_n_moves_about_one_nth() {
        let m = 16381;
        for n in [4u8, 10, 50] {
            let before_members = members(n);
            let before = compute(&before_members, m);
            // Remove the middle backend.
            let gone = usize::from(n) / 2;
            let mut after_members = before_members.clone();
            after_members.remove(gone);
            let after = compute(&after_members, m);
            let name_before = |i: u32| before_members[i as usize];
            let name_after = |i: u32| after_members[i as usize];
            let moved = (0..m as usize).filter(|p| name_before(before[*p]) != name_after(after[*p])).count();
            let must_move = before.iter().filter(|i| **i as usize == gone).count();
            let extra = moved - must_move;
            // Positions of surviving backends that moved anyway: Maglev keeps this small.
            assert!((extra as f64) < 0.02 * f64::from(m) * (f64::from(n) / 10.0).max(1.0), "n={n}: {moved} moved, {must_move} had to");
            assert!((moved as f64) / f64::from(m) < 1.0 / f64::from(n) + 0.03, "n={n}: {moved} of {m} moved");
        }
    }

    #[test]
    fn adding_a_backend_takes_positions_mostly_from_the_others() {
        let m = 16381;
        let before_members = members(9);
        let mut after_members = members(10);
        after_members.sort();
        let before = compute(&before_members, m);
        let after = compute(&after_members, m);
        let moved = (0..m as usize).filter(|p| before_members[before[*p] as usize] != after_members[after[*p] as usize]).count();
        assert!((moved as f64) / f64::from(m) < 0.1 + 0.03, "{moved} of {m} moved");
    }
}
