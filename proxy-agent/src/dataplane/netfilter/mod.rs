//! The fallback modes: the kernel's netfilter (iptables, nftables) or IPVS programmed from the
//! same node view as the eBPF dataplane, for nodes that cannot run our programs. Each mode
//! renders the whole desired state from every Service's ports (`PortView`) with kube-proxy's
//! layout, so operators' tooling and runbooks still apply, and brings the kernel to it.

pub mod conntrack;
pub mod iptables;
pub mod ipvs;
pub mod nfacct;
pub mod nfnetlink;
pub mod nftables;
pub mod proxier;
pub mod sysctl;
pub mod takeover;

use std::{
    collections::BTreeMap,
    io::Write as _,
    net::IpAddr,
    process::{Command, Stdio},
    time::Duration,
};

use crate::model::{Cidr, EndpointView, Family, ObjectKey, PortView};

/// Every Service's ports, by Service (sorted, so output is deterministic).
pub type Services = BTreeMap<ObjectKey, Vec<PortView>>;

/// What the renderers need to know about the node: both families' addresses, or one family's
/// (`for_family`, what each family's rules are rendered from).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NodeContext {
    /// Addresses NodePorts are served on (`--nodeport-addresses` applied).
    pub nodeport_ips: Vec<IpAddr>,
    /// `--nodeport-addresses` was not given: NodePorts are served on every local address
    /// (iptables: `-m addrtype --dst-type LOCAL`).
    pub nodeport_all: bool,
    /// How pod traffic is recognised (no masquerade for cluster IPs, and the
    /// externalTrafficPolicy Local short-circuit); kube-proxy's `detectLocalMode`.
    pub local: LocalTraffic,
    /// `--masquerade-all`.
    pub masquerade_all: bool,
    /// The node's primary IPs, one per family (see `NodeInfo::node_ips`): load-balancer source
    /// ranges that hold one admit the node from the load balancer's own address.
    pub node_ips: Vec<IpAddr>,
    /// Families whose NodePorts are on every local address although `nodeport_all` is not
    /// set: `--nodeport-addresses` names no range of theirs (kube-proxy's rule, per family).
    pub nodeport_all_families: Vec<Family>,
}

impl NodeContext {
    /// The same node as one family's rules see it: that family's addresses and pod range.
    pub fn for_family(&self, family: Family) -> Self {
        let of = |v: &[IpAddr]| v.iter().copied().filter(|a| Family::of(*a) == family).collect();
        Self {
            nodeport_ips: of(&self.nodeport_ips),
            nodeport_all: self.nodeport_all || self.nodeport_all_families.contains(&family),
            nodeport_all_families: vec![],
            local: self.local.for_family(family),
            masquerade_all: self.masquerade_all,
            node_ips: of(&self.node_ips),
        }
    }
}

/// How the rules tell traffic from the node's pods (kube-proxy's local traffic detector).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum LocalTraffic {
    /// Nothing is known: nothing counts as local.
    #[default]
    Unknown,
    /// From these ranges, at most one per family (the cluster CIDRs, or the node's pod CIDRs).
    Cidrs(Vec<Cidr>),
    /// Arriving on this interface (a bridge: `br0`).
    Interface(String),
    /// Arriving on interfaces whose name starts with this (`veth`, `cali`).
    InterfacePrefix(String),
}

impl LocalTraffic {
    /// One family's part: its range, or Unknown when it has none.
    pub fn for_family(&self, family: Family) -> Self {
        match self {
            Self::Cidrs(c) => match c.iter().find(|c| c.family() == family) {
                Some(c) => Self::Cidrs(vec![*c]),
                None => Self::Unknown,
            },
            other => other.clone(),
        }
    }

    /// The iptables match for "from a pod" (`negate`: "not from a pod"), if one is known (of a
    /// one-family `LocalTraffic`, see `for_family`).
    pub fn iptables(&self, negate: bool) -> Option<String> {
        let not = if negate { "! " } else { "" };
        Some(match self {
            Self::Unknown => return None,
            Self::Cidrs(c) => format!("{not}-s {}", c.first()?),
            Self::Interface(i) => format!("{not}-i {i}"),
            Self::InterfacePrefix(p) => format!("{not}-i {p}+"),
        })
    }

    /// The same in nftables syntax.
    pub fn nftables(&self, negate: bool) -> Option<String> {
        let op = if negate { "!= " } else { "" };
        Some(match self {
            Self::Unknown => return None,
            Self::Cidrs(c) => {
                let c = c.first()?;
                format!("{} saddr {op}{c}", nft_family(c.family()))
            }
            Self::Interface(i) => format!("iifname {op}\"{i}\""),
            Self::InterfacePrefix(p) => format!("iifname {op}\"{p}*\""),
        })
    }
}

#[derive(Clone, Debug, thiserror::Error)]
pub enum NetfilterError {
    #[error("{tool} is not installed or not on PATH ({why}); install the Debian package {package}")]
    Missing { tool: &'static str, package: &'static str, why: String },
    #[error("{command} failed: {stderr}")]
    Failed { command: String, stderr: String },
    /// The tool died of a signal (it prints nothing of its own then); `why`: what it printed
    /// before, and what its caller knows of such crashes (`nftables::explain_crash`);
    /// `unreadable`: the tables found to crash it (nft's, "ip fw"), if any.
    #[error("{command} crashed: killed by {}{why}", signal_name(*.signal))]
    Crashed { command: String, signal: i32, why: String, unreadable: Vec<String> },
}

