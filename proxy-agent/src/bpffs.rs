//! The BPF filesystem the agent pins its maps, programs and links in.

use std::{ffi::CString, io, os::unix::ffi::OsStrExt, path::Path};

const BPF_FS_MAGIC: i64 = 0xcafe_4a11;

/// True when `path` is on a bpffs.
pub fn is_bpffs(path: &Path) -> io::Result<bool> {
    let c = CString::new(path.as_os_str().as_bytes()).map_err(io::Error::other)?;
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: valid C string and out-pointer.
    if unsafe { libc::statfs(c.as_ptr(), &mut st) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(st.f_type as i64 == BPF_FS_MAGIC)
}

/// Makes sure `root` exists and is on a bpffs, mounting one there when it is not (as inside
/// `ip netns exec`, which remounts /sys). Returns true when it mounted.
pub fn ensure(root: &Path) -> io::Result<bool> {
    std::fs::create_dir_all(root)?;
    if is_bpffs(root)? {
        return Ok(false);
    }
    let target = CString::new(root.as_os_str().as_bytes()).map_err(io::Error::other)?;
    // SAFETY: valid C strings; a plain bpffs mount.
    let rc = unsafe {
        libc::mount(c"bpf".as_ptr(), target.as_ptr(), c"bpf".as_ptr(), 0, c"mode=0700".as_ptr().cast())
    };
    if rc != 0 {
        let e = io::Error::last_os_error();
        return Err(io::Error::new(
            e.kind(),
            format!(
                "{} is not on a BPF filesystem and mounting one there failed ({e}); mount it \
                 with `mount -t bpf bpf {}` or choose another --bpffs-root",
                root.display(),
                root.display()
            ),
        ));
    }
    Ok(true)
}
