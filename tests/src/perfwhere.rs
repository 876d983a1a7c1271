//! Where a datapath path's time goes (`proxy-bench profile --where`): `perf` samples the whole
//! machine while the benchmark runs a path through BPF_PROG_TEST_RUN; the samples of this
//! process taken inside a test run are split between the programs' own code, by source line
//! (the programs' JIT line info, read while they are loaded), and the kernel functions they
//! call (map updates and lookups, helpers), and what the test run costs around them.

use std::{
    collections::HashMap,
    io,
    os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd},
    path::PathBuf,
    process::{Child, Command, Stdio},
};

use proxy_agent::dataplane::ebpf::batch::sys_bpf;

const BPF_PROG_GET_NEXT_ID: libc::c_long = 11;
const BPF_PROG_GET_FD_BY_ID: libc::c_long = 13;
const BPF_OBJ_GET_INFO_BY_FD: libc::c_long = 15;
const BPF_BTF_GET_FD_BY_ID: libc::c_long = 19;

/// The kernel function that runs a program for BPF_PROG_TEST_RUN: samples with it on their
/// stack are the measured path's.
const TEST_RUN: &str = "bpf_test_run";

/// One sample: its frames, innermost first (instruction address, perf's symbol).
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    pub pid: u32,
    pub frames: Vec<(u64, String)>,
}

/// Parses `perf script -F pid,ip,sym` of a recording with call chains: a line ending with the
/// pid, then one line per frame, a blank line between samples.
pub fn parse_script(text: &str) -> Vec<Sample> {
    let mut out = Vec::new();
    let mut cur: Option<Sample> = None;
    for line in text.lines() {
        if line.trim().is_empty() {
            out.extend(cur.take());
            continue;
        }
        if line.starts_with(char::is_whitespace) && cur.is_some() {
            let mut parts = line.split_whitespace();
            let (Some(ip), sym) = (parts.next().and_then(|ip| u64::from_str_radix(ip, 16).ok()), parts.next()) else { continue };
            if let Some(s) = cur.as_mut() {
                s.frames.push((ip, sym.unwrap_or("[unknown]").to_string()));
            }
        } else {
            out.extend(cur.take());
            if let Some(pid) = line.split_whitespace().last().and_then(|p| p.parse().ok()) {
                cur = Some(Sample { pid, frames: Vec::new() });
            }
        }
    }
    out.extend(cur);
    out
}

/// A loaded program's JIT image and the source line of each of its stretches.
#[derive(Debug, Clone, Default)]
pub struct Program {
    pub name: String,
    /// Each function's start and length in the JIT image.
    pub funcs: Vec<(u64, u32)>,
    /// JIT address where a line's code starts, sorted: (address, "file:line  source").
    pub lines: Vec<(u64, String)>,
}

impl Program {
    pub fn contains(&self, ip: u64) -> bool {
        self.funcs.iter().any(|&(start, len)| ip >= start && ip < start + u64::from(len))
    }

    /// The source line whose code holds `ip`.
    pub fn line_of(&self, ip: u64) -> Option<&str> {
        let i = self.lines.partition_point(|(a, _)| *a <= ip);
        i.checked_sub(1).map(|i| self.lines[i].1.as_str())
    }
}

/// How the samples of a test-run split.
#[derive(Debug, Default)]
pub struct Breakdown {
    /// Samples of this process inside a test run.
    pub total: u64,
    /// In the programs' own instructions, by source line (or program name without line info).
    pub own: HashMap<String, u64>,
    /// In a kernel function the programs called, by that function (a map update, a lookup, a
    /// helper), and within it by the function the sample landed in.
    pub called: HashMap<String, (u64, HashMap<String, u64>)>,
    /// Outside any program: the test run's own work (its clock reads, the context set up).
    pub around: u64,
}

