//! Walking the entries of a hash map with BPF_MAP_LOOKUP_BATCH: one syscall per 4096 entries
//! instead of one per entry (aya has no batch operations). Used for the conntrack gauge and the
//! conntrack filter's rebuild (`ct_filter`).

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
        // SAFETY: the attribute points at live buffers of the sizes the kernel will fill.
        let rc = unsafe { libc::syscall(libc::SYS_bpf, BPF_MAP_LOOKUP_BATCH, &mut attr as *mut BatchAttr, size_of::<BatchAttr>()) };
        let err = (rc < 0).then(io::Error::last_os_error);
        let last = match err {
            None => false,
            // The walk's end: `count` says what the last call still gave.
            Some(e) if e.raw_os_error() == Some(libc::ENOENT) => true,
            Some(e) => return Err(e),
        };
        keys.chunks_exact(key_size).take(attr.count as usize).for_each(&mut f);
        total += u64::from(attr.count);
        if last {
            return Ok(total);
        }
        token_in = token_out;
        first = false;
    }
}
