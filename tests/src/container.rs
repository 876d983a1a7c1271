//! Running the agent's image the way kubelet runs deploy/daemonset.yaml: an OCI bundle per
//! container, generated from the DaemonSet's pod spec (command and arguments, environment with
//! the downward API, securityContext capabilities, privileged, read-only root, volume mounts
//! with their propagation, host network), run with runc. The image's root file system comes
//! from buildah (`cargo xtask image` builds `IMAGE`).
//!
//! Where the lab must differ from a node, it says so here: host paths are the lab's own
//! directories (a "host" bpffs and cgroup mount point made shared, as systemd makes / shared
//! on a node), the host network is the lab node's namespace, and the ServiceAccount token and
//! the ConfigMap are files the test writes, as kubelet projects them.

use std::{
    collections::BTreeMap,
    fs,
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use k8s_openapi::api::{apps::v1::DaemonSet, core::v1::Container};
use serde_json::{json, Value};

use crate::netns::{sh, unique_id};

pub const IMAGE: &str = "localhost/proxy-agent:dev";

/// Why the container test cannot run here, if it cannot.
pub fn unavailable() -> Option<String> {
    for tool in ["buildah", "runc"] {
        if Command::new(tool).arg("--version").output().map_or(true, |o| !o.status.success()) {
            return Some(format!("{tool} is not installed (cargo xtask setup installs it)"));
        }
    }
    let present = Command::new("buildah").args(["inspect", "--type", "image", IMAGE]).output().is_ok_and(|o| o.status.success());
    if !present {
        return Some(format!("the image {IMAGE} is not built: run `cargo xtask image` (cargo xtask test does)"));
    }
    None
}

/// The DaemonSet and the ConfigMap as deploy/ has them.
pub fn manifests() -> (DaemonSet, BTreeMap<String, String>) {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy");
    let ds: DaemonSet =
        serde_yaml::from_str(&fs::read_to_string(dir.join("daemonset.yaml")).expect("deploy/daemonset.yaml")).expect("a DaemonSet");
    let cm: k8s_openapi::api::core::v1::ConfigMap =
        serde_yaml::from_str(&fs::read_to_string(dir.join("configmap.yaml")).expect("deploy/configmap.yaml")).expect("a ConfigMap");
    (ds, cm.data.unwrap_or_default())
}

/// A root file system of the image (a buildah working container), removed on drop.
pub struct Rootfs {
    container: String,
    pub path: PathBuf,
}

impl Default for Rootfs {
    fn default() -> Self {
        Self::new()
    }
}

impl Rootfs {
    pub fn new() -> Self {
        let container = format!("proxy-ct-{}", unique_id());
        sh(&["buildah", "from", "--quiet", "--name", &container, IMAGE]);
        let path = PathBuf::from(sh(&["buildah", "mount", &container]).trim());
        Self { container, path }
    }
}

impl Drop for Rootfs {
    fn drop(&mut self) {
        let _ = Command::new("buildah").args(["umount", &self.container]).output();
        let _ = Command::new("buildah").args(["rm", &self.container]).output();
    }
}

/// What the node provides the pod: where each hostPath is in the lab, the host network, the
/// ConfigMap's and the ServiceAccount's files, the node's name.
pub struct Node {
    pub netns: String,
    pub node_name: String,
    pub host_paths: BTreeMap<String, PathBuf>,
    pub config_map: PathBuf,
    pub service_account: PathBuf,
}

/// A container of the pod, running (or run) with runc.
pub struct Running {
    pub id: String,
    root: PathBuf,
    child: Option<Child>,
    pub log: PathBuf,
}

impl Running {
    /// Waits for it to exit (an init container), with its exit status.
    pub fn wait(&mut self, limit: Duration) -> Option<std::process::ExitStatus> {
        let deadline = Instant::now() + limit;
        let child = self.child.as_mut()?;
        loop {
            if let Ok(Some(st)) = child.try_wait() {
                return Some(st);
            }
            if Instant::now() > deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    pub fn running(&mut self) -> bool {
        self.child.as_mut().is_some_and(|c| matches!(c.try_wait(), Ok(None)))
    }

    pub fn log(&self) -> String {
        fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// SIGTERM, as kubelet stops a container, then the grace period, then SIGKILL.
    pub fn stop(&mut self, grace: Duration) {
        let _ = Command::new("runc").arg("--root").arg(&self.root).args(["kill", &self.id, "TERM"]).output();
        if self.wait(grace).is_none() {
            let _ = Command::new("runc").arg("--root").arg(&self.root).args(["kill", &self.id, "KILL"]).output();
            let _ = self.wait(Duration::from_secs(5));
        }
        let _ = Command::new("runc").arg("--root").arg(&self.root).args(["delete", "--force", &self.id]).output();
        self.child = None;
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        if self.child.is_some() {
            self.stop(Duration::from_secs(5));
        }
    }
}

fn capability(name: &str) -> String {
    format!("CAP_{}", name.trim_start_matches("CAP_"))
}

/// What a privileged container gets: every capability the runtime itself holds (containerd
/// takes its own bounding set; this sandbox's lacks CAP_SYS_RESOURCE).
fn all_capabilities() -> Vec<String> {
    let bounding = fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| s.lines().find_map(|l| l.strip_prefix("CapBnd:")).and_then(|v| u64::from_str_radix(v.trim(), 16).ok()))
        .unwrap_or(0);
    const NAMES: [&str; 41] = [
        "CHOWN",
        "DAC_OVERRIDE",
        "DAC_READ_SEARCH",
        "FOWNER",
        "FSETID",
        "KILL",
        "SETGID",
        "SETUID",
        "SETPCAP",
        "LINUX_IMMUTABLE",
        "NET_BIND_SERVICE",
        "NET_BROADCAST",
        "NET_ADMIN",
        "NET_RAW",
        "IPC_LOCK",
        "IPC_OWNER",
        "SYS_MODULE",
        "SYS_RAWIO",
        "SYS_CHROOT",
        "SYS_PTRACE",
        "SYS_PACCT",
        "SYS_ADMIN",
        "SYS_BOOT",
        "SYS_NICE",
        "SYS_RESOURCE",
        "SYS_TIME",
        "SYS_TTY_CONFIG",
        "MKNOD",
        "LEASE",
        "AUDIT_WRITE",
        "AUDIT_CONTROL",
        "SETFCAP",
        "MAC_OVERRIDE",
        "MAC_ADMIN",
        "SYSLOG",
        "WAKE_ALARM",
        "BLOCK_SUSPEND",
        "AUDIT_READ",
        "PERFMON",
        "BPF",
        "CHECKPOINT_RESTORE",
    ];
    NAMES.iter().enumerate().filter(|(i, _)| bounding & (1 << i) != 0).map(|(_, n)| capability(n)).collect()
}

/// `$(VAR)` references in a command line, expanded as kubelet does.
fn expand(arg: &str, env: &BTreeMap<String, String>) -> String {
    let mut out = arg.to_string();
    for (k, v) in env {
        out = out.replace(&format!("$({k})"), v);
    }
    out
}

/// The OCI runtime configuration kubelet (through a CRI runtime) would give `c`.
pub fn oci_config(ds: &DaemonSet, c: &Container, node: &Node, rootfs: &Path) -> Value {
    let spec = ds.spec.template.spec.as_ref().expect("a pod spec");
    let sc = c.security_context.clone().unwrap_or_default();
    let privileged = sc.privileged == Some(true);
    let mut env: BTreeMap<String, String> = BTreeMap::new();
    env.insert("PATH".into(), "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin".into());
    env.insert("HOSTNAME".into(), node.node_name.clone());
    for e in c.env.iter().flatten() {
        let value = match (&e.value, e.value_from.as_ref().and_then(|f| f.field_ref.as_ref())) {
            (Some(v), _) => v.clone(),
            (None, Some(f)) if f.field_path == "spec.nodeName" => node.node_name.clone(),
            (None, Some(f)) => panic!("the test's downward API does not know {}", f.field_path),
            (None, None) => String::new(),
        };
        env.insert(e.name.clone(), value);
    }
    let args: Vec<String> = c.command.iter().flatten().chain(c.args.iter().flatten()).map(|a| expand(a, &env)).collect();
    let caps: Vec<String> = if privileged {
        all_capabilities()
    } else {
        let dropped_all = sc.capabilities.as_ref().and_then(|c| c.drop.as_ref()).is_some_and(|d| d.iter().any(|d| d == "ALL"));
        assert!(dropped_all, "the agent's container drops ALL capabilities");
        sc.capabilities.as_ref().and_then(|c| c.add.clone()).unwrap_or_default().iter().map(|c| capability(c)).collect()
    };
    let mut mounts = vec![
        json!({"destination": "/proc", "type": "proc", "source": "proc", "options": ["nosuid", "noexec", "nodev"]}),
        json!({"destination": "/dev", "type": "tmpfs", "source": "tmpfs", "options": ["nosuid", "strictatime", "mode=755", "size=65536k"]}),
        json!({"destination": "/dev/pts", "type": "devpts", "source": "devpts", "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620"]}),
        json!({"destination": "/dev/shm", "type": "tmpfs", "source": "shm", "options": ["nosuid", "noexec", "nodev", "mode=1777", "size=65536k"]}),
        json!({"destination": "/dev/mqueue", "type": "mqueue", "source": "mqueue", "options": ["nosuid", "noexec", "nodev"]}),
        json!({"destination": "/sys", "type": "sysfs", "source": "sysfs", "options": ["nosuid", "noexec", "nodev", if privileged { "rw" } else { "ro" }]}),
    ];
    let (mut shared, mut slave) = (false, false);
    for m in c.volume_mounts.iter().flatten() {
        let volume = spec.volumes.iter().flatten().find(|v| v.name == m.name).unwrap_or_else(|| panic!("volume {}", m.name));
        let source = if let Some(hp) = &volume.host_path {
            node.host_paths.get(&hp.path).cloned().unwrap_or_else(|| panic!("the lab has no host path {}", hp.path))
        } else if volume.config_map.is_some() {
            node.config_map.clone()
        } else {
            panic!("volume {}: the test knows hostPath and configMap volumes", m.name)
        };
        let propagation = match m.mount_propagation.as_deref() {
            Some("Bidirectional") => {
                shared = true;
                "rshared"
            }
            Some("HostToContainer") => {
                slave = true;
                "rslave"
            }
            _ => "rprivate",
        };
        let ro = if m.read_only == Some(true) { "ro" } else { "rw" };
        mounts.push(json!({"destination": m.mount_path, "type": "bind", "source": source, "options": ["rbind", propagation, ro]}));
    }
    // kubelet mounts the ServiceAccount's token, CA and namespace.
    mounts.push(json!({
        "destination": "/var/run/secrets/kubernetes.io/serviceaccount", "type": "bind",
        "source": node.service_account, "options": ["rbind", "rprivate", "ro"]
    }));
    let mut nofile = libc::rlimit { rlim_cur: 1024, rlim_max: 1024 };
    // SAFETY: getrlimit fills the struct.
    unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut nofile) };
    let host_network = spec.host_network == Some(true);
    assert!(host_network, "the DaemonSet runs on the host network");
    let netns = format!("/run/netns/{}", node.netns);
    // containerd's defaults for an unprivileged container; a privileged one gets neither.
    let (masked, readonly): (Vec<&str>, Vec<&str>) = if privileged {
        (vec![], vec![])
    } else {
        (
            vec![
                "/proc/acpi",
                "/proc/kcore",
                "/proc/keys",
                "/proc/latency_stats",
                "/proc/timer_list",
                "/proc/timer_stats",
                "/proc/sched_debug",
                "/proc/scsi",
                "/sys/firmware",
            ],
            vec!["/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys", "/proc/sysrq-trigger"],
        )
    };
    json!({
        "ociVersion": "1.0.2",
        "process": {
            "terminal": false,
            "user": {"uid": 0, "gid": 0},
            "args": args,
            "env": env.iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>(),
            "cwd": "/",
            "capabilities": {"bounding": caps, "effective": caps, "permitted": caps},
            "noNewPrivileges": !privileged && sc.allow_privilege_escalation == Some(false),
            // What the runtime itself has, as containerd passes its own on.
            "rlimits": [{"type": "RLIMIT_NOFILE", "hard": nofile.rlim_max, "soft": nofile.rlim_cur}],
        },
        "root": {"path": rootfs, "readonly": sc.read_only_root_filesystem == Some(true)},
        "hostname": node.node_name,
        "mounts": mounts,
        "linux": {
            // On a cgroup v1 host (as this one) the runtime shares the host's cgroup namespace.
            "namespaces": [{"type": "pid"}, {"type": "ipc"}, {"type": "uts"}, {"type": "mount"}, {"type": "network", "path": netns}],
            "rootfsPropagation": if shared { "rshared" } else if slave { "rslave" } else { "rprivate" },
            "maskedPaths": masked,
            "readonlyPaths": readonly,
        },
    })
}