/// Splits the samples of `pid` taken inside a test run (`TEST_RUN` on their stack). A frame is
/// a program's when one of `programs` holds its address, or perf named it `bpf_prog_*`.
pub fn attribute(samples: &[Sample], pid: u32, programs: &[Program]) -> Breakdown {
    let mut b = Breakdown::default();
    let is_prog = |ip: u64, sym: &str| sym.starts_with("bpf_prog_") || programs.iter().any(|p| p.contains(ip));
    for s in samples.iter().filter(|s| s.pid == pid) {
        let Some(run) = s.frames.iter().position(|(_, sym)| sym == TEST_RUN) else { continue };
        b.total += 1;
        let inner = &s.frames[..run];
        // The innermost program frame: what ran in the program, or what it called.
        match inner.iter().position(|(ip, sym)| is_prog(*ip, sym)) {
            None => b.around += 1,
            Some(0) => {
                let (ip, sym) = &inner[0];
                let at = programs
                    .iter()
                    .find(|p| p.contains(*ip))
                    .map_or_else(|| sym.clone(), |p| p.line_of(*ip).map_or_else(|| p.name.clone(), str::to_string));
                *b.own.entry(at).or_default() += 1;
            }
            Some(k) => {
                let e = b.called.entry(inner[k - 1].1.clone()).or_default();
                e.0 += 1;
                *e.1.entry(inner[0].1.clone()).or_default() += 1;
            }
        }
    }
    b
}

impl Breakdown {
    /// The table `profile --where` prints: shares of the test run's samples.
    pub fn render(&self, top: usize) -> String {
        use std::fmt::Write;
        let pct = |n: u64| 100.0 * n as f64 / self.total.max(1) as f64;
        let sorted = |m: &HashMap<String, u64>| {
            let mut v: Vec<(String, u64)> = m.iter().map(|(k, v)| (k.clone(), *v)).collect();
            v.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
            v
        };
        let own: u64 = self.own.values().sum();
        let called: u64 = self.called.values().map(|c| c.0).sum();
        let mut s = String::new();
        let _ = writeln!(s, "samples inside the test runs: {}", self.total);
        let _ = writeln!(s, "{:5.1} %  the programs' own instructions", pct(own));
        let _ = writeln!(s, "{:5.1} %  kernel functions the programs call", pct(called));
        let _ = writeln!(s, "{:5.1} %  the test run around the programs (as for the empty program)", pct(self.around));
        let _ = writeln!(s, "\ncalled by the programs (and where inside them):");
        let mut calls: Vec<_> = self.called.iter().collect();
        calls.sort_by(|a, b| b.1 .0.cmp(&a.1 .0).then_with(|| a.0.cmp(b.0)));
        for (f, (n, leaves)) in calls.into_iter().take(top) {
            let inside: Vec<String> = sorted(leaves).into_iter().take(4).map(|(l, m)| format!("{l} {:.1} %", pct(m))).collect();
            let _ = writeln!(s, "{:5.1} %  {f}  [{}]", pct(*n), inside.join(", "));
        }
        let _ = writeln!(s, "\nthe programs' own instructions by source line:");
        for (line, n) in sorted(&self.own).into_iter().take(top) {
            let _ = writeln!(s, "{:5.1} %  {line}", pct(n));
        }
        s
    }
}

/// A `perf record -a -g` running until `finish`.
pub struct Recording {
    child: Child,
    file: PathBuf,
}

impl Recording {
    /// Starts perf on the whole machine (a program's test run is sampled on the calling
    /// thread, whichever it is), and waits until it samples.
    pub fn start() -> io::Result<Self> {
        let file = std::env::temp_dir().join(format!("proxy-bench-where-{}.data", std::process::id()));
        let child = Command::new("perf")
            .args(["record", "-a", "-g", "--quiet", "-o"])
            .arg(&file)
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .map_err(|e| io::Error::new(e.kind(), format!("starting perf (Debian's linux-perf; `cargo xtask setup`): {e}")))?;
        std::thread::sleep(std::time::Duration::from_millis(700));
        Ok(Self { child, file })
    }

    /// Stops perf and splits this process's samples, with the programs loaded now (call it
    /// while the measured programs are).
    pub fn finish(mut self) -> io::Result<Breakdown> {
        let programs = loaded_programs()?;
        // SAFETY: plain signal to our own child, not yet waited for.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGINT) };
        let status = self.child.wait()?;
        let interrupted = status.code() == Some(130) || std::os::unix::process::ExitStatusExt::signal(&status) == Some(libc::SIGINT);
        if !status.success() && !interrupted {
            return Err(io::Error::other(format!("perf record ended with {status}")));
        }
        let out = Command::new("perf").args(["script", "-F", "pid,ip,sym", "-i"]).arg(&self.file).stderr(Stdio::null()).output()?;
        let _ = std::fs::remove_file(&self.file);
        let samples = parse_script(&String::from_utf8_lossy(&out.stdout));
        Ok(attribute(&samples, std::process::id(), &programs))
    }
}

