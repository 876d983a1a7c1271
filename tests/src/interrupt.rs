//! Cleanup when a run by hand is interrupted. Namespaces, pins and lab directories are removed
//! when their owners drop, also on a panic; but Ctrl-C (or a SIGTERM) ends a process without
//! unwinding, and a benchmark stopped that way left its namespaces, its bpffs mounts and its
//! agent behind. Each of those owners registers here how to remove what it made; a binary that
//! calls `clean_up_on_signals` first thing then runs those, newest first, when a signal ends
//! it. An owner that drops normally takes its registration back (and cleans up itself).

use std::{
    collections::BTreeMap,
    sync::{
        atomic::{AtomicBool, AtomicU64, Ordering},
        Mutex, MutexGuard,
    },
};

type Cleanup = Box<dyn FnOnce() + Send>;

/// Cleanups by registration order.
struct Registry {
    pending: Mutex<BTreeMap<u64, Cleanup>>,
    next: AtomicU64,
}

/// The process's: what `clean_up_on_signals` runs.
static REGISTRY: Registry = Registry::new();

impl Registry {
    const fn new() -> Self {
        Self { pending: Mutex::new(BTreeMap::new()), next: AtomicU64::new(0) }
    }

    fn pending(&self) -> MutexGuard<'_, BTreeMap<u64, Cleanup>> {
        // A panic elsewhere while holding the lock leaves the map as it was: still usable.
        self.pending.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn register(&'static self, cleanup: impl FnOnce() + Send + 'static) -> Registration {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        self.pending().insert(id, Box::new(cleanup));
        Registration { registry: self, id }
    }

    /// Runs and forgets every registered cleanup, newest first (as drops would).
    fn run(&self) {
        let all = std::mem::take(&mut *self.pending());
        for (_, cleanup) in all.into_iter().rev() {
            cleanup();
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
        self.registry.pending().remove(&self.id);
    }
}

impl std::fmt::Debug for Registration {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("Registration").field(&self.id).finish()
    }
}

/// Runs `cleanup` if a signal ends the process before the returned registration drops.
pub fn register(cleanup: impl FnOnce() + Send + 'static) -> Registration {
    REGISTRY.register(cleanup)
}

/// Set once a signal has started the cleanup.
static INTERRUPTED: AtomicBool = AtomicBool::new(false);

/// The signals that end a run by hand: Ctrl-C, `kill`, a closed terminal.
const SIGNALS: [i32; 3] = [libc::SIGINT, libc::SIGTERM, libc::SIGHUP];

/// Blocks SIGINT, SIGTERM and SIGHUP in the calling thread (and so in every thread it starts
/// later; the child processes it spawns start with none blocked, as `std::process` resets the
/// mask) and starts a thread that waits for them: the first one runs the registered cleanups
/// and exits with 128 + its number, as the shell reports a process killed by it. Call it in
/// `main` before any other thread starts.
pub fn clean_up_on_signals() {
    // SAFETY: sigset_t is plain data; sigemptyset initialises it before use.
    let mut set: libc::sigset_t = unsafe { std::mem::zeroed() };
    // SAFETY: `set` is a valid sigset_t; these only edit it and this thread's mask.
    let blocked = unsafe {
        libc::sigemptyset(&mut set);
        for s in SIGNALS {
            libc::sigaddset(&mut set, s);
        }
        libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut())
    };
    if blocked != 0 {
        eprintln!("cannot block SIGINT/SIGTERM/SIGHUP (error {blocked}): an interrupted run may leave namespaces behind");
        return;
    }
    // A thread that fails because the cleanup took its namespace or pins away must not end
    // the process (with a panic's status, half cleaned up) before the cleanup does: it waits.
    let report = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        if INTERRUPTED.load(Ordering::SeqCst) {
            loop {
                std::thread::park();
            }
        }
        report(info);
    }));
    std::thread::spawn(move || {
        let mut signal = 0;
        // SAFETY: `set` holds signals blocked in every thread; sigwait only reads it.
        while unsafe { libc::sigwait(&set, &mut signal) } != 0 {}
        INTERRUPTED.store(true, Ordering::SeqCst);
        eprintln!("signal {signal}: removing the namespaces, pins and agents this run made");
        kill_children();
        REGISTRY.run();
        std::process::exit(128 + signal);
    });
}

/// SIGKILLs this process's children (the labs' agents, a guest) and reaps them, so no agent
/// outlives the run or keeps its namespace alive. A child not yet reaped keeps its pid, so no
/// stranger is signalled.
fn kill_children() {
    let me = std::process::id();
    let Ok(procs) = std::fs::read_dir("/proc") else { return };
    let children: Vec<i32> = procs
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| {
            // `pid (comm) state ppid ...`: the comm may hold spaces and parentheses.
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
            let ppid = stat.rsplit_once(')').and_then(|(_, rest)| rest.split_whitespace().nth(1)?.parse::<u32>().ok());
            ppid == Some(me)
        })
        .collect();
    for &pid in &children {
        // SAFETY: signalling and reaping our own children.
        unsafe {
            libc::kill(pid, libc::SIGKILL);
            libc::waitpid(pid, std::ptr::null_mut(), 0);
        }
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
        let last = LOCAL.register(note("last"));
        drop(dropped);
        LOCAL.run();
        assert_eq!(*ran.lock().unwrap(), ["last", "first"]);
        // Run once: what ran is forgotten, and the registrations' drops change nothing.
        drop((first, last));
        LOCAL.run();
        assert_eq!(ran.lock().unwrap().len(), 2);
    }
}
