//! Cleanup when a run by hand is interrupted. Namespaces, pins and lab directories are removed
//! when their owners drop, also on a panic; but Ctrl-C (or a SIGTERM) ends a process without
//! unwinding, and a benchmark stopped that way left its namespaces, its bpffs mounts and its
//! agent behind. Each of those owners registers here how to remove what it made, and a signal
//! that ends the process runs those, newest first. A binary of ours calls `clean_up_on_signals`
//! first thing; a test binary, whose `main` is libtest's, catches the signals from its first
//! registration on (a Ctrl-C in `cargo test` then removes the namespaces of the tests it
//! stopped; so does cargo's end, which a SIGTERM to cargo alone brings). An owner that drops
//! normally takes its registration back (and cleans up itself).

use std::{
    collections::BTreeMap,
    io::Write,
    os::fd::{FromRawFd, OwnedFd, RawFd},
    sync::{
        atomic::{AtomicBool, AtomicI32, AtomicU64, Ordering},
        Mutex, MutexGuard, OnceLock,
    },
    thread::ThreadId,
};

type Cleanup = Box<dyn FnOnce() + Send>;

#[derive(Default)]
struct Pending {
    cleanups: BTreeMap<u64, Cleanup>,
    /// Set when the cleanups have been taken to run: nothing registered later waits for them.
    closed: bool,
}

/// Cleanups by registration order.
struct Registry {
    pending: Mutex<Pending>,
    next: AtomicU64,
}

/// The process's: what `clean_up_on_signals` runs.
static REGISTRY: Registry = Registry::new();

impl Registry {
    const fn new() -> Self {
        Self { pending: Mutex::new(Pending { cleanups: BTreeMap::new(), closed: false }), next: AtomicU64::new(0) }
    }

    fn pending(&self) -> MutexGuard<'_, Pending> {
        // A panic elsewhere while holding the lock leaves the map as it was: still usable.
        self.pending.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Keeps `cleanup` for `run`. Once `run` has begun, there is no later: `cleanup` runs at
    /// once, and a thread other than the cleaner's, which went on making things while the
    /// process ends, waits for the end (`park_for_good`).
    fn register(&'static self, cleanup: impl FnOnce() + Send + 'static) -> Registration {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let mut pending = self.pending();
        if pending.closed {
            drop(pending);
            cleanup();
            if ending_elsewhere() {
                park_for_good();
            }
            return Registration { registry: self, id };
        }
        pending.cleanups.insert(id, Box::new(cleanup));
        Registration { registry: self, id }
    }

    /// Runs and forgets every registered cleanup, newest first (as drops would); one that
    /// panics does not keep the others from running.
    fn run(&self) {
        let all = {
            let mut pending = self.pending();
            pending.closed = true;
            std::mem::take(&mut pending.cleanups)
        };
        for (_, cleanup) in all.into_iter().rev() {
            let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(cleanup));
        }
    }
}

/// What `register` returned: dropping it forgets the cleanup without running it.
#[must_use = "the cleanup is forgotten when this drops"]
pub struct Registration {
    registry: &'static Registry,
    id: u64,
}

impl Drop for Registration {
    fn drop(&mut self) {
        // The closure drops after the lock is released.
        let removed = self.registry.pending().cleanups.remove(&self.id);
        drop(removed);
    }
}

/// Runs `cleanup` if a signal ends the process before the returned registration drops. The
/// first registration of a process that did not call `clean_up_on_signals` (a test binary)
/// catches the signals still at their default action, without becoming the subreaper, and
/// (where SIGTERM was at its default) takes its parent's end, cargo's, as a SIGTERM.
pub fn register(cleanup: impl FnOnce() + Send + 'static) -> Registration {
    CATCHING.call_once(|| catch_signals(false));
    REGISTRY.register(cleanup)
}