impl Drop for Recording {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_file(&self.file);
    }
}

/// `struct bpf_prog_info`, up to the fields read here.
#[repr(C)]
#[derive(Default)]
struct ProgInfo {
    prog_type: u32,
    id: u32,
    tag: [u8; 8],
    jited_prog_len: u32,
    xlated_prog_len: u32,
    jited_prog_insns: u64,
    xlated_prog_insns: u64,
    load_time: u64,
    created_by_uid: u32,
    nr_map_ids: u32,
    map_ids: u64,
    name: [u8; 16],
    ifindex: u32,
    gpl_compatible: u32,
    netns_dev: u64,
    netns_ino: u64,
    nr_jited_ksyms: u32,
    nr_jited_func_lens: u32,
    jited_ksyms: u64,
    jited_func_lens: u64,
    btf_id: u32,
    func_info_rec_size: u32,
    func_info: u64,
    nr_func_info: u32,
    nr_line_info: u32,
    line_info: u64,
    jited_line_info: u64,
    nr_jited_line_info: u32,
    line_info_rec_size: u32,
    jited_line_info_rec_size: u32,
    // Named rather than left as padding, which the kernel would read as a count.
    nr_prog_tags: u32,
}

/// `struct bpf_line_info`.
#[repr(C)]
#[derive(Default, Clone, Copy)]
struct LineInfo {
    insn_off: u32,
    file_name_off: u32,
    line_off: u32,
    line_col: u32,
}

#[repr(C)]
#[derive(Default)]
struct InfoAttr {
    fd: u32,
    info_len: u32,
    info: u64,
}

#[repr(C)]
#[derive(Default)]
struct IdAttr {
    id: u32,
    next_id: u32,
    open_flags: u32,
}

/// `struct bpf_btf_info`.
#[repr(C)]
#[derive(Default)]
struct BtfInfo {
    btf: u64,
    btf_size: u32,
    id: u32,
    name: u64,
    name_len: u32,
    kernel_btf: u32,
}

fn info<T>(fd: BorrowedFd<'_>, info: &mut T) -> io::Result<()> {
    let mut attr = InfoAttr { fd: fd.as_raw_fd() as u32, info_len: size_of::<T>() as u32, info: info as *mut T as u64 };
    sys_bpf(BPF_OBJ_GET_INFO_BY_FD, &mut attr).map(|_| ())
}

