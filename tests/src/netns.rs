//! Network namespaces for the lab, created with iproute2 and removed on drop (also on panic).

use std::{
    fs::File,
    io,
    os::fd::AsRawFd,
    process::Command,
    sync::atomic::{AtomicU32, Ordering},
    thread,
};

/// A short id unique to this process and call, for netns names that never collide between
/// tests running in parallel or with another run on the same machine.
pub fn unique_id() -> String {
    static N: AtomicU32 = AtomicU32::new(0);
    let n = N.fetch_add(1, Ordering::Relaxed);
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.subsec_nanos()).unwrap_or(0);
    format!("{:x}{:x}{:x}", std::process::id() % 0xfff, n, nanos % 0xfff)
}

/// Runs a command, panicking with its output if it fails.
pub fn sh(args: &[&str]) -> String {
    let out = Command::new(args[0]).args(&args[1..]).output().unwrap_or_else(|e| panic!("running {args:?}: {e}"));
    assert!(
        out.status.success(),
        "{args:?} failed ({}): {}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

pub struct Netns {
    pub name: String,
    /// Deletes it if a signal ends the run first (`interrupt`).
    _interrupt: crate::interrupt::Registration,
}

impl Netns {
    pub fn create(name: impl Into<String>) -> Self {
        let name = name.into();
        // Registered first: a signal may come as soon as it exists.
        let named = name.clone();
        let _interrupt = crate::interrupt::register(move || delete(&named));
        sh(&["ip", "netns", "add", &name]);
        let ns = Self { name, _interrupt };
        ns.ip(&["link", "set", "lo", "up"]);
        ns
    }

    /// `ip -n <ns> ...`
    pub fn ip(&self, args: &[&str]) -> String {
        let mut v = vec!["ip", "-n", &self.name];
        v.extend_from_slice(args);
        sh(&v)
    }

    pub fn sysctl(&self, key: &str, value: &str) {
        let path = format!("/proc/sys/{}", key.replace('.', "/"));
        let value = value.to_string();
        self.run(move || std::fs::write(&path, value).unwrap_or_else(|e| panic!("sysctl {path}: {e}")));
    }

    /// A counter of the namespace's TCP stack (a `TcpExt:` field of /proc/net/netstat, such as
    /// `TCPSynRetrans`, the SYNs sent again for want of an answer).
    pub fn tcp_ext(&self, field: &str) -> u64 {
        let field = field.to_string();
        self.run(move || {
            let text = std::fs::read_to_string("/proc/thread-self/net/netstat").expect("read /proc/thread-self/net/netstat");
            let mut rows = text.lines().filter(|l| l.starts_with("TcpExt:"));
            let (names, values) = (rows.next().expect("TcpExt names"), rows.next().expect("TcpExt values"));
            names
                .split_whitespace()
                .zip(values.split_whitespace())
                .find(|(n, _)| *n == field)
                .and_then(|(_, v)| v.parse().ok())
                .unwrap_or_else(|| panic!("no TcpExt {field} in /proc/thread-self/net/netstat"))
        })
    }

    /// The namespace file, for setns.
    pub fn file(&self) -> File {
        File::open(format!("/run/netns/{}", self.name)).unwrap_or_else(|e| panic!("open netns {}: {e}", self.name))
    }

    /// Runs `f` on a thread that lives in this namespace. Sockets it creates belong to the
    /// namespace and may be used from any thread afterwards.
    pub fn run<T: Send + 'static>(&self, f: impl FnOnce() -> T + Send + 'static) -> T {
        let file = self.file();
        thread::spawn(move || {
            enter(&file).expect("setns");
            f()
        })
        .join()
        .unwrap_or_else(|p| std::panic::resume_unwind(p))
    }
}

/// A node of the external hooks' packet tables and benchmarks: a namespace named
/// `<prefix>-<unique id>` with one uplink, `ext0` (02:50:00:00:00:01, 192.168.50.1/24), whose
/// next hop 192.168.50.2 (02:50:00:00:00:02) is a permanent neighbour, and IPv4 forwarding on.
/// The veth's other end, `ext1`, is up in the same namespace with nothing on it. The caller
/// adds its routes, enters the namespace (`enter`), and finds `ext0` with `ifindex`.
pub fn uplink_node(prefix: &str) -> Netns {
    let ns = Netns::create(format!("{prefix}-{}", unique_id()));
    ns.ip(&["link", "add", "ext0", "address", "02:50:00:00:00:01", "type", "veth", "peer", "name", "ext1"]);
    ns.ip(&["addr", "add", "192.168.50.1/24", "dev", "ext0"]);
    ns.ip(&["link", "set", "ext0", "up"]);
    ns.ip(&["link", "set", "ext1", "up"]);
    ns.ip(&["neigh", "add", "192.168.50.2", "lladdr", "02:50:00:00:00:02", "dev", "ext0", "nud", "permanent"]);
    ns.sysctl("net.ipv4.ip_forward", "1");
    ns
}

/// An `uplink_node` routed as a node of the north-south tests: its router, the uplink's far
/// end (192.168.50.2), leads to the other node's pods (10.244.2.0/24) and to the external
/// clients (198.51.100.0/24), and its own pods are behind `ext1` (10.244.1.0/24). `ipv6`: the
/// same in IPv6 (the node fd00:50::1, the router fd00:50::2; fd00:244:2::/64, 2001:db8:100::/64
/// and fd00:244:1::/64), with IPv6 forwarding on.
pub fn routed_uplink_node(prefix: &str, ipv6: bool) -> Netns {
    let ns = uplink_node(prefix);
    ns.ip(&["route", "add", "10.244.2.0/24", "via", "192.168.50.2"]);
    ns.ip(&["route", "add", "198.51.100.0/24", "via", "192.168.50.2"]);
    ns.ip(&["route", "add", "10.244.1.0/24", "dev", "ext1"]);
    if ipv6 {
        ns.ip(&["-6", "addr", "add", "fd00:50::1/64", "dev", "ext0", "nodad"]);
        ns.ip(&["-6", "neigh", "add", "fd00:50::2", "lladdr", "02:50:00:00:00:02", "dev", "ext0", "nud", "permanent"]);
        ns.ip(&["-6", "route", "add", "fd00:244:2::/64", "via", "fd00:50::2"]);
        ns.ip(&["-6", "route", "add", "2001:db8:100::/64", "via", "fd00:50::2"]);
        ns.ip(&["-6", "route", "add", "fd00:244:1::/64", "dev", "ext1"]);
        ns.sysctl("net.ipv6.conf.all.forwarding", "1");
    }
    ns
}

/// The index of interface `name` in the calling thread's network namespace; panics when it has
/// none.
pub fn ifindex(name: &str) -> u32 {
    let c = std::ffi::CString::new(name).expect("an interface name");
    // SAFETY: a valid C string; looked up in this thread's namespace.
    let index = unsafe { libc::if_nametoindex(c.as_ptr()) };
    assert_ne!(index, 0, "no interface {name} in this thread's namespace");
    index
}

/// Moves the calling thread into the network namespace `file`.
pub fn enter(file: &File) -> io::Result<()> {
    // SAFETY: setns on a valid namespace fd affects only the calling thread's network namespace.
    if unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Deletes a namespace, and with it the veths in it. Never panics.
fn delete(name: &str) {
    let _ = Command::new("ip").args(["netns", "del", name]).output();
}

impl Drop for Netns {
    fn drop(&mut self) {
        delete(&self.name);
    }
}
