//! Services for host-network processes: the cgroup socket hooks (`proxy-ebpf/src/sock.rs`)
//! attached to a cgroup v2 directory, acting on the sockets of the agent's own network
//! namespace (the host's, for a hostNetwork DaemonSet).

use std::{
    fs, io,
    os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd},
    path::{Path, PathBuf},
};

use aya::{
    maps::{Array, MapData},
    programs::{links::FdLink, CgroupAttachMode},
    Ebpf,
};
use proxy_common::{map_names, prog_names};

use super::loader::{self, links_dir};

#[derive(Debug, thiserror::Error)]
pub enum HostSockError {
    #[error("reading this network namespace's cookie (SO_NETNS_COOKIE, Linux 5.14+): {0}")]
    Cookie(io::Error),
    #[error("opening cgroup {path} (a cgroup v2 directory is needed; --cgroup-root none turns the socket hooks off): {source}")]
    Cgroup { path: String, source: io::Error },
    #[error("{program}: {detail}")]
    Program { program: &'static str, detail: String },
}

/// The cookie the kernel gives this thread's network namespace.
fn netns_cookie() -> Result<u64, HostSockError> {
    // SAFETY: plain socket(2); the fd is owned at once.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(HostSockError::Cookie(io::Error::last_os_error()));
    }
    // SAFETY: a fresh fd of ours.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let mut cookie = 0u64;
    let mut len = size_of::<u64>() as libc::socklen_t;
    // SAFETY: getsockopt into a u64 of the size given.
    let r = unsafe { libc::getsockopt(fd.as_raw_fd(), libc::SOL_SOCKET, libc::SO_NETNS_COOKIE, (&raw mut cookie).cast(), &mut len) };
    if r != 0 {
        return Err(HostSockError::Cookie(io::Error::last_os_error()));
    }
    Ok(cookie)
}

/// An error with its sources (aya's say which call failed; the source says why).
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut source = e.source();
    while let Some(c) = source {
        s.push_str(": ");
        s.push_str(&c.to_string());
        source = c.source();
    }
    s
}

/// The inode number of the initial cgroup namespace (the kernel's fixed
/// PROC_CGROUP_INIT_INO).
const INIT_CGROUP_NS_INO: u64 = 0xEFFF_FFFB;

/// True when this process sees the host's cgroup hierarchy. In a cgroup namespace of its own
/// (a container under cgroup v2), the hierarchy mounted at /sys/fs/cgroup is only the
/// container's cgroup: hooks attached there would serve the agent's own sockets alone.
pub fn in_host_cgroup_namespace() -> bool {
    use std::os::unix::fs::MetadataExt as _;
    fs::metadata("/proc/self/ns/cgroup").map(|m| m.ino() == INIT_CGROUP_NS_INO).unwrap_or(true)
}

/// Removes the socket hooks' link pins (detaching them) and clears the namespace they serve:
/// `--cgroup-root none` after a run that had them.
pub fn detach(ebpf: &mut Ebpf, root: Option<&Path>) -> usize {
    if let Some(map) = ebpf.map_mut(map_names::HOST_NETNS) {
        if let Ok(mut array) = Array::<&mut MapData, u64>::try_from(map) {
            let _ = array.set(0, 0, 0);
        }
    }
    let Some(root) = root else { return 0 };
    let Ok(dir) = fs::read_dir(links_dir(root)) else { return 0 };
    dir.flatten()
        .filter(|e| e.file_name().to_str().is_some_and(|n| n.starts_with(PIN_PREFIX)))
        .filter(|e| fs::remove_file(e.path()).is_ok())
        .count()
}

/// The mount point of the cgroup v2 hierarchy, from /proc/self/mounts.
pub fn cgroup2_mount() -> Option<PathBuf> {
    cgroup2_mount_points().into_iter().next()
}

/// Where the agent mounts a cgroup v2 hierarchy for the socket hooks when none is mounted (a
/// cgroup v1 host), as Cilium mounts one at /run/cilium/cgroupv2. Every cgroup v2 mount shows
/// the same single hierarchy, so hooks attached to its root serve every process, wherever
/// (and whether) the host mounts it.
pub const CGROUP2_DIR: &str = "/run/proxy-agent/cgroupv2";