fn fd_by_id(cmd: libc::c_long, id: u32) -> io::Result<OwnedFd> {
    let mut attr = IdAttr { id, ..Default::default() };
    // SAFETY: the syscall returned a new descriptor, owned from here.
    sys_bpf(cmd, &mut attr).map(|fd| unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

/// Every program loaded on the machine, with its JIT line info where it has some.
pub fn loaded_programs() -> io::Result<Vec<Program>> {
    let mut out = Vec::new();
    let mut attr = IdAttr::default();
    while sys_bpf(BPF_PROG_GET_NEXT_ID, &mut attr).is_ok() {
        attr.id = attr.next_id;
        // A program unloaded in between is skipped.
        if let Ok(fd) = fd_by_id(BPF_PROG_GET_FD_BY_ID, attr.id) {
            if let Ok(p) = program(fd.as_fd()) {
                out.push(p);
            }
        }
    }
    Ok(out)
}

/// One program's functions and the source line of each stretch of its JIT image.
pub fn program(fd: BorrowedFd<'_>) -> io::Result<Program> {
    let mut first = ProgInfo::default();
    info(fd, &mut first)?;
    let name = String::from_utf8_lossy(&first.name).trim_end_matches('\0').to_string();
    let (nk, nf, nl, nj) = (first.nr_jited_ksyms, first.nr_jited_func_lens, first.nr_line_info, first.nr_jited_line_info);
    let mut ksyms = vec![0u64; nk as usize];
    let mut lens = vec![0u32; nf as usize];
    let mut lines = vec![LineInfo::default(); nl as usize];
    let mut jited = vec![0u64; nj as usize];
    let mut second = ProgInfo {
        nr_jited_ksyms: nk,
        jited_ksyms: ksyms.as_mut_ptr() as u64,
        nr_jited_func_lens: nf,
        jited_func_lens: lens.as_mut_ptr() as u64,
        nr_line_info: nl,
        line_info: lines.as_mut_ptr() as u64,
        line_info_rec_size: size_of::<LineInfo>() as u32,
        nr_jited_line_info: nj,
        jited_line_info: jited.as_mut_ptr() as u64,
        jited_line_info_rec_size: size_of::<u64>() as u32,
        ..Default::default()
    };
    info(fd, &mut second)?;
    let funcs = ksyms.iter().copied().zip(lens.iter().copied()).collect();
    let strings = if first.btf_id != 0 && nl > 0 && nl == nj { btf_strings(first.btf_id).unwrap_or_default() } else { Vec::new() };
    let text = |off: u32| -> String {
        let s = strings.get(off as usize..).unwrap_or_default();
        String::from_utf8_lossy(&s[..s.iter().position(|b| *b == 0).unwrap_or(s.len())]).into_owned()
    };
    let raw: Vec<SourceLine> = if strings.is_empty() {
        Vec::new()
    } else {
        jited
            .iter()
            .zip(&lines)
            .map(|(addr, l)| SourceLine { addr: *addr, path: text(l.file_name_off), line: l.line_col >> 10, source: text(l.line_off) })
            .collect()
    };
    let with_lines = label_lines(raw);
    Ok(Program { name, funcs, lines: with_lines })
}

/// A stretch of a program's JIT image and the source line it came from.
pub struct SourceLine {
    pub addr: u64,
    pub path: String,
    pub line: u32,
    pub source: String,
}

/// Whether a source file is the datapath's own (not the toolchain's or a library's).
fn ours(path: &str) -> bool {
    path.contains("proxy-ebpf/") || path.contains("proxy-common/")
}

/// Labels `file:line  source`, sorted by address. A library's line (an inlined helper call,
/// whose map lookups the verifier inlines, or an integer method) says which of the datapath's
/// lines it follows, the nearest before it in the image: `helpers.rs:10` alone would put every
/// lookup of the program on one line.
pub fn label_lines(mut raw: Vec<SourceLine>) -> Vec<(u64, String)> {
    raw.sort_by_key(|l| l.addr);
    let base = |l: &SourceLine| format!("{}:{}", l.path.rsplit('/').next().unwrap_or_default(), l.line);
    let mut last_ours: Option<String> = None;
    raw.iter()
        .map(|l| {
            let label = format!("{}  {}", base(l), l.source.trim());
            if ours(&l.path) {
                last_ours = Some(base(l));
                (l.addr, label)
            } else {
                (l.addr, last_ours.as_ref().map_or_else(|| label.clone(), |o| format!("{label}  (after {o})")))
            }
        })
        .collect()
}

/// The string section of BTF object `id` (what line info's offsets point into).
fn btf_strings(id: u32) -> io::Result<Vec<u8>> {
    let fd = fd_by_id(BPF_BTF_GET_FD_BY_ID, id)?;
    let mut first = BtfInfo::default();
    info(fd.as_fd(), &mut first)?;
    let mut buf = vec![0u8; first.btf_size as usize];
    let mut second = BtfInfo { btf: buf.as_mut_ptr() as u64, btf_size: first.btf_size, ..Default::default() };
    info(fd.as_fd(), &mut second)?;
    btf_string_section(&buf).map(<[u8]>::to_vec).ok_or_else(|| io::Error::other("BTF without a string section"))
}

/// The string section of raw BTF: its header's `hdr_len`, `str_off` and `str_len`.
pub fn btf_string_section(btf: &[u8]) -> Option<&[u8]> {
    let u32_at = |o: usize| Some(u32::from_ne_bytes(btf.get(o..o + 4)?.try_into().ok()?) as usize);
    if btf.get(..2)? != 0xeb9f_u16.to_ne_bytes() {
        return None;
    }
    let (hdr_len, str_off, str_len) = (u32_at(4)?, u32_at(16)?, u32_at(20)?);
    btf.get(hdr_len + str_off..hdr_len + str_off + str_len)
}

#[cfg(test)]
mod tests {
    use super::*;

    const SCRIPT: &str = "\
proxy-bench  4242
\tffffffffa0001010 bpf_prog_0123456789abcdef_from_pod
\tffffffff81000100 bpf_test_run
\tffffffff81000200 bpf_prog_test_run_skb

  4242
\tffffffff81500071 htab_lru_map_update_elem
\tffffffffa0001080 bpf_prog_0123456789abcdef_from_pod
\tffffffff81000100 bpf_test_run

4242
\tffffffff81525250 bpf_lru_pop_free
\tffffffff81525100 prealloc_lru_pop
\tffffffff81500060 htab_lru_map_update_elem
\tffffffffa0001080 bpf_prog_0123456789abcdef_from_pod
\tffffffff81000100 bpf_test_run

4242
\tffffffff81000400 read_tsc
\tffffffff81000100 bpf_test_run

4242
\tffffffff81000400 htab_map_lookup_and_delete_batch
\tffffffff81000500 __sys_bpf

77
\tffffffffa0001010 bpf_prog_0123456789abcdef_from_pod
\tffffffff81000100 bpf_test_run
";

    #[test]
    fn a_script_parses_into_samples_with_their_frames() {
        let s = parse_script(SCRIPT);
        assert_eq!(s.len(), 6);
        assert_eq!(s[0].pid, 4242);
        assert_eq!(s[0].frames[0], (0xffff_ffff_a000_1010, "bpf_prog_0123456789abcdef_from_pod".to_string()));
        assert_eq!(s[2].frames.len(), 5);
        assert_eq!(s[5].pid, 77);
    }

    #[test]
    fn samples_split_between_own_lines_calls_and_the_test_run() {
        let prog = Program {
            name: "from_pod".into(),
            funcs: vec![(0xffff_ffff_a000_1000, 0x100)],
            lines: vec![(0xffff_ffff_a000_1000, "ct.rs:10  a".into()), (0xffff_ffff_a000_1040, "ct.rs:20  b".into())],
        };
        let b = attribute(&parse_script(SCRIPT), 4242, &[prog]);
        // The other process's sample and the one outside a test run are not counted.
        assert_eq!(b.total, 4);
        assert_eq!(b.own.get("ct.rs:10  a"), Some(&1));
        assert_eq!(b.around, 1);
        let (n, inside) = &b.called["htab_lru_map_update_elem"];
        assert_eq!(*n, 2);
        assert_eq!(inside.get("bpf_lru_pop_free"), Some(&1));
        assert_eq!(inside.get("htab_lru_map_update_elem"), Some(&1));
        let table = b.render(5);
        assert!(table.contains(" 50.0 %  kernel functions the programs call"), "{table}");
        assert!(table.contains(" 25.0 %  ct.rs:10  a"), "{table}");
    }

    #[test]
    fn without_line_info_a_programs_samples_go_under_its_name() {
        let b = attribute(&parse_script(SCRIPT), 4242, &[]);
        assert_eq!(b.own.get("bpf_prog_0123456789abcdef_from_pod"), Some(&1));
        assert_eq!(b.called["htab_lru_map_update_elem"].0, 2);
    }

    #[test]
    fn a_librarys_line_names_the_datapaths_line_before_it() {
        let l = |addr, path: &str, line, source: &str| SourceLine { addr, path: path.into(), line, source: source.into() };
        let labels = label_lines(vec![
            l(30, "/work/main/proxy-ebpf/src/ct.rs", 81, " if *w & bit == 0 { "),
            l(10, "/rustc/abc/library/core/src/num/mod.rs", 5, "x"),
            l(40, "/root/.cargo/registry/src/aya-ebpf-0.2.1/src/helpers.rs", 10, "fun(map, key)"),
            l(20, "/work/main/proxy-common/src/lib.rs", 798, "let bit = 1;"),
        ]);
        assert_eq!(
            labels,
            vec![
                (10, "mod.rs:5  x".to_string()),
                (20, "lib.rs:798  let bit = 1;".to_string()),
                (30, "ct.rs:81  if *w & bit == 0 {".to_string()),
                (40, "helpers.rs:10  fun(map, key)  (after ct.rs:81)".to_string()),
            ]
        );
    }

    #[test]
    fn btf_strings_are_found_by_the_header() {
        let mut btf = vec![0u8; 24];
        btf[..2].copy_from_slice(&0xeb9f_u16.to_ne_bytes());
        btf[4..8].copy_from_slice(&24u32.to_ne_bytes());
        btf[16..20].copy_from_slice(&0u32.to_ne_bytes());
        btf[20..24].copy_from_slice(&6u32.to_ne_bytes());
        btf.extend_from_slice(b"\0ct.rs");
        assert_eq!(btf_string_section(&btf), Some(&b"\0ct.rs"[..]));
        assert_eq!(btf_string_section(&btf[..10]), None);
        btf[0] = 0;
        assert_eq!(btf_string_section(&btf), None);
    }
}