/// Runs container `c` of the DaemonSet's pod from `rootfs`; its output goes to `dir`/`<name>.log`.
pub fn run(ds: &DaemonSet, c: &Container, node: &Node, rootfs: &Path, dir: &Path) -> Running {
    let id = format!("pxct-{}-{}", c.name, unique_id());
    let bundle = dir.join(&id);
    fs::create_dir_all(&bundle).expect("bundle directory");
    fs::write(bundle.join("config.json"), serde_json::to_vec_pretty(&oci_config(ds, c, node, rootfs)).unwrap()).expect("config.json");
    let root = dir.join("runc");
    let log = dir.join(format!("{}.log", c.name));
    let out = fs::OpenOptions::new().create(true).append(true).open(&log).expect("container log");
    let child = Command::new("runc")
        .arg("--root")
        .arg(&root)
        .args(["run", "--bundle"])
        .arg(&bundle)
        .arg(&id)
        .stdin(Stdio::null())
        .stdout(out.try_clone().unwrap())
        .stderr(out)
        .spawn()
        .expect("runc run");
    Running { id, root, child: Some(child), log }
}

/// A host directory the lab owns, bind-mounted on itself and made shared, as a node's / is
/// (a Bidirectional volume needs a shared source). Unmounted on drop, with what was mounted
/// inside it.
pub struct SharedDir(pub PathBuf);

impl SharedDir {
    pub fn new(path: PathBuf) -> Self {
        fs::create_dir_all(&path).expect("host directory");
        let p = path.to_str().expect("utf-8 path");
        sh(&["mount", "--bind", p, p]);
        sh(&["mount", "--make-shared", p]);
        Self(path)
    }
}

impl Drop for SharedDir {
    fn drop(&mut self) {
        crate::lab::release_bpffs(&self.0.join("proxy-agent"));
        // Mounts stack here (the bind, what the init container mounted, its propagated copies):
        // off they come, one by one.
        let target = self.0.to_string_lossy().to_string();
        for _ in 0..16 {
            let mounted =
                fs::read_to_string("/proc/self/mountinfo").is_ok_and(|m| m.lines().any(|l| l.split(' ').nth(4) == Some(target.as_str())));
            if !mounted {
                break;
            }
            // SAFETY: a lazy unmount of a path the lab owns.
            let c = std::ffi::CString::new(target.as_str()).expect("path");
            unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) };
        }
        let _ = fs::remove_dir_all(&self.0);
    }
}