/// Set by the signal handler: from then on the process is ending.
static INTERRUPTED: AtomicBool = AtomicBool::new(false);
/// The signal that ended it.
static SIGNAL: AtomicI32 = AtomicI32::new(0);
/// The write end of the pipe the handler wakes the cleanup thread through.
static WAKE: AtomicI32 = AtomicI32::new(-1);
/// The cleanup thread, which alone goes on once the process is ending.
static CLEANER: OnceLock<ThreadId> = OnceLock::new();

/// The signals that end a run by hand: Ctrl-C, `kill`, a closed terminal.
const SIGNALS: [i32; 3] = [libc::SIGINT, libc::SIGTERM, libc::SIGHUP];

/// This process (a child between fork and exec runs the handler too).
static PID: AtomicI32 = AtomicI32::new(0);

extern "C" fn on_signal(signal: i32) {
    // Only async-signal-safe work: atomics, getpid, write, signal, raise; errno as it was.
    // SAFETY: errno is this thread's; read here and put back before returning.
    let errno = unsafe { *libc::__errno_location() };
    // SAFETY: getpid has no preconditions.
    if unsafe { libc::getpid() } != PID.load(Ordering::SeqCst) {
        // A child not yet exec'd: it ends as it would have without us.
        // SAFETY: the default action, delivered to that child itself.
        unsafe {
            libc::signal(signal, libc::SIG_DFL);
            libc::raise(signal);
        }
    } else if !INTERRUPTED.swap(true, Ordering::SeqCst) {
        SIGNAL.store(signal, Ordering::SeqCst);
        let fd = WAKE.load(Ordering::SeqCst);
        // SAFETY: writes one byte from a valid buffer to the pipe made for it.
        unsafe { libc::write(fd, [1u8].as_ptr().cast(), 1) };
    } else if signal == libc::SIGINT {
        // Ctrl-C again while the cleanup runs (a hung `ip`, say): end now, as without us. Not
        // a SIGHUP (a terminal whose `sudo` the first Ctrl-C ended sends one), nor a SIGTERM:
        // one sent to our process group reaches us twice when `cargo xtask`, our parent,
        // passes its own on, or once more from a test binary stopping its children; SIGKILL
        // is the way to end us at once.
        // SAFETY: the default action, delivered to ourselves.
        unsafe {
            libc::signal(signal, libc::SIG_DFL);
            libc::raise(signal);
        }
    }
    // SAFETY: as above.
    unsafe { *libc::__errno_location() = errno };
}

/// Stops the calling thread until the process exits.
fn park_for_good() -> ! {
    loop {
        std::thread::park();
    }
}

/// Set once the signals are caught (by `clean_up_on_signals` or the first registration).
static CATCHING: std::sync::Once = std::sync::Once::new();

/// Catches SIGINT, SIGTERM and SIGHUP (those at their default action: not the ones `nohup`
/// ignores, nor one the binary handles itself, as the demo handles Ctrl-C): the first one makes
/// a thread of its own stop this process's children (`stop_children`: the labs' agents; through
/// `PR_SET_CHILD_SUBREAPER`, also what they started, such as a guest's qemu), run the registered
/// cleanups, and then end the process by that signal, as it would have ended without us (a
/// shell loop sees the Ctrl-C). A handler, not a blocked mask: child processes inherit a mask
/// (std no longer resets it), and an agent that could not see its SIGTERM would never stop;
/// exec resets a handler to the default. Call it in `main` first; later calls do nothing (nor
/// does it after a registration caught the signals: the process is then no subreaper).
pub fn clean_up_on_signals() {
    CATCHING.call_once(|| catch_signals(true));
}

