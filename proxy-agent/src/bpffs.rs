//! The BPF filesystem the agent pins its maps, programs and links in.
//!
//! Pins live as long as the bpffs they are on. A bpffs the host mounted (or a DaemonSet's init
//! container mounted on the host) outlives the agent; one the agent mounts itself inside a
//! mount namespace of its own (a container, `ip netns exec`) goes with that namespace, and
//! with it every pinned link and map: the next run starts from nothing and every tracked
//! connection is reset. `prepare` tells the two apart.

use std::{
    ffi::CString,
    io,
    os::unix::{ffi::OsStrExt, fs::MetadataExt as _},
    path::{Path, PathBuf},
};

const BPF_FS_MAGIC: i64 = 0xcafe_4a11;
const SYSFS_MAGIC: i64 = 0x6265_6572;
/// The kernel's fixed inode number of the initial PID namespace (PROC_PID_INIT_INO).
const INIT_PID_NS_INO: u64 = 0xEFFF_FFFC;
/// The fixed inode number newer kernels give the initial mount namespace (PROC_MNT_INIT_INO);
/// older ones number it like any other.
const INIT_MNT_NS_INO: u64 = 0xEFFF_FFF8;

fn statfs_type(path: &Path) -> io::Result<i64> {
    let c = CString::new(path.as_os_str().as_bytes()).map_err(io::Error::other)?;
    // SAFETY: all-zero is a valid statfs.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: valid C string and out-pointer.
    if unsafe { libc::statfs(c.as_ptr(), &mut st) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(st.f_type as i64)
}

/// True when `path` is on a bpffs.
pub fn is_bpffs(path: &Path) -> io::Result<bool> {
    Ok(statfs_type(path)? == BPF_FS_MAGIC)
}

#[derive(Debug, thiserror::Error)]
pub enum BpffsError {
    #[error(
        "{path} is not on a BPF filesystem and this process may not mount one ({source}). On a node, mount it on \
         the host (`mount -t bpf bpf /sys/fs/bpf`) and give the agent the host's /sys/fs/bpf (deploy/daemonset.yaml's \
         init container and hostPath volume do both), or pass --bpffs-root on a BPF filesystem"
    )]
    Mount { path: String, source: io::Error },
    #[error("creating the pin directory {path}: {source}; pass --bpffs-root on a writable BPF filesystem")]
    Create { path: String, source: io::Error },
    #[error("checking {path}: {source}")]
    Stat { path: String, source: io::Error },
}

/// The bpffs the pins go to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Prepared {
    /// Where this call mounted a bpffs, if it had to.
    pub mounted: Option<PathBuf>,
    /// False when the pins die with this process's mount namespace (see the module notes).
    pub outlives_agent: bool,
}

/// Makes sure `root` exists on a bpffs. When none is there, one is mounted: at `root` if it
/// can be created, else at its nearest existing ancestor when that is a bare sysfs directory
/// (`/sys/fs/bpf` inside a container or `ip netns exec`, which remount /sys).
pub fn prepare(root: &Path) -> Result<Prepared, BpffsError> {
    let stat = |p: &Path, source| BpffsError::Stat { path: p.display().to_string(), source };
    let ancestor = root.ancestors().find(|a| a.exists()).unwrap_or(Path::new("/"));
    if is_bpffs(ancestor).map_err(|e| stat(ancestor, e))? {
        create(root)?;
        return Ok(Prepared { mounted: None, outlives_agent: true });
    }
    let target = match std::fs::create_dir_all(root) {
        Ok(()) => root.to_path_buf(),
        // sysfs lets nobody make directories: /sys/fs/bpf is the mount point it offers.
        Err(_) if statfs_type(ancestor).is_ok_and(|t| t == SYSFS_MAGIC) => ancestor.to_path_buf(),
        Err(source) => return Err(BpffsError::Create { path: root.display().to_string(), source }),
    };
    mount_bpffs(&target)?;
    create(root)?;
    Ok(Prepared { outlives_agent: mount_outlives_agent(&target), mounted: Some(target) })
}

fn create(root: &Path) -> Result<(), BpffsError> {
    std::fs::create_dir_all(root).map_err(|source| BpffsError::Create { path: root.display().to_string(), source })
}