/// Mounts the cgroup v2 hierarchy at `dir` (created if missing), unless one is there already.
pub fn mount_cgroup2(dir: &Path) -> io::Result<()> {
    fs::create_dir_all(dir)?;
    if cgroup2_mount_points().iter().any(|m| m == dir) {
        return Ok(());
    }
    let target = std::ffi::CString::new(dir.as_os_str().as_encoded_bytes()).map_err(io::Error::other)?;
    // SAFETY: valid C strings; a plain cgroup2 mount.
    let rc = unsafe { libc::mount(c"cgroup2".as_ptr(), target.as_ptr(), c"cgroup2".as_ptr(), 0, std::ptr::null()) };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// True when `dir` is where a cgroup v2 hierarchy is mounted.
pub fn is_cgroup2(dir: &Path) -> bool {
    cgroup2_mount_points().iter().any(|m| m == dir)
}

fn cgroup2_mount_points() -> Vec<PathBuf> {
    crate::bpffs::mount_points("cgroup2")
}

/// Link pins of the socket hooks are `<PIN_PREFIX><program>`.
pub const PIN_PREFIX: &str = "cgroup_";

fn pin_path(root: &Path, program: &str) -> PathBuf {
    links_dir(root).join(format!("{PIN_PREFIX}{program}"))
}

/// Pins a hook's link under `root` (without a root it stays as it is: it detaches when
/// dropped). Pinned beside the previous run's link, then moved over its pin: that link goes
/// with it (nothing else holds it), and only once this one is pinned.
fn keep(link: FdLink, root: Option<&Path>, program: &'static str) -> Result<FdLink, HostSockError> {
    let Some(root) = root else { return Ok(link) };
    let err = |detail: String| HostSockError::Program { program, detail };
    let path = pin_path(root, program);
    // (bpffs names may not hold a dot.)
    let fresh = pin_path(root, &format!("{program}_new"));
    let _ = fs::remove_file(&fresh);
    let pinned = link.pin(&fresh).map_err(|e| err(format!("pinning {}: {e}", fresh.display())))?;
    fs::rename(&fresh, &path).map_err(|e| err(format!("renaming {} to {}: {e}", fresh.display(), path.display())))?;
    Ok(FdLink::from(pinned))
}

/// Attaches the socket hooks to `cgroup` for the sockets of this network namespace. A link a
/// previous run pinned stays attached until the new one is (both act the same way, and a
/// second translation finds no Service in a backend's address), then it is replaced. Returns
/// the links: without a pin root, the hooks detach when they drop.
pub fn attach(ebpf: &mut Ebpf, root: Option<&Path>, cgroup: &Path) -> Result<Vec<FdLink>, HostSockError> {
    let cookie = netns_cookie()?;
    let map = ebpf.map_mut(map_names::HOST_NETNS).expect("the object defines the host netns map");
    let mut array: Array<&mut MapData, u64> =
        Array::try_from(map).map_err(|e| HostSockError::Program { program: map_names::HOST_NETNS, detail: e.to_string() })?;
    array.set(0, cookie, 0).map_err(|e| HostSockError::Program { program: map_names::HOST_NETNS, detail: e.to_string() })?;
    let dir = fs::File::open(cgroup).map_err(|source| HostSockError::Cgroup { path: cgroup.display().to_string(), source })?;
    // Loads `$prog` (a cgroup program of the object), attaches it to the cgroup as a BPF link
    // (the kernel runs it beside other programs of the cgroup whatever the mode, and takes no
    // attach flags with it) and keeps the link (see `keep`).
    macro_rules! attach_link {
        ($program:expr, $prog:expr) => {{
            let program: &'static str = $program;
            let err = |detail: String| HostSockError::Program { program, detail };
            let prog = $prog;
            super::loader::load_program(|| prog.load()).map_err(|e| err(format!("loading: {e}")))?;
            let id = prog
                .attach(&dir, CgroupAttachMode::Single)
                .map_err(|e| err(format!("attaching to {}: {}", cgroup.display(), error_chain(&e))))?;
            let link = FdLink::try_from(prog.take_link(id).map_err(|e| err(e.to_string()))?).map_err(|e| err(e.to_string()))?;
            keep(link, root, program)?
        }};
    }
    // The release hook first: a socket that connects once the others are in is forgotten when
    // it closes.
    let mut links = vec![attach_link!(prog_names::SOCK_RELEASE, loader::cgroup_sock(ebpf, prog_names::SOCK_RELEASE))];
    for program in prog_names::SOCK_HOOKS {
        links.push(attach_link!(program, loader::sock_addr(ebpf, program)));
    }
    tracing::info!(cgroup = %cgroup.display(), netns_cookie = cookie, "socket hooks attached: host-network processes reach Services");
    Ok(links)
}