impl NetfilterError {
    /// The tables nft was found to crash on (`nftables::explain_crash`: a newer nft's sets),
    /// while they exist the nftables mode can write nothing.
    pub fn unreadable_tables(&self) -> &[String] {
        match self {
            Self::Crashed { unreadable, .. } => unreadable,
            _ => &[],
        }
    }
}

/// "signal 11 (SIGSEGV)", for the signals a crashing or killed tool dies of.
fn signal_name(signal: i32) -> String {
    let name = match signal {
        libc::SIGSEGV => "SIGSEGV",
        libc::SIGABRT => "SIGABRT",
        libc::SIGBUS => "SIGBUS",
        libc::SIGILL => "SIGILL",
        libc::SIGFPE => "SIGFPE",
        libc::SIGKILL => "SIGKILL",
        libc::SIGTERM => "SIGTERM",
        _ => return format!("signal {signal}"),
    };
    format!("signal {signal} ({name})")
}

/// A mode's rules: rendered as text (what `proxy-agent rules` prints) and applied.
pub trait RuleSet {
    fn mode(&self) -> super::ProxyMode;
    /// The complete rules for these Services, in the mode's own input format.
    fn render(&self, services: &Services, node: &NodeContext) -> String;
    /// Brings the kernel to the rules for `services` (each mode writes only what changed
    /// where its tools allow). Returns how many chains (or objects) were written.
    fn apply(&mut self, services: &Services, node: &NodeContext) -> Result<usize, NetfilterError>;
    /// Forgets what was applied: the next `apply` writes everything again (a full resync,
    /// which repairs rules someone else changed).
    fn forget_applied(&mut self);
    /// The Service's ports changed, or it went, since the last `apply`, which had it with
    /// `before` (None: it is new since): a mode that can write Services one by one (nftables)
    /// renders only those at the next.
    fn changed(&mut self, _service: &ObjectKey, _before: Option<&[PortView]>) {}
    /// `apply` has more to write: a long write cut into steps, one per `apply`, so that the
    /// changes that come meanwhile are taken between them (nftables: a build from nothing, a
    /// `Refresh` of a table that exists, or the rest of more changes than a sync writes).
    fn pending(&self) -> bool {
        false
    }
    /// The pending steps write Services the kernel does not serve yet, or not as they are: a
    /// table built from nothing (nftables: `NftablesRules::build_step`), written again in place
    /// before its maps are filled (when they are, every Service is served throughout the
    /// rest), or changes to more Services than a sync writes, in batches.
    fn building(&self) -> bool {
        false
    }
    /// The cluster's Service CIDRs, for a mode that drops traffic to their unallocated
    /// addresses (nftables, as kube-proxy's); the next `apply` writes them.
    fn set_service_cidrs(&mut self, _cidrs: Vec<Cidr>) {}
    /// The address family the rules are for (each family has its own tables).
    fn family(&self) -> Family {
        Family::V4
    }
}

/// The nftables address match keyword of a family (`ip`, `ip6`), which is also its table
/// family.
pub fn nft_family(family: Family) -> &'static str {
    match family {
        Family::V4 => "ip",
        Family::V6 => "ip6",
    }
}

/// One mode's rules for each family the node serves, as kube-proxy's meta-proxier runs one
/// proxier per family: each renders and applies its family's ports with its family's view of
/// the node, into its own tables.
pub struct PerFamily {
    sets: Vec<Box<dyn RuleSet + Send>>,
    /// Per family: its last failure, when it may be tried again while another family's long
    /// write goes on, and the wait after the next failure.
    failing: Vec<Option<(NetfilterError, std::time::Instant, std::time::Duration)>>,
}

/// A family that fails while another's long write goes on (`RuleSet::pending`, one step per
/// sync, at once) is tried again after this, then twice as long each time up to
/// `RETRY_MAX_WHILE_PENDING`, not at every step: its retry may be a long write itself.
const RETRY_FIRST_WHILE_PENDING: std::time::Duration = std::time::Duration::from_secs(2);
const RETRY_MAX_WHILE_PENDING: std::time::Duration = std::time::Duration::from_secs(60);

impl PerFamily {
    pub fn new(sets: Vec<Box<dyn RuleSet + Send>>) -> Self {
        let failing = sets.iter().map(|_| None).collect();
        Self { sets, failing }
    }
}

/// The error of families' applies to report: the first, unless a later one is nft's crash on
/// tables it cannot read (auto mode leaves the mode on that: `proxier::NetfilterProxier::set_fallback`).
fn first_failure(first: Option<NetfilterError>, next: NetfilterError) -> NetfilterError {
    match first {
        Some(f) if !f.unreadable_tables().is_empty() || next.unreadable_tables().is_empty() => f,
        _ => next,
    }
}

impl RuleSet for PerFamily {
    fn mode(&self) -> super::ProxyMode {
        self.sets.first().map_or(super::ProxyMode::Nftables, |s| s.mode())
    }

    /// The first family's rules, and the others' where they have ports (what `rules` prints:
    /// an IPv4-only directory shows IPv4 rules only, though `apply` writes the IPv6 tables'
    /// fixed part too, as kube-proxy does on a node with IPv6).
    fn render(&self, services: &Services, node: &NodeContext) -> String {
        let has_ports = |f: Family| services.values().flatten().any(|p| p.family == f);
        self.sets
            .iter()
            .enumerate()
            .filter(|(i, s)| *i == 0 || has_ports(s.family()))
            .map(|(_, s)| s.render(services, &node.for_family(s.family())))
            .collect()
    }

