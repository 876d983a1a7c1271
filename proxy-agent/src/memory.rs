//! The allocator's hold on memory. glibc's malloc gives each thread that allocates an arena of
//! its own (up to eight per core), and an arena keeps what was freed in it wherever a live
//! allocation shares its pages: after a list of 30,000 Services, the arena of the threads that
//! decode API responses held 114 MiB for 13 MiB still in use. One arena is plenty for an agent
//! whose work is one control loop (freed space is then reused by the next allocation, whichever
//! thread makes it), and what a large change freed is handed back once it is done.
//! (`cargo xtask bench footprint`: 287 MiB before, 187 MiB with both; see the README.)

/// Allocations from this size up get pages of their own (mmap), which go back to the kernel
/// when freed. glibc's default starts at 128 KiB but raises the threshold to the size of each
/// mapped block freed, up to 32 MiB: after the first large API list was decoded (its body and
/// the Vec of its items are tens of MiB), later lists landed in the arena, between live
/// objects, and stayed there. Setting the threshold fixes it.
const MMAP_THRESHOLD: i32 = 256 * 1024;

/// Caps malloc's arenas and fixes the mmap threshold; call before any thread starts.
pub fn limit_arenas() {
    #[cfg(target_env = "gnu")]
    // SAFETY: mallopt only sets a tunable; called before other threads exist.
    unsafe {
        libc::mallopt(libc::M_ARENA_MAX, 1);
        libc::mallopt(libc::M_MMAP_THRESHOLD, MMAP_THRESHOLD);
    }
}

/// Returns the free pages of every arena to the kernel (a walk of malloc's free lists: call it
/// after large changes and now and then, not on every sync).
pub fn release_free() {
    #[cfg(target_env = "gnu")]
    // SAFETY: malloc_trim takes no pointers and is safe to call at any time.
    unsafe {
        libc::malloc_trim(0);
    }
}
