//! Runs the conformance suite (tests/src/conformance.rs) for one proxy mode and reports each
//! scenario: how the IPVS run happens inside a qemu guest whose kernel has IPVS.
//!
//! Usage: proxy-conformance --mode MODE --agent PATH [SCENARIO...]

use std::{panic, path::PathBuf, process::ExitCode, time::Instant};

use proxy_agent::dataplane::ProxyMode;
use proxy_tests::conformance::SCENARIOS;

fn main() -> ExitCode {
    // Ctrl-C: the labs' namespaces, pins and agents go too.
    proxy_tests::interrupt::clean_up_on_signals();
    let args: Vec<String> = std::env::args().skip(1).collect();
    let value = |flag: &str| args.iter().position(|a| a == flag).and_then(|i| args.get(i + 1)).cloned();
    let Some(mode) = value("--mode").and_then(|m| m.parse::<ProxyMode>().ok()) else {
        eprintln!("usage: proxy-conformance --mode ebpf|iptables|ipvs|nftables --agent PATH [SCENARIO...]");
        return ExitCode::from(2);
    };
    let agent = PathBuf::from(value("--agent").unwrap_or_else(|| proxy_tests::lab::sibling("proxy-lab-agent").display().to_string()));
    let wanted: Vec<&String> = args
        .iter()
        .filter(|a| !a.starts_with("--") && Some(*a) != value("--mode").as_ref() && Some(a.as_str()) != value("--agent").as_deref())
        .collect();
    let mut failed = Vec::new();
    for (name, scenario) in SCENARIOS {
        if !wanted.is_empty() && !wanted.iter().any(|w| *w == name) {
            continue;
        }
        let start = Instant::now();
        let result = panic::catch_unwind(|| scenario(&agent, mode));
        let secs = start.elapsed().as_secs_f64();
        match result {
            Ok(()) => println!("PASS {name} ({mode}, {secs:.1} s)"),
            Err(e) => {
                let msg =
                    e.downcast_ref::<String>().cloned().or_else(|| e.downcast_ref::<&str>().map(|s| s.to_string())).unwrap_or_default();
                println!("FAIL {name} ({mode}, {secs:.1} s): {msg}");
                failed.push(*name);
            }
        }
    }
    if failed.is_empty() {
        println!("CONFORMANCE-OK {mode}");
        ExitCode::SUCCESS
    } else {
        println!("CONFORMANCE-FAILED {mode}: {}", failed.join(", "));
        ExitCode::FAILURE
    }
}