/// `reaper`: become the subreaper too. Not for a test binary, whose tests may start daemons
/// (runc's container processes) that must go to init when their parent exits, not stay our
/// zombies.
fn catch_signals(reaper: bool) {
    let mut fds = [0 as RawFd; 2];
    // SAFETY: pipe2 fills the two descriptors it creates.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        eprintln!("cannot catch Ctrl-C ({}): an interrupted run may leave namespaces behind", std::io::Error::last_os_error());
        return;
    }
    // SAFETY: both are fresh descriptors owned from here on (the write end for good).
    let wake = unsafe { OwnedFd::from_raw_fd(fds[0]) };
    WAKE.store(fds[1], Ordering::SeqCst);
    PID.store(std::process::id() as i32, Ordering::SeqCst);
    // A test binary's parent is cargo, which ends on a SIGTERM without passing it on or waiting
    // for us (`kill <cargo>`, a CI job's timeout, `cargo xtask test` passing its own on): its
    // end is then our SIGTERM, asked for by the cleanup thread below. Not for binaries that call
    // `clean_up_on_signals`, nor for one that handles SIGTERM itself (the demo): those may be
    // started in the background and outlive what started them.
    let parent_death = !reaper && at_default(libc::SIGTERM);
    // SAFETY: getppid has no preconditions.
    let parent = unsafe { libc::getppid() };
    let (asked, asked_rx) = std::sync::mpsc::channel();
    let cleaner = std::thread::spawn(move || {
        // Asked here: the kernel sends it for each of our threads that asked and is still
        // alive, and this one lives as long as the process (a test's own thread ends with its
        // test). It comes when the thread that started us ends: cargo starts test binaries
        // from its main thread.
        // SAFETY: prctl with plain integer arguments.
        if parent_death && unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM, 0, 0, 0) } != 0 {
            let error = std::io::Error::last_os_error();
            eprintln!("cannot ask for a signal when cargo ends ({error}): stopping cargo alone will leave namespaces behind");
        }
        let _ = asked.send(());
        // Returns once the handler wrote (SA_RESTART: a signal here does not end the read).
        let _ = std::io::Read::read(&mut std::fs::File::from(wake), &mut [0u8; 1]);
        let signal = SIGNAL.load(Ordering::SeqCst);
        let _ = writeln!(std::io::stderr(), "signal {signal}: removing the namespaces, pins and agents this run made");
        stop_children();
        REGISTRY.run();
        // What the other threads started meanwhile.
        stop_children();
        // Neither exit nor a return from `main`: a thread that ended `main` meanwhile waits
        // inside exit (`wait_at_exit`), and a second exit waits for the first for good (Rust
        // lets one thread exit; newer glibc too). What the bench printed is out already:
        // Rust's stdout writes out each line.
        // SAFETY: the default action, delivered to ourselves, ends the process; _exit if not.
        unsafe {
            libc::signal(signal, libc::SIG_DFL);
            libc::raise(signal);
            libc::_exit(128 + signal);
        }
    });
    let _ = CLEANER.set(cleaner.thread().id());
    let _ = asked_rx.recv();
    // Orphans of our children (a guest's qemu under bash and timeout) come to us to be killed.
    // (Until then, orphans that end stay zombies of ours: an agent's `nft` killed with it.)
    // SAFETY: prctl with a plain integer argument.
    if reaper && unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) } != 0 {
        eprintln!("cannot become the subreaper ({}): an interrupted run may leave grandchildren", std::io::Error::last_os_error());
    }
    // A thread that fails because the cleanup took its namespace, pins or children away, or
    // whose syscall the signal interrupted, must not end the process (with a panic's status,
    // half cleaned up) before the cleanup does: it waits. So does one that exits the process.
    let report = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        if ending_elsewhere() {
            park_for_good();
        }
        report(info);
    }));
    extern "C" fn wait_at_exit() {
        if ending_elsewhere() {
            park_for_good();
        }
    }
    // SAFETY: registers a plain function.
    unsafe { libc::atexit(wait_at_exit) };
    for s in SIGNALS {
        if !at_default(s) {
            continue;
        }
        // SAFETY: a `sigaction` zeroed, then filled.
        unsafe {
            let mut action: libc::sigaction = std::mem::zeroed();
            action.sa_sigaction = on_signal as *const () as libc::sighandler_t;
            action.sa_flags = libc::SA_RESTART;
            libc::sigemptyset(&mut action.sa_mask);
            if libc::sigaction(s, &action, std::ptr::null_mut()) != 0 {
                eprintln!("cannot catch signal {s} ({}): it will leave namespaces behind", std::io::Error::last_os_error());
            }
        }
    }
    // A parent that ended before the cleanup thread asked sends nothing: its end is taken now,
    // as the signal it would have been (the handler is in place).
    // SAFETY: getppid has no preconditions.
    if parent_death && unsafe { libc::getppid() } != parent {
        // SAFETY: delivered to ourselves, to the handler installed above.
        unsafe { libc::raise(libc::SIGTERM) };
    }
}

