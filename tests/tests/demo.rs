//! The demo (`cargo xtask run`) end to end, in its one-round mode.

use std::process::Command;

use proxy_tests::require;

#[test]
fn the_demo_shows_balancing_udp_and_rejection_then_cleans_up() {
    if !require::root("the_demo_shows_balancing_udp_and_rejection_then_cleans_up") {
        return;
    }
    let out = Command::new(env!("CARGO_BIN_EXE_proxy-demo")).arg("--once").output().expect("run the demo");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "demo failed:\n{text}\n{}", String::from_utf8_lossy(&out.stderr));
    for want in ["spread: backend-", "reply from 10.96.0.53:53", "Connection refused", "default/web:http", "Lab removed"] {
        assert!(text.contains(want), "demo output lacks {want:?}:\n{text}");
    }
    // Twelve random picks over three backends miss one 2% of the time; the lab tests check the
    // spread with a hundred connections. Here: more than one backend, and all three programmed.
    let spread = text.lines().find(|l| l.contains("spread:")).unwrap();
    assert!(spread.matches("backend-").count() >= 2, "one backend took all 12 requests: {spread}");
    assert_eq!(text.matches("-> 10.244.1.").count(), 6, "3 web + 3 dns backends programmed:\n{text}");
    let id = text.lines().find_map(|l| l.strip_prefix("Lab ")).and_then(|l| l.strip_suffix(':')).expect("lab id line");
    let netns = String::from_utf8_lossy(&Command::new("ip").args(["netns", "list"]).output().unwrap().stdout).into_owned();
    assert!(!netns.contains(id), "the demo left namespaces behind:\n{netns}");
}