    fn apply(&mut self, services: &Services, node: &NodeContext) -> Result<usize, NetfilterError> {
        let mut written = 0;
        let mut failed = None;
        let now = std::time::Instant::now();
        let stepping = self.pending();
        // Each family is applied even when the other fails: one family's trouble must not
        // freeze the other's Services.
        for (s, failing) in self.sets.iter_mut().zip(&mut self.failing) {
            if let Some((e, _, _)) = failing.as_ref().filter(|(_, at, _)| stepping && now < *at) {
                failed = Some(first_failure(failed, e.clone()));
                continue;
            }
            match s.apply(services, &node.for_family(s.family())) {
                Ok(n) => {
                    written += n;
                    *failing = None;
                }
                Err(e) => {
                    let wait = failing.as_ref().map_or(RETRY_FIRST_WHILE_PENDING, |(_, _, w)| (*w * 2).min(RETRY_MAX_WHILE_PENDING));
                    *failing = Some((e.clone(), now + wait, wait));
                    failed = Some(first_failure(failed, e));
                }
            }
        }
        failed.map_or(Ok(written), Err)
    }

    fn forget_applied(&mut self) {
        self.sets.iter_mut().for_each(|s| s.forget_applied());
    }

    fn changed(&mut self, service: &ObjectKey, before: Option<&[PortView]>) {
        self.sets.iter_mut().for_each(|s| s.changed(service, before));
    }

    fn pending(&self) -> bool {
        self.sets.iter().any(|s| s.pending())
    }

    fn building(&self) -> bool {
        self.sets.iter().any(|s| s.building())
    }

    fn set_service_cidrs(&mut self, cidrs: Vec<Cidr>) {
        for s in &mut self.sets {
            let family = s.family();
            s.set_service_cidrs(cidrs.iter().copied().filter(|c| c.family() == family).collect());
        }
    }
}

/// Starts `program args` with stdout and stderr piped, and stdin piped when `stdin` (else
/// empty). A program that cannot be started is reported as missing, with its package.
pub fn spawn(program: &'static str, package: &'static str, args: &[&str], stdin: bool) -> Result<std::process::Child, NetfilterError> {
    Command::new(program)
        .args(args)
        .stdin(if stdin { Stdio::piped() } else { Stdio::null() })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| NetfilterError::Missing { tool: program, package, why: e.to_string() })
}

/// How long a tool may go without using any CPU before the agent takes it for hung and kills
/// it (waiting for a lock or an answer that never comes), so that the mode's loop retries with
/// backoff instead of waiting on it for ever. A slow tool is left to finish: iptables-nft
/// loads 10,000 Services in about 100 s of CPU in one run, and nft answers within seconds.
pub const TOOL_IDLE_LIMIT: Duration = Duration::from_secs(60);

/// Runs `program args` with `input` on stdin, killed if idle for `TOOL_IDLE_LIMIT`.
pub fn run_with_input(program: &'static str, package: &'static str, args: &[&str], input: &str) -> Result<String, NetfilterError> {
    run_within(program, package, args, input, TOOL_IDLE_LIMIT)
}

