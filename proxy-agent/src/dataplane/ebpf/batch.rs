//! The bpf syscalls aya lacks or does not offer on a bare descriptor. Walking the entries of a
//! hash map with BPF_MAP_LOOKUP_BATCH: one syscall per 4096 entries instead of one per entry
//! (aya has no batch operations), for the conntrack gauge, the conntrack filter's rebuild
//! (`ct_filter`) and the removal of expired flows (`ct_gc`), which also reads and removes
//! single entries; `maglev`'s calls; and the mapping of an mmapable array's values.

use std::{io, os::fd::AsRawFd};

const BPF_MAP_LOOKUP_BATCH: libc::c_long = 24;
const CHUNK: u32 = 4096;

/// The `batch` member of `union bpf_attr`.
#[repr(C)]
#[derive(Default)]
struct BatchAttr {
    in_batch: u64,
    out_batch: u64,
    keys: u64,
    values: u64,
    count: u32,
    map_fd: u32,
    elem_flags: u64,
    flags: u64,
}

/// Entries in the hash map behind `fd`.
pub fn count_entries(fd: impl AsRawFd, key_size: usize, value_size: usize) -> io::Result<u64> {
    for_each_key(fd, key_size, value_size, |_| {})
}

/// Calls `f` with the bytes of each key of the hash map behind `fd`, a bucket at a time (an
/// entry there from the first call to the last is seen once); returns how many it saw.
pub fn for_each_key(fd: impl AsRawFd, key_size: usize, value_size: usize, mut f: impl FnMut(&[u8])) -> io::Result<u64> {
    for_each_entry(fd, key_size, value_size, |k, _| f(k))
}

/// `for_each_key` with each key's value. `f` may remove entries of the map (the walk goes on
/// from the bucket after the last it was given).
pub fn for_each_entry(fd: impl AsRawFd, key_size: usize, value_size: usize, mut f: impl FnMut(&[u8], &[u8])) -> io::Result<u64> {
    let mut keys = vec![0u8; key_size * CHUNK as usize];
    let mut values = vec![0u8; value_size * CHUNK as usize];
    // Hash maps use a 4-byte bucket index as the batch token.
    let (mut token_in, mut token_out) = (0u64, 0u64);
    let mut total = 0u64;
    let mut first = true;
    loop {
        let mut attr = BatchAttr {
            in_batch: if first { 0 } else { &raw mut token_in as u64 },
            out_batch: &raw mut token_out as u64,
            keys: keys.as_mut_ptr() as u64,
            values: values.as_mut_ptr() as u64,
            count: CHUNK,
            map_fd: fd.as_raw_fd() as u32,
            ..Default::default()
        };
        // The attribute points at live buffers of the sizes the kernel will fill.
        let last = match sys_bpf(BPF_MAP_LOOKUP_BATCH, &mut attr) {
            Ok(_) => false,
            // The walk's end: `count` says what the last call still gave.
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => true,
            Err(e) => return Err(e),
        };
        keys.chunks_exact(key_size).zip(values.chunks_exact(value_size)).take(attr.count as usize).for_each(|(k, v)| f(k, v));
        total += u64::from(attr.count);
        if last {
            return Ok(total);
        }
        token_in = token_out;
        first = false;
    }
}

const BPF_MAP_LOOKUP_ELEM: libc::c_long = 1;
const BPF_MAP_UPDATE_ELEM: libc::c_long = 2;
const BPF_MAP_LOOKUP_AND_DELETE_ELEM: libc::c_long = 21;
const BPF_NOEXIST: u64 = 1;
const BPF_EXIST: u64 = 2;

/// The element members of `union bpf_attr`.
#[repr(C)]
#[derive(Default)]
pub(super) struct ElemAttr {
    pub map_fd: u32,
    pub _pad: u32,
    pub key: u64,
    pub value: u64,
    pub flags: u64,
}

/// The bpf syscall `cmd` with `attr`; its return value.
pub fn sys_bpf<T>(cmd: libc::c_long, attr: &mut T) -> io::Result<i64> {
    // SAFETY: `attr` is a live, correctly laid out bpf_attr prefix for `cmd`.
    let rc = unsafe { libc::syscall(libc::SYS_bpf, cmd, attr as *mut T, size_of::<T>()) };
    if rc < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(rc)
    }
}