fn mount_bpffs(target: &Path) -> Result<(), BpffsError> {
    let err = |source| BpffsError::Mount { path: target.display().to_string(), source };
    let c = CString::new(target.as_os_str().as_bytes()).map_err(|e| err(io::Error::other(e)))?;
    // SAFETY: valid C strings; a plain bpffs mount.
    let rc = unsafe { libc::mount(c"bpf".as_ptr(), c.as_ptr(), c"bpf".as_ptr(), 0, c"mode=0700".as_ptr().cast()) };
    if rc != 0 {
        return Err(err(io::Error::last_os_error()));
    }
    Ok(())
}

/// The mount points of every filesystem of type `fstype` (`bpf`, `cgroup2`) this process
/// sees, from /proc/self/mounts.
pub fn mount_points(fstype: &str) -> Vec<PathBuf> {
    let Ok(mounts) = std::fs::read_to_string("/proc/self/mounts") else { return Vec::new() };
    mounts
        .lines()
        .filter_map(|l| {
            let mut f = l.split_whitespace();
            let (_, dir, kind) = (f.next()?, f.next()?, f.next()?);
            (kind == fstype).then(|| PathBuf::from(dir))
        })
        .collect()
}

/// Whether a mount this process just made at `target` outlives it: in the host's initial mount
/// namespace it does; elsewhere only when it propagated to a peer (a shared mount, as a
/// Bidirectional hostPath volume is).
fn mount_outlives_agent(target: &Path) -> bool {
    in_initial_mount_namespace() || std::fs::read_to_string("/proc/self/mountinfo").is_ok_and(|m| shared_at(&m, target))
}

/// True when the last mount listed at `target` in `mountinfo` (the one on top) is shared.
pub fn shared_at(mountinfo: &str, target: &Path) -> bool {
    let target = target.as_os_str().as_bytes();
    mountinfo
        .lines()
        .filter_map(|l| {
            let mut f = l.split(' ');
            let point = f.nth(4)?;
            // Fields 7.. up to "-" are optional tags such as shared:N and master:N.
            let tags: Vec<&str> = f.skip(1).take_while(|t| *t != "-").collect();
            (unescape(point) == target).then(|| tags.iter().any(|t| t.starts_with("shared:")))
        })
        .next_back()
        .unwrap_or(false)
}

/// mountinfo escapes space, tab, newline and backslash as octal.
fn unescape(s: &str) -> Vec<u8> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\' && i + 3 < b.len() && b[i + 1..i + 4].iter().all(|c| (b'0'..=b'7').contains(c)) {
            out.push((b[i + 1] - b'0') * 64 + (b[i + 2] - b'0') * 8 + (b[i + 3] - b'0'));
            i += 4;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    out
}

/// True in the host's initial mount namespace: the kernel numbers it so, or (older kernels)
/// this process shares init's mount namespace and init is the host's (we are in the initial
/// PID namespace).
pub fn in_initial_mount_namespace() -> bool {
    let ino = |p: &str| std::fs::metadata(p).map(|m| m.ino()).ok();
    let mine = ino("/proc/self/ns/mnt");
    mine == Some(INIT_MNT_NS_INO) || (ino("/proc/self/ns/pid") == Some(INIT_PID_NS_INO) && mine.is_some() && mine == ino("/proc/1/ns/mnt"))
}

#[cfg(test)]
mod tests {
    use super::*;

    const MOUNTINFO: &str = "\
22 27 0:21 / /proc rw,relatime - proc proc rw
23 27 0:22 / /sys rw,relatime shared:7 - sysfs sysfs rw
40 23 0:40 / /sys/fs/bpf rw,relatime - bpf bpf rw,mode=700
41 23 0:41 / /sys/fs/bpf rw,relatime shared:12 - bpf bpf rw,mode=700
42 27 0:42 / /run/with\\040space rw master:3 - bpf bpf rw
";

    #[test]
    fn the_mount_on_top_decides_whether_pins_are_shared() {
        assert!(shared_at(MOUNTINFO, Path::new("/sys/fs/bpf")), "the later mount at /sys/fs/bpf is shared");
        assert!(!shared_at(&MOUNTINFO.replace("shared:12", ""), Path::new("/sys/fs/bpf")));
        // A slave receives from the host but sends nothing back: a mount made there is private.
        assert!(!shared_at(MOUNTINFO, Path::new("/run/with space")));
        assert!(!shared_at(MOUNTINFO, Path::new("/nowhere")));
    }
}