/// Runs `program args` with `input` on stdin; kills it when a whole `idle` goes by without it
/// using any CPU. The input goes in from a thread of its own while this one reads what the
/// tool prints: a tool that answers each line as it reads (`ip -force -batch`, `ipvsadm -R`)
/// would otherwise fill its stderr pipe and wait for the agent to read it, while the agent
/// waits for the tool to read the rest of its input.
pub fn run_within(
    program: &'static str,
    package: &'static str,
    args: &[&str],
    input: &str,
    idle: Duration,
) -> Result<String, NetfilterError> {
    let mut child = spawn(program, package, args, true)?;
    let mut stdin = child.stdin.take().expect("piped stdin");
    let command = || format!("{program} {}", args.join(" "));
    let pid = child.id();
    let (out, written, killed) = std::thread::scope(|scope| {
        let writer = scope.spawn(move || {
            let written = stdin.write_all(input.as_bytes());
            drop(stdin);
            written
        });
        // Reads stdout and stderr to their ends, then reaps the tool.
        let (out, killed) = killed_if_idle(pid, idle, || child.wait_with_output());
        let written = writer.join().unwrap_or_else(|_| Err(std::io::Error::other("the input writer panicked")));
        (out, written, killed)
    });
    let out = out.map_err(|e| NetfilterError::Failed { command: command(), stderr: e.to_string() })?;
    let stderr = String::from_utf8_lossy(&out.stderr).trim().to_string();
    if killed_idle(killed, &out.status) {
        return Err(hung(command(), idle, &stderr));
    }
    // A crash first: one in the middle of the input also broke the pipe.
    if let Some(signal) = std::os::unix::process::ExitStatusExt::signal(&out.status) {
        let why = if stderr.is_empty() { String::new() } else { format!(" (it printed: {stderr})") };
        return Err(NetfilterError::Crashed { command: command(), signal, why, unreadable: Vec::new() });
    }
    if let Err(e) = written {
        return Err(NetfilterError::Failed { command: command(), stderr: e.to_string() });
    }
    if !out.status.success() {
        return Err(NetfilterError::Failed { command: command(), stderr });
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Whether a tool `killed_if_idle` reported killed died of that kill (not ended by itself just
/// at the limit).
pub fn killed_idle(killed: bool, status: &std::process::ExitStatus) -> bool {
    killed && std::os::unix::process::ExitStatusExt::signal(status) == Some(libc::SIGKILL)
}

/// The error of a tool `killed_if_idle` killed, with what it printed before.
pub fn hung(command: String, idle: Duration, printed: &str) -> NetfilterError {
    let printed = if printed.is_empty() { String::new() } else { format!("; it printed: {printed}") };
    NetfilterError::Failed { command, stderr: format!("used no CPU for {} s, taken for hung and killed{printed}", idle.as_secs_f64()) }
}

/// Runs `wait` (which ends when child `pid` has) while a watchdog kills the child once it used
/// no CPU over a whole window of `idle` (its CPU time is read at the end of each window, so it
/// is killed after one to two windows of idleness); returns what `wait` did and whether it was
/// killed.
pub fn killed_if_idle<R>(pid: u32, idle: Duration, wait: impl FnOnce() -> R) -> (R, bool) {
    let watch = ChildWatch::new(pid);
    std::thread::scope(|scope| {
        let (ended, end) = std::sync::mpsc::channel::<()>();
        let watch = &watch;
        let watchdog = scope.spawn(move || {
            let mut before = watch.cpu();
            while let Err(std::sync::mpsc::RecvTimeoutError::Timeout) = end.recv_timeout(idle) {
                // (Unreadable: gone, and the wait ends by itself; or a passing failure to read,
                // which is no reason to kill a tool that may be busy.)
                let now = watch.cpu();
                if now.is_some() && now == before {
                    return watch.kill();
                }
                before = now;
            }
            false
        });
        let r = wait();
        drop(ended);
        (r, watchdog.join().unwrap_or(false))
    })
}

/// utime + stime of a `/proc/PID/stat` line (its 14th and 15th fields; the command name in
/// parentheses may hold spaces, so fields are counted after its closing one).
fn cpu_ticks(stat: &str) -> Option<u64> {
    let mut rest = stat.get(stat.rfind(')')? + 1..)?.split_whitespace().skip(11);
    Some(rest.next()?.parse::<u64>().ok()? + rest.next()?.parse::<u64>().ok()?)
}

/// A child that can be killed from another thread without the risk of signalling a process
/// that took over its pid after it was reaped: a pidfd, opened while the child is still ours.
struct ChildWatch {
    pid: u32,
    pidfd: Option<std::os::fd::OwnedFd>,
}

impl ChildWatch {
    fn new(pid: u32) -> Self {
        // SAFETY: pidfd_open with a pid and no flags; it returns a new descriptor or -1.
        let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
        if fd < 0 {
            // Without pidfds (a kernel before 5.3, a seccomp profile that refuses the call) the
            // tools run unbounded: said once.
            static SAID: std::sync::Once = std::sync::Once::new();
            let why = std::io::Error::last_os_error();
            SAID.call_once(|| tracing::warn!("pidfd_open: {why}; a hung nft, iptables or ipvsadm will not be killed"));
        }
        // SAFETY: a descriptor the syscall just returned, owned from here.
        let pidfd = (fd >= 0).then(|| unsafe { std::os::fd::FromRawFd::from_raw_fd(fd as i32) });
        Self { pid, pidfd }
    }

    /// The CPU time it has used so far, in clock ticks (user and system: a tool waiting in the
    /// kernel on its netlink answer counts too); None once it is gone, or unreadable.
    fn cpu(&self) -> Option<u64> {
        cpu_ticks(&std::fs::read_to_string(format!("/proc/{}/stat", self.pid)).ok()?)
    }

    /// SIGKILL; false if it had ended already (or cannot be reached).
    fn kill(&self) -> bool {
        use std::os::fd::AsRawFd;
        let Some(fd) = &self.pidfd else { return false };
        // SAFETY: pidfd_send_signal on our own pidfd, no siginfo, no flags.
        unsafe { libc::syscall(libc::SYS_pidfd_send_signal, fd.as_raw_fd(), libc::SIGKILL, std::ptr::null::<libc::siginfo_t>(), 0) == 0 }
    }
}

/// Runs `program args`; Ok(stdout) on success.
pub fn run(program: &'static str, package: &'static str, args: &[&str]) -> Result<String, NetfilterError> {
    run_with_input(program, package, args, "")
}

pub const IPTABLES_PACKAGE: &str = "iptables";

/// Which iptables a node uses. The two kernel backends do not see each other's rules, so the
/// agent must write where kubelet, the CNI plugin and the rest of the node write, as kube-proxy's
/// image does with its iptables wrapper (`--iptables-backend`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Iptables {
    /// iptables over nf_tables (`iptables-nft`): Debian's and most distributions' default.
    #[default]
    Nft,
    /// The x_tables backend (`iptables-legacy`).
    Legacy,
    /// Whatever `iptables` is on PATH, for systems without the suffixed names.
    Path,
}

impl Iptables {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Nft => "nft",
            Self::Legacy => "legacy",
            Self::Path => "path",
        }
    }
    pub fn iptables(self) -> &'static str {
        match self {
            Self::Nft => "iptables-nft",
            Self::Legacy => "iptables-legacy",
            Self::Path => "iptables",
        }
    }
    pub fn restore(self) -> &'static str {
        match self {
            Self::Nft => "iptables-nft-restore",
            Self::Legacy => "iptables-legacy-restore",
            Self::Path => "iptables-restore",
        }
    }
    pub fn save(self) -> &'static str {
        match self {
            Self::Nft => "iptables-nft-save",
            Self::Legacy => "iptables-legacy-save",
            Self::Path => "iptables-save",
        }
    }

    /// The backends this node has tools for (`Path` only when neither suffixed one exists).
    pub fn available() -> Vec<Self> {
        let found: Vec<Self> =
            [Self::Nft, Self::Legacy].into_iter().filter(|b| run(b.save(), IPTABLES_PACKAGE, &["--version"]).is_ok()).collect();
        if found.is_empty() && run(Self::Path.save(), IPTABLES_PACKAGE, &["--version"]).is_ok() {
            return vec![Self::Path];
        }
        found
    }

    /// `--iptables-backend auto`: of the `available` backends, the one the node already uses,
    /// and why. Reads both backends' rules (`iptables-*-save`) and decides with
    /// [`choose_backend`].
    pub fn detect(available: &[Self]) -> (Self, String) {
        match available {
            [] => (Self::Nft, "no iptables tools found; assuming nft (install the iptables package)".into()),
            [only] => (*only, format!("only {} is installed", only.iptables())),
            _ => {
                let save = |b: Self| run(b.save(), IPTABLES_PACKAGE, &[]).unwrap_or_default();
                choose_backend(&save(Self::Nft), &save(Self::Legacy))
            }
        }
    }
}