/// The value at `key` in the hash map behind `fd` (keys `K`, values `V`, plain data), or None.
/// A lookup from here leaves an LRU map's order alone.
pub fn lookup<K: aya::Pod, V: aya::Pod>(fd: impl AsRawFd, key: &K) -> io::Result<Option<V>> {
    elem_value(BPF_MAP_LOOKUP_ELEM, fd, key)
}

/// Takes the entry at `key` out of the hash map behind `fd` (keys `K`, values `V`, plain data)
/// in one step, which no packet can come between: its value, or None when it was not there.
/// (BPF_MAP_LOOKUP_AND_DELETE_ELEM: hash maps, LRU ones included, since Linux 5.14.)
pub fn take<K: aya::Pod, V: aya::Pod>(fd: impl AsRawFd, key: &K) -> io::Result<Option<V>> {
    elem_value(BPF_MAP_LOOKUP_AND_DELETE_ELEM, fd, key)
}

/// A call that reads the value at `key` (`lookup`, `take`); None where the key is not there.
fn elem_value<K: aya::Pod, V: aya::Pod>(cmd: libc::c_long, fd: impl AsRawFd, key: &K) -> io::Result<Option<V>> {
    let mut value = std::mem::MaybeUninit::<V>::zeroed();
    let mut attr =
        ElemAttr { map_fd: fd.as_raw_fd() as u32, key: key as *const K as u64, value: value.as_mut_ptr() as u64, ..Default::default() };
    match sys_bpf(cmd, &mut attr) {
        // SAFETY: zeroed, then written by the kernel; any bytes are a valid `V` (Pod).
        Ok(_) => Ok(Some(unsafe { value.assume_init() })),
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => Ok(None),
        Err(e) => Err(e),
    }
}

/// Puts `value` at `key` in the map behind `fd` unless an entry is there (BPF_NOEXIST): false
/// when one was.
pub fn put_back<K: aya::Pod, V: aya::Pod>(fd: impl AsRawFd, key: &K, value: &V) -> io::Result<bool> {
    match update(fd, key, value, BPF_NOEXIST) {
        Ok(()) => Ok(true),
        Err(e) if e.raw_os_error() == Some(libc::EEXIST) => Ok(false),
        Err(e) => Err(e),
    }
}

/// Writes `value` at `key` where an entry is (BPF_EXIST); Ok also when there is none any more.
pub fn replace<K: aya::Pod, V: aya::Pod>(fd: impl AsRawFd, key: &K, value: &V) -> io::Result<()> {
    match update(fd, key, value, BPF_EXIST) {
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => Ok(()),
        r => r,
    }
}

fn update<K: aya::Pod, V: aya::Pod>(fd: impl AsRawFd, key: &K, value: &V, flags: u64) -> io::Result<()> {
    let mut attr = ElemAttr {
        map_fd: fd.as_raw_fd() as u32,
        key: key as *const K as u64,
        value: value as *const V as u64,
        flags,
        ..Default::default()
    };
    sys_bpf(BPF_MAP_UPDATE_ELEM, &mut attr).map(drop)
}

/// The values of an mmapable array map (BPF_F_MMAPABLE), mapped into this process: the
/// conntrack filter (`ct_filter`) and the flow cache's generation. Unmapped when dropped.
pub struct Mapped {
    ptr: *mut u8,
    bytes: usize,
}

impl Mapped {
    /// Maps the first `len` bytes of values of the array behind `fd` (whole pages).
    pub fn of(fd: impl AsRawFd, len: usize) -> io::Result<Self> {
        // SAFETY: sysconf has no preconditions.
        let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) } as usize;
        let bytes = len.div_ceil(page) * page;
        // SAFETY: maps an mmapable array map's values, shared with the kernel; unmapped by Drop.
        let ptr =
            unsafe { libc::mmap(std::ptr::null_mut(), bytes, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED, fd.as_raw_fd(), 0) };
        if ptr == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        Ok(Self { ptr: ptr.cast(), bytes })
    }

    /// The start of the values (page-aligned).
    pub fn ptr(&self) -> *mut u8 {
        self.ptr
    }
}

impl Drop for Mapped {
    fn drop(&mut self) {
        // SAFETY: unmaps exactly what `of` mapped.
        unsafe { libc::munmap(self.ptr.cast(), self.bytes) };
    }
}
