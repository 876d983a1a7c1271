//! Word loads and stores of packet data at any alignment.
//!
//! Header fields are byte arrays, so the compiler assumes nothing about their alignment, and
//! the BPF backend splits every unaligned access into single bytes: an IPv4 address becomes
//! four loads, three shifts and three ors (and the IP header of an Ethernet frame is only
//! 2-byte aligned, so it often really is unaligned). The kernel allows unaligned packet access
//! on the architectures that have it cheap (x86-64, arm64: CONFIG_HAVE_EFFICIENT_UNALIGNED_ACCESS,
//! unless a program asks for BPF_F_STRICT_ALIGNMENT), so these functions emit one load or store
//! instruction each. They are written in assembly because a plain Rust access at the wrong
//! alignment would be undefined behaviour, and the backend's target feature that allows
//! unaligned access applies to the stack too, where the verifier forbids it.
//!
//! Every function takes the address of bytes the caller has bounds-checked against
//! `data_end` (so the verifier knows them to be in the packet).

use core::arch::asm;

/// Loads 2 bytes at `p`.
///
/// # Safety
/// `p..p + 2` must be inside the packet's checked range.
#[inline(always)]
pub unsafe fn load2(p: usize) -> [u8; 2] {
    let v: u16;
    // SAFETY: the caller's bounds check; one load, no side effects.
    unsafe { asm!("{v} = *(u16 *)({p} + 0)", v = out(reg) v, p = in(reg) p, options(readonly, nostack, preserves_flags)) };
    v.to_ne_bytes()
}

/// Loads 4 bytes at `p`.
///
/// # Safety
/// `p..p + 4` must be inside the packet's checked range.
#[inline(always)]
pub unsafe fn load4(p: usize) -> [u8; 4] {
    let v: u32;
    // SAFETY: the caller's bounds check; one load, no side effects.
    unsafe { asm!("{v} = *(u32 *)({p} + 0)", v = out(reg) v, p = in(reg) p, options(readonly, nostack, preserves_flags)) };
    v.to_ne_bytes()
}

/// Stores 2 bytes at `p`.
///
/// # Safety
/// `p..p + 2` must be inside the packet's checked range, and the packet writable (TC).
#[inline(always)]
pub unsafe fn store2(p: usize, bytes: [u8; 2]) {
    let v = u16::from_ne_bytes(bytes);
    // SAFETY: the caller's bounds check.
    unsafe { asm!("*(u16 *)({p} + 0) = {v}", v = in(reg) v, p = in(reg) p, options(nostack, preserves_flags)) };
}

/// Stores 4 bytes at `p`.
///
/// # Safety
/// `p..p + 4` must be inside the packet's checked range, and the packet writable (TC).
#[inline(always)]
pub unsafe fn store4(p: usize, bytes: [u8; 4]) {
    let v = u32::from_ne_bytes(bytes);
    // SAFETY: the caller's bounds check.
    unsafe { asm!("*(u32 *)({p} + 0) = {v}", v = in(reg) v, p = in(reg) p, options(nostack, preserves_flags)) };
}

/// Loads 4 bytes at `p` as a native-order word.
///
/// # Safety
/// `p..p + 4` must be inside the packet's checked range.
#[inline(always)]
pub unsafe fn load_word(p: usize) -> u32 {
    let v: u32;
    // SAFETY: the caller's bounds check; one load, no side effects.
    unsafe { asm!("{v} = *(u32 *)({p} + 0)", v = out(reg) v, p = in(reg) p, options(readonly, nostack, preserves_flags)) };
    v
}

/// Stores a native-order word as the 4 bytes at `p`.
///
/// # Safety
/// `p..p + 4` must be inside the packet's checked range, and the packet writable (TC).
#[inline(always)]
pub unsafe fn store_word(p: usize, v: u32) {
    // SAFETY: the caller's bounds check.
    unsafe { asm!("*(u32 *)({p} + 0) = {v}", v = in(reg) v, p = in(reg) p, options(nostack, preserves_flags)) };
}

/// Stores 8 bytes at `p` as one native-order doubleword.
///
/// # Safety
/// `p..p + 8` must be inside the packet's checked range, and the packet writable (TC).
#[inline(always)]
#[allow(dead_code, reason = "only the lab object's frame generator (bench.rs) uses it; the agent's object includes this module too")]
pub unsafe fn store8(p: usize, v: u64) {
    // SAFETY: the caller's bounds check.
    unsafe { asm!("*(u64 *)({p} + 0) = {v}", v = in(reg) v, p = in(reg) p, options(nostack, preserves_flags)) };
}