impl Iptables {
    /// This backend's tools for one family.
    pub fn tools(self, family: Family) -> Tools {
        Tools { backend: self, family }
    }
}

/// One family's iptables tools in one backend (`iptables-nft-restore`, `ip6tables-legacy`, ...):
/// each family has its own tables, as kube-proxy's per-family proxiers write them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Tools {
    pub backend: Iptables,
    pub family: Family,
}

impl Tools {
    /// The command, its save and its restore.
    fn names(self) -> [&'static str; 3] {
        match (self.family, self.backend) {
            (Family::V4, b) => [b.iptables(), b.save(), b.restore()],
            (Family::V6, Iptables::Nft) => ["ip6tables-nft", "ip6tables-nft-save", "ip6tables-nft-restore"],
            (Family::V6, Iptables::Legacy) => ["ip6tables-legacy", "ip6tables-legacy-save", "ip6tables-legacy-restore"],
            (Family::V6, Iptables::Path) => ["ip6tables", "ip6tables-save", "ip6tables-restore"],
        }
    }
    pub fn cmd(self) -> &'static str {
        self.names()[0]
    }
    pub fn save(self) -> &'static str {
        self.names()[1]
    }
    pub fn restore(self) -> &'static str {
        self.names()[2]
    }
}

impl std::fmt::Display for Tools {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.cmd())
    }
}

impl std::str::FromStr for Iptables {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "nft" => Ok(Self::Nft),
            "legacy" => Ok(Self::Legacy),
            other => Err(format!("unknown iptables backend {other:?} (nft, legacy or auto)")),
        }
    }
}

impl std::fmt::Display for Iptables {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.iptables())
    }
}

/// Every table of one family's iptables, read with one `*-save` call (a call per table costs a
/// process each, which adds up at start on a slow node): table name -> its listing.
pub fn save_tables(tools: Tools) -> Result<BTreeMap<String, String>, NetfilterError> {
    let out = run(tools.save(), IPTABLES_PACKAGE, &[])?;
    Ok(split_tables(&out))
}

/// An `iptables-save` listing of several tables, split by table.
pub fn split_tables(save: &str) -> BTreeMap<String, String> {
    let mut tables: BTreeMap<String, String> = BTreeMap::new();
    let mut current: Option<String> = None;
    for line in save.lines() {
        if let Some(name) = line.strip_prefix('*') {
            current = Some(name.trim().to_string());
        }
        if let Some(t) = &current {
            let text = tables.entry(t.clone()).or_default();
            text.push_str(line);
            text.push('\n');
        }
        if line == "COMMIT" {
            current = None;
        }
    }
    tables
}

/// The chains an `iptables-save` listing declares (its `:NAME POLICY [counters]` lines).
pub fn declared_chains(save: &str) -> impl Iterator<Item = &str> {
    save.lines().filter_map(|l| l.strip_prefix(':')?.split_whitespace().next())
}

/// Chains kubelet creates in the backend it uses; their presence settles the question.
const BACKEND_HINTS: [&str; 2] = ["KUBE-IPTABLES-HINT", "KUBE-KUBELET-CANARY"];

/// Picks the backend from what each one holds (`iptables-save` output of both): the one with
/// kubelet's hint chains; else the one with more rules, nft on a tie (a fresh node).
pub fn choose_backend(nft: &str, legacy: &str) -> (Iptables, String) {
    let hinted = |save: &str| BACKEND_HINTS.iter().find(|h| declared_chains(save).any(|c| c == **h)).copied();
    match (hinted(nft), hinted(legacy)) {
        (Some(h), None) => return (Iptables::Nft, format!("kubelet's {h} chain is in iptables-nft")),
        (None, Some(h)) => return (Iptables::Legacy, format!("kubelet's {h} chain is in iptables-legacy")),
        _ => {}
    }
    let rules = |save: &str| save.lines().filter(|l| l.starts_with("-A ")).count();
    let (n, l) = (rules(nft), rules(legacy));
    if l > n {
        (Iptables::Legacy, format!("iptables-legacy holds more rules ({l}) than iptables-nft ({n})"))
    } else {
        (Iptables::Nft, format!("iptables-nft holds at least as many rules ({n}) as iptables-legacy ({l})"))
    }
}

/// `iptables-restore --noflush`: only the chains `text` names are touched.
pub fn iptables_restore(ipt: Tools, text: &str) -> Result<String, NetfilterError> {
    run_with_input(ipt.restore(), IPTABLES_PACKAGE, &["-w", "5", "--noflush"], text)
}