/// Whether `signal` is at its default action (neither ignored nor handled). Only reads it.
fn at_default(signal: i32) -> bool {
    // SAFETY: a zeroed `sigaction` the call fills; nothing is changed.
    unsafe {
        let mut old: libc::sigaction = std::mem::zeroed();
        libc::sigaction(signal, std::ptr::null(), &mut old) == 0 && old.sa_sigaction == libc::SIG_DFL
    }
}

/// True once a signal is ending the process, in any thread but the one doing it.
fn ending_elsewhere() -> bool {
    INTERRUPTED.load(Ordering::SeqCst) && CLEANER.get() != Some(&std::thread::current().id())
}

/// The pids whose parent is `parent` (from /proc).
pub fn children_of(parent: u32) -> Vec<u32> {
    let Ok(procs) = std::fs::read_dir("/proc") else { return Vec::new() };
    procs
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            // `pid (comm) state ppid ...`: the comm may hold spaces and parentheses.
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
            stat.rsplit_once(')').and_then(|(_, rest)| rest.split_whitespace().nth(1)?.parse::<u32>().ok()) == Some(parent)
        })
        .collect()
}

/// How long children have to end after a SIGTERM before they get a SIGKILL.
const GRACE: std::time::Duration = std::time::Duration::from_secs(5);

/// Stops this process's children and reaps them, until none is left (with the subreaper, their
/// own orphans come to us), so no agent outlives the run or keeps its namespace alive: a
/// SIGTERM first, as a child may have a cleanup of its own (a benchmark a test started, `runc`
/// deleting its container), then, for those still there after `GRACE`, a SIGKILL. A child not
/// yet reaped keeps its pid, so this signals no stranger.
fn stop_children() {
    let me = std::process::id();
    let deadline = std::time::Instant::now() + GRACE;
    let mut told = std::collections::BTreeSet::new();
    for _ in 0..1000 {
        let children = children_of(me);
        if children.is_empty() {
            return;
        }
        let late = std::time::Instant::now() > deadline;
        for pid in children {
            // SAFETY: signalling and reaping our own children.
            unsafe {
                if late {
                    libc::kill(pid as i32, libc::SIGKILL);
                    libc::waitpid(pid as i32, std::ptr::null_mut(), 0);
                } else {
                    if told.insert(pid) {
                        libc::kill(pid as i32, libc::SIGTERM);
                    }
                    libc::waitpid(pid as i32, std::ptr::null_mut(), libc::WNOHANG);
                }
            }
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Mutex};

    #[test]
    fn registered_cleanups_run_newest_first_and_dropped_ones_not_at_all() {
        // A registry of the test's own: the process's may hold other tests' namespaces.
        static LOCAL: Registry = Registry::new();
        let ran = Arc::new(Mutex::new(Vec::new()));
        let note = |what: &'static str| {
            let ran = ran.clone();
            move || ran.lock().unwrap().push(what)
        };
        let first = LOCAL.register(note("first"));
        let dropped = LOCAL.register(note("dropped"));
        let failing = LOCAL.register(|| panic!("a cleanup that fails"));
        let last = LOCAL.register(note("last"));
        drop(dropped);
        LOCAL.run();
        assert_eq!(*ran.lock().unwrap(), ["last", "first"], "newest first, past one that panicked");
        // Run once: what ran is forgotten, and the registrations' drops change nothing.
        drop((first, failing, last));
        LOCAL.run();
        assert_eq!(ran.lock().unwrap().len(), 2);
    }
}
