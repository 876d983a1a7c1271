//! Map values behind safe functions: the one module that dereferences the pointers map lookups
//! return, as `access` is for packet data.
//!
//! A lookup's pointer stays valid until the program returns, but what it points at is not the
//! program's alone. Another CPU may write a shared map's value meanwhile. And an element can
//! change hands under the pointer: the LRU maps (conntrack, affinity, the socket maps) are
//! preallocated, so an element deleted or evicted while a program holds it goes back on the
//! free list at once and may be filled for another key; hash maps without preallocation free
//! theirs after an RCU grace period. So values leave this module as copies read at once
//! (`copy`), or as a `Slot` that reads and writes fields in place (conntrack entries,
//! counters). Every value here is plain data, so a racing writer can only mix two versions'
//! fields, and a write after the element changed hands lands in another key's entry of the
//! same map; the callers' comments say why each write tolerates both (at worst a flag, a
//! timestamp or a cached route of another flow, until its next refresh). That is the BPF
//! memory model every program lives with, not something Rust's references could promise:
//! a `Slot` hands out a reference only for the length of one closure, and takes `&mut self` to
//! write, so one handle cannot alias itself. Per-CPU slots (`per_cpu`) are this CPU's, with
//! the caveat written there.

use core::{
    borrow::Borrow,
    intrinsics::{atomic_xadd, AtomicOrdering},
    ptr::NonNull,
};

use aya_ebpf::btf_maps::{Array, HashMap, HashOfMaps, LruHashMap, PerCpuArray};
use proxy_common::BackendFlows;

/// A map whose values can be looked up by key.
pub trait Values<K, V> {
    fn ptr(&self, key: &K) -> Option<*mut V>;
}

impl<K, V, const M: usize, const F: usize> Values<K, V> for HashMap<K, V, M, F> {
    #[inline(always)]
    fn ptr(&self, key: &K) -> Option<*mut V> {
        self.get_ptr_mut(key)
    }
}

impl<K, V, const M: usize, const F: usize> Values<K, V> for LruHashMap<K, V, M, F> {
    #[inline(always)]
    fn ptr(&self, key: &K) -> Option<*mut V> {
        self.get_ptr_mut(key)
    }
}

impl<V, const M: usize, const F: usize> Values<u32, V> for Array<V, M, F> {
    #[inline(always)]
    fn ptr(&self, key: &u32) -> Option<*mut V> {
        self.get_ptr_mut(*key)
    }
}

/// A copy of the value under `key`, read at once. (Keys are taken by value or by reference,
/// as aya's lookups take them: a reference to a field of a local struct would make the
/// compiler keep the whole struct on the stack, which the programs cannot spare.)
#[inline(always)]
pub fn copy<K, V: Copy>(map: &impl Values<K, V>, key: impl Borrow<K>) -> Option<V> {
    // SAFETY: a live map value of plain data (see the module comment), copied at once.
    map.ptr(key.borrow()).map(|p| unsafe { *p })
}

/// A copy of the value at `index` of the inner array under `key` of a map of arrays (the
/// Maglev tables), read at once.
#[inline(always)]
pub fn copy_inner<K, V: Copy, const N: usize, const IF: usize, const M: usize, const F: usize>(
    map: &HashOfMaps<K, Array<V, N, IF>, M, F>,
    key: &K,
    index: u32,
) -> Option<V> {
    // SAFETY: a live map value of plain data (see the module comment), copied at once.
    unsafe { map.get_value(key, &index) }.copied()
}

/// Copies `from` over `to` a word at a time: a copy between two map values as one assignment
/// became a call to a byte-at-a-time `memmove`. `T` must be 8-byte aligned and a multiple of
/// 8 bytes long (checked at compile time).
#[inline(always)]
pub fn copy_words<T: Copy>(to: &mut T, from: &T) {
    const { assert!(align_of::<T>() >= 8 && size_of::<T>() % 8 == 0) };
    let (to, from) = ((to as *mut T).cast::<u64>(), (from as *const T).cast::<u64>());
    for i in 0..size_of::<T>() / 8 {
        // SAFETY: within both values, aligned (checked above); plain data. Volatile, so that
        // the compiler does not merge the words back into that call.
        unsafe { to.add(i).write_volatile(from.add(i).read_volatile()) };
    }
}

/// Whether `key` has a value.
#[inline(always)]
pub fn contains<K, V>(map: &impl Values<K, V>, key: impl Borrow<K>) -> bool {
    map.ptr(key.borrow()).is_some()
}

/// A value in a shared map, read and written in place (see the module comment). Not `Copy`:
/// writing takes `&mut self`, so a handle is never borrowed twice at once.
pub struct Slot<V>(NonNull<V>);

impl<V> Slot<V> {
    #[inline(always)]
    pub fn of<K>(map: &impl Values<K, V>, key: impl Borrow<K>) -> Option<Self> {
        map.ptr(key.borrow()).and_then(NonNull::new).map(Self)
    }

    /// The whole value, read at once.
    #[inline(always)]
    pub fn get(&self) -> V
    where
        V: Copy,
    {
        // SAFETY: a live map value of plain data (see the module comment).
        unsafe { *self.0.as_ptr() }
    }

    /// Reads and changes fields in place. Other CPUs may do the same meanwhile: the caller's
    /// changes must be ones a racing writer's can overwrite without harm.
    #[inline(always)]
    pub fn update<R>(&mut self, f: impl FnOnce(&mut V) -> R) -> R {
        // SAFETY: a live map value of plain data (see the module comment); the reference does
        // not outlive the call.
        unsafe { f(&mut *self.0.as_ptr()) }
    }

    /// Reads fields in place (where a copy of the whole value would take stack the programs
    /// do not have).
    #[inline(always)]
    pub fn read<R>(&self, f: impl FnOnce(&V) -> R) -> R {
        // SAFETY: a live map value of plain data (see the module comment); the reference does
        // not outlive the call.
        unsafe { f(self.0.as_ref()) }
    }
}

impl Slot<BackendFlows> {
    /// One more flow to the backend: a counter all CPUs share, hence the atomic add. (The bpf
    /// target does not expose AtomicU64::fetch_add, but LLVM lowers the intrinsic to
    /// BPF_ATOMIC_ADD.)
    #[inline(always)]
    pub fn count_flow(self) {
        let p = self.0.as_ptr();
        // SAFETY: a field of a live map value, changed by one atomic instruction.
        unsafe { atomic_xadd::<u64, u64, { AtomicOrdering::Relaxed }>(&raw mut (*p).flows, 1) };
    }
}

/// This CPU's value at `index` of a per-CPU array, to use as scratch space or a private
/// counter.
///
/// # Safety
/// No other reference to the same slot may be live while the returned one is used: a program
/// takes each slot once and drops it before it returns (the reference's lifetime is the map's,
/// which the compiler cannot hold it to). Programs do not migrate between CPUs while they run,
/// so other CPUs never touch it; but a program in process context (the socket hooks) can be
/// interrupted by a TC or XDP program on the same CPU, so a slot both kinds use (the packet
/// counters, the clock cache) may lose an update or be read mid-change, which the callers
/// accept.
#[inline(always)]
pub unsafe fn per_cpu<V, const M: usize, const F: usize>(map: &PerCpuArray<V, M, F>, index: u32) -> Option<&mut V> {
    // SAFETY: the caller's contract above.
    map.get_ptr_mut(index).map(|p| unsafe { &mut *p })
}