/// iptables-restore input (with --noflush) that flushes and deletes `chains` of `table`.
pub fn delete_chains_text(table: &str, chains: &[String]) -> String {
    let mut text = format!("*{table}\n");
    for c in chains {
        text += &format!(":{c} - [0:0]\n");
    }
    for c in chains {
        text += &format!("-X {c}\n");
    }
    text + "COMMIT\n"
}

/// A jump from a built-in chain into one of ours: (table, chain, extra match, comment, target).
pub type Jump = (&'static str, &'static str, &'static str, &'static str, &'static str);

fn jump(ipt: Tools, op: &str, (table, chain, extra, comment, target): Jump) -> Result<String, NetfilterError> {
    let mut args = vec!["-w", "5", "-t", table, op, chain];
    args.extend(extra.split_whitespace());
    args.extend(["-m", "comment", "--comment", comment, "-j", target]);
    run(ipt.cmd(), IPTABLES_PACKAGE, &args)
}

/// Inserts each jump at the top of its chain unless it is there already.
pub fn ensure_jumps(ipt: Tools, jumps: &[Jump]) -> Result<(), NetfilterError> {
    for &j in jumps {
        if jump(ipt, "-C", j).is_err() {
            jump(ipt, "-I", j)?;
        }
    }
    Ok(())
}

/// Deletes every copy of each jump. Returns one entry per rule deleted.
pub fn delete_jumps(ipt: Tools, jumps: &[Jump]) -> Vec<Jump> {
    let mut deleted = Vec::new();
    for &j in jumps {
        while jump(ipt, "-D", j).is_ok() {
            deleted.push(j);
        }
    }
    deleted
}

/// RFC 4648 base32 (standard alphabet, with padding) of `data`.
pub fn base32(data: &[u8]) -> String {
    const ALPHABET: &[u8; 32] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZ234567";
    let mut out = String::with_capacity(data.len().div_ceil(5) * 8);
    for chunk in data.chunks(5) {
        let mut buf = [0u8; 5];
        buf[..chunk.len()].copy_from_slice(chunk);
        let bits = u64::from_be_bytes([0, 0, 0, buf[0], buf[1], buf[2], buf[3], buf[4]]);
        let chars = (chunk.len() * 8).div_ceil(5);
        for i in 0..8 {
            if i < chars {
                out.push(ALPHABET[((bits >> (35 - i * 5)) & 31) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

/// The first `len` characters of base32(sha256(`input`)): how kube-proxy names per-Service
/// chains.
pub fn hash_name(input: &str, len: usize) -> String {
    use sha2::Digest as _;
    let digest = sha2::Sha256::digest(input.as_bytes());
    base32(&digest)[..len].to_string()
}

/// One service port with kube-proxy's derived predicates (`pkg/proxy` semantics), shared by
/// the renderers.
pub struct Plan<'a> {
    pub port: &'a PortView,
    /// `ns/name:port` (`ns/name` for an unnamed port).
    pub spn: String,
    /// Lower-case protocol: tcp, udp, sctp.
    pub proto: &'static str,
    pub cluster_ip: Option<IpAddr>,
    pub externally_accessible: bool,
    /// Endpoints for the Cluster policy, ordered as kube-proxy orders them (by the `ip:port`
    /// string).
    pub cluster: Vec<EndpointView>,
    pub local: Vec<EndpointView>,
    pub has_endpoints: bool,
    pub has_internal_endpoints: bool,
    pub has_external_endpoints: bool,
    pub uses_cluster_chain: bool,
    pub uses_local_chain: bool,
    pub uses_external_chain: bool,
    /// loadBalancerSourceRanges apply (with endpoints, in iptables mode).
    pub has_firewall: bool,
    /// Endpoints either chain leads to (each gets an endpoint chain), in string order.
    pub reachable: Vec<EndpointView>,
}

fn by_string(mut v: Vec<EndpointView>) -> Vec<EndpointView> {
    v.sort_by_key(|e| e.socket().to_string());
    v
}

impl<'a> Plan<'a> {
    pub fn new(port: &'a PortView) -> Self {
        let externally_accessible = port.node_port.is_some() || !port.lb_ips.is_empty() || !port.external_ips.is_empty();
        let uses_cluster = !port.internal_local || externally_accessible;
        let uses_local = port.internal_local || (port.external_local && externally_accessible);
        let cluster = if uses_cluster { by_string(port.cluster_endpoints.clone()) } else { Vec::new() };
        let local = if uses_local { by_string(port.local_endpoints.clone()) } else { Vec::new() };
        let has_endpoints = port.has_endpoints;
        Self {
            spn: port.name.to_string(),
            proto: match port.name.protocol {
                crate::model::Protocol::Tcp => "tcp",
                crate::model::Protocol::Udp => "udp",
                crate::model::Protocol::Sctp => "sctp",
            },
            cluster_ip: port.cluster_ips.first().copied(),
            externally_accessible,
            has_endpoints,
            has_internal_endpoints: has_endpoints && !(port.internal_local && local.is_empty()),
            has_external_endpoints: has_endpoints && !(port.external_local && local.is_empty()),
            uses_cluster_chain: !cluster.is_empty() && uses_cluster,
            uses_local_chain: !local.is_empty() && uses_local,
            uses_external_chain: has_endpoints && externally_accessible,
            has_firewall: !port.lb_ips.is_empty() && !port.lb_source_ranges.is_empty(),
            reachable: by_string(EndpointView::union(&cluster, &local)),
            cluster,
            local,
            port,
        }
    }

    /// The endpoints internal traffic uses.
    pub fn internal(&self) -> &[EndpointView] {
        if self.port.internal_local {
            &self.local
        } else {
            &self.cluster
        }
    }

    /// The endpoints external traffic uses.
    pub fn external(&self) -> &[EndpointView] {
        if self.port.external_local {
            &self.local
        } else {
            &self.cluster
        }
    }
}

/// Rules for the proxiers' tests, which write nothing.
#[cfg(test)]
pub(crate) mod fake {
    use super::*;

    /// Fails every apply (never going on to sweep conntrack, an outside command), or succeeds
    /// with `steps` more to write (a long write in steps); counts its applies. `unreadable`: a
    /// failure is nft's crash on these tables (a newer nft's sets).
    pub(crate) struct Rules {
        pub family: Family,
        pub fails: bool,
        pub steps: usize,
        pub applied: std::sync::Arc<std::sync::atomic::AtomicUsize>,
        pub mode: super::super::ProxyMode,
        pub unreadable: Vec<String>,
    }

    impl Rules {
        pub fn failing() -> Self {
            Self { fails: true, ..Self::stepping(0) }
        }
        pub fn stepping(steps: usize) -> Self {
            Self {
                family: Family::V4,
                fails: false,
                steps,
                applied: Default::default(),
                mode: super::super::ProxyMode::Nftables,
                unreadable: Vec::new(),
            }
        }
    }

    impl RuleSet for Rules {
        fn mode(&self) -> super::super::ProxyMode {
            self.mode
        }
        fn render(&self, _: &Services, _: &NodeContext) -> String {
            String::new()
        }
        fn apply(&mut self, _: &Services, _: &NodeContext) -> Result<usize, NetfilterError> {
            self.applied.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            if self.fails && !self.unreadable.is_empty() {
                let (command, why) = ("nft -f -".into(), ": nft crashes listing a newer nft's table".into());
                return Err(NetfilterError::Crashed { command, signal: libc::SIGSEGV, why, unreadable: self.unreadable.clone() });
            }
            if self.fails {
                return Err(NetfilterError::Failed { command: "nft".into(), stderr: "a test".into() });
            }
            self.steps = self.steps.saturating_sub(1);
            Ok(1)
        }
        fn forget_applied(&mut self) {}
        fn pending(&self) -> bool {
            self.steps > 0
        }
        fn family(&self) -> Family {
            self.family
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{fake::Rules, *};

    #[test]
    fn a_tool_that_answers_each_line_as_it_reads_gets_all_its_input() {
        // 20,000 lines answered on stderr (about 400 KB): far more than a pipe holds, so with
        // the input written before anything is read, tool and agent would wait on each other.
        let input: String = (0..20_000).map(|i| format!("del {i}\n")).collect();
        let r =
            run_within("sh", "dash", &["-c", "while read l; do echo \"no such $l\" >&2; done; exit 2"], &input, Duration::from_secs(30));
        let Err(NetfilterError::Failed { stderr, .. }) = r else { panic!("{r:?}") };
        assert!(stderr.ends_with("no such del 19999"), "{}", &stderr[stderr.len().saturating_sub(80)..]);
    }

    #[test]
    fn a_tool_that_uses_no_cpu_for_the_idle_limit_is_killed() {
        let r = run_within("sleep", "coreutils", &["30"], "", Duration::from_millis(300));
        let Err(NetfilterError::Failed { command, stderr }) = r else { panic!("{r:?}") };
        assert_eq!(command, "sleep 30");
        assert!(stderr.starts_with("used no CPU for 0.3 s, taken for hung and killed"), "{stderr}");
    }

    #[test]
    fn a_busy_tool_outlives_the_idle_limit() {
        // About 2 s of shell arithmetic, watched each second: slow is not hung.
        let r =
            run_within("sh", "dash", &["-c", "i=0; while [ $i -lt 1500000 ]; do i=$((i+1)); done; echo $i"], "", Duration::from_secs(1));
        assert_eq!(r.unwrap().trim(), "1500000");
    }

    #[test]
    fn cpu_time_is_read_past_a_command_name_with_spaces() {
        let stat = "4242 (nft (x) y) S 1 4242 4242 0 -1 4194560 120 0 0 0 17 5 0 0 20 0 1 0 99 0 0";
        assert_eq!(cpu_ticks(stat), Some(22));
        assert_eq!(cpu_ticks("4242 (nft) S 1"), None);
    }

    #[test]
    fn a_listing_of_every_table_splits_by_table() {
        let save = "# Generated by iptables-nft-save\n*mangle\n:KUBE-IPTABLES-HINT - [0:0]\nCOMMIT\n# c\n*nat\n:KUBE-SERVICES - [0:0]\n-A OUTPUT -j KUBE-SERVICES\nCOMMIT\n";
        let t = split_tables(save);
        assert_eq!(t.keys().collect::<Vec<_>>(), ["mangle", "nat"]);
        assert_eq!(t["nat"], "*nat\n:KUBE-SERVICES - [0:0]\n-A OUTPUT -j KUBE-SERVICES\nCOMMIT\n");
        assert_eq!(declared_chains(&t["mangle"]).collect::<Vec<_>>(), ["KUBE-IPTABLES-HINT"]);
    }

    #[test]
    fn base32_matches_rfc4648_vectors() {
        assert_eq!(base32(b""), "");
        assert_eq!(base32(b"f"), "MY======");
        assert_eq!(base32(b"fo"), "MZXQ====");
        assert_eq!(base32(b"foo"), "MZXW6===");
        assert_eq!(base32(b"foob"), "MZXW6YQ=");
        assert_eq!(base32(b"fooba"), "MZXW6YTB");
        assert_eq!(base32(b"foobar"), "MZXW6YTBOI======");
    }

    /// A tool that dies of a signal prints nothing of its own: its error says which signal, and
    /// what it printed before; one that exits with a status is a failure as before.
    #[test]
    fn a_tool_killed_by_a_signal_is_reported_as_crashed() {
        let e = run("sh", "dash", &["-c", "echo half-done >&2; kill -SEGV $$"]).unwrap_err();
        assert!(matches!(e, NetfilterError::Crashed { signal: libc::SIGSEGV, .. }), "{e:?}");
        assert_eq!(e.to_string(), "sh -c echo half-done >&2; kill -SEGV $$ crashed: killed by signal 11 (SIGSEGV) (it printed: half-done)");
        let e = run("sh", "dash", &["-c", "kill -KILL $$"]).unwrap_err();
        assert_eq!(e.to_string(), "sh -c kill -KILL $$ crashed: killed by signal 9 (SIGKILL)");
        let e = run("sh", "dash", &["-c", "echo no >&2; exit 3"]).unwrap_err();
        assert!(matches!(e, NetfilterError::Failed { ref stderr, .. } if stderr == "no"), "{e:?}");
    }

    #[test]
    fn the_backend_is_the_one_the_node_uses() {
        let empty = "*nat\n:PREROUTING ACCEPT [0:0]\nCOMMIT\n";
        let docker = "*nat\n:DOCKER - [0:0]\n-A PREROUTING -j DOCKER\n-A POSTROUTING -s 172.17.0.0/16 -j MASQUERADE\nCOMMIT\n";
        let hint = "*mangle\n:KUBE-IPTABLES-HINT - [0:0]\nCOMMIT\n";
        // A fresh node: nft.
        assert_eq!(choose_backend(empty, empty).0, Iptables::Nft);
        // Rules only in legacy (Docker on an older host): legacy.
        assert_eq!(choose_backend(empty, docker).0, Iptables::Legacy);
        assert_eq!(choose_backend(docker, empty).0, Iptables::Nft);
        // kubelet's hint wins over rule counts.
        let (b, why) = choose_backend(hint, docker);
        assert_eq!(b, Iptables::Nft, "{why}");
        assert!(why.contains("KUBE-IPTABLES-HINT"), "{why}");
        assert_eq!(choose_backend(docker, &format!("{hint}{empty}")).0, Iptables::Legacy);
        // A rule that merely mentions the name is not the chain.
        assert_eq!(choose_backend("-A INPUT -m comment --comment KUBE-IPTABLES-HINT -j ACCEPT\n", docker).0, Iptables::Legacy);
        assert!("bogus".parse::<Iptables>().is_err());
        assert_eq!("legacy".parse::<Iptables>(), Ok(Iptables::Legacy));
    }

    /// While one family's long write goes on, one step per apply, a family that fails is not
    /// tried again at every step (its retry may be a long write itself), and is still
    /// reported failed; once the write is over it is tried at every apply again.
    #[test]
    fn a_failing_family_waits_its_turn_while_the_other_writes_in_steps() {
        let counter = || std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let (v4, v6) = (counter(), counter());
        let mut p = PerFamily::new(vec![
            Box::new(Rules { family: Family::V4, steps: 6, applied: v4.clone(), ..Rules::stepping(0) }),
            Box::new(Rules { family: Family::V6, applied: v6.clone(), ..Rules::failing() }),
        ]);
        let count = |c: &std::sync::Arc<std::sync::atomic::AtomicUsize>| c.load(std::sync::atomic::Ordering::Relaxed);
        for _ in 0..5 {
            assert!(p.pending());
            assert!(p.apply(&Services::new(), &NodeContext::default()).is_err(), "still failing");
        }
        assert_eq!((count(&v4), count(&v6)), (5, 1), "IPv6 tried once in five steps of IPv4's write");
        assert!(p.apply(&Services::new(), &NodeContext::default()).is_err());
        assert!(!p.pending());
        for _ in 0..2 {
            assert!(p.apply(&Services::new(), &NodeContext::default()).is_err());
        }
        assert_eq!(count(&v6), 3, "tried at every apply once the write is over");
    }

    /// Where both families fail, the error reported is the first family's, unless the other's
    /// is nft's crash on tables it cannot read, on which auto mode leaves the mode.
    #[test]
    fn a_crash_on_unreadable_tables_is_the_failure_reported_whichever_family() {
        let unreadable = || vec!["ip fw".to_string()];
        for (v4, v6) in [(vec![], unreadable()), (unreadable(), vec![]), (unreadable(), unreadable())] {
            let mut p = PerFamily::new(vec![
                Box::new(Rules { family: Family::V4, unreadable: v4.clone(), ..Rules::failing() }),
                Box::new(Rules { family: Family::V6, unreadable: v6.clone(), ..Rules::failing() }),
            ]);
            let e = p.apply(&Services::new(), &NodeContext::default()).unwrap_err();
            assert_eq!(e.unreadable_tables(), unreadable(), "IPv4 {v4:?}, IPv6 {v6:?}: {e}");
        }
        let mut p = PerFamily::new(vec![
            Box::new(Rules { family: Family::V4, ..Rules::failing() }),
            Box::new(Rules { family: Family::V6, ..Rules::failing() }),
        ]);
        assert!(matches!(p.apply(&Services::new(), &NodeContext::default()), Err(NetfilterError::Failed { .. })));
    }
}
