//! Durations as Go writes and reads them (`time.ParseDuration`): `30s`, `1m0s`, `24h0m0s`,
//! `1.5h`, `100ms`, `0s`, `0`. kube-proxy's flags and configuration file use them.

use std::time::Duration;

/// The longest duration Go has: `i64::MAX` nanoseconds, in seconds.
const GO_MAX_SECS: f64 = i64::MAX as f64 / 1e9;

/// Parses a Go duration. Negative durations are refused (nothing here is a negative time).
pub fn parse(s: &str) -> Result<Duration, String> {
    let bad = |why: &str| format!("{s:?} is not a duration ({why}; e.g. 30s, 1m0s, 24h, 250ms)");
    let t = s.trim();
    if t == "0" {
        return Ok(Duration::ZERO);
    }
    if t.starts_with('-') {
        return Err(bad("negative"));
    }
    let mut rest = t.strip_prefix('+').unwrap_or(t);
    if rest.is_empty() {
        return Err(bad("empty"));
    }
    let mut total = 0f64;
    while !rest.is_empty() {
        let num_end = rest.find(|c: char| !c.is_ascii_digit() && c != '.').unwrap_or(rest.len());
        let (num, after) = rest.split_at(num_end);
        if num.is_empty() || num == "." {
            return Err(bad("a number must come before each unit"));
        }
        let n: f64 = num.parse().map_err(|_| bad("malformed number"))?;
        let unit_end = after.find(|c: char| c.is_ascii_digit() || c == '.').unwrap_or(after.len());
        let (unit, next) = after.split_at(unit_end);
        let scale = match unit {
            "h" => 3600.0,
            "m" => 60.0,
            "s" => 1.0,
            "ms" => 1e-3,
            "us" | "µs" | "μs" => 1e-6,
            "ns" => 1e-9,
            "" => return Err(bad("missing unit")),
            _ => return Err(bad(&format!("unknown unit {unit:?}"))),
        };
        total += n * scale;
        rest = next;
    }
    // Go's limit (an int64 of nanoseconds, about 292 years): beyond it `time.ParseDuration`
    // fails too. (A u64 of seconds was no bound: 2^64 s made `from_secs_f64` panic, and the
    // agent's `Instant` sums overflowed on much less.)
    if !total.is_finite() || total > GO_MAX_SECS {
        return Err(bad("over Go's limit of about 292 years"));
    }
    Ok(Duration::from_secs_f64(total))
}

/// Writes a duration the way Go prints it (`1h30m0s`, `250ms`, `0s`).
pub fn format(d: Duration) -> String {
    if d.is_zero() {
        return "0s".into();
    }
    if d < Duration::from_secs(1) {
        let ns = d.as_nanos();
        return if ns.is_multiple_of(1_000_000) {
            format!("{}ms", ns / 1_000_000)
        } else if ns.is_multiple_of(1000) {
            format!("{}µs", ns / 1000)
        } else {
            format!("{ns}ns")
        };
    }
    let secs = d.as_secs();
    let (h, m, s) = (secs / 3600, secs / 60 % 60, secs % 60);
    let frac = d.subsec_nanos();
    let s = if frac == 0 { s.to_string() } else { format!("{s}.{}", format!("{frac:09}").trim_end_matches('0')) };
    match (h, m) {
        (0, 0) => format!("{s}s"),
        (0, m) => format!("{m}m{s}s"),
        (h, m) => format!("{h}h{m}m{s}s"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn go_durations_parse() {
        let secs = Duration::from_secs;
        assert_eq!(parse("30s"), Ok(secs(30)));
        assert_eq!(parse("1m0s"), Ok(secs(60)));
        assert_eq!(parse("24h0m0s"), Ok(secs(86400)));
        assert_eq!(parse("1h30m"), Ok(secs(5400)));
        assert_eq!(parse("1.5h"), Ok(secs(5400)));
        assert_eq!(parse("250ms"), Ok(Duration::from_millis(250)));
        assert_eq!(parse("0s"), Ok(Duration::ZERO));
        assert_eq!(parse("0"), Ok(Duration::ZERO));
        assert_eq!(parse("2us"), Ok(Duration::from_micros(2)));
        for bad in ["30", "5d", "", "-1s", "s", "1.2.3s", "1h x"] {
            assert!(parse(bad).is_err(), "{bad:?} must be refused");
        }
        assert!(parse("5d").unwrap_err().contains("unknown unit"));
        // Go's longest duration, 2562047h47m16.854775807s, and past it (2^64 s made
        // `from_secs_f64` panic; 10^19 s overflowed the agent's timers).
        assert_eq!(parse("2562047h"), Ok(secs(2_562_047 * 3600)));
        let endless = format!("1{}s", "0".repeat(400));
        for over in ["2562048h", "10000000000000000000s", "18446744073709551615s", &endless] {
            assert!(parse(over).is_err_and(|e| e.contains("292 years")), "{over:?} must be refused");
        }
    }

    #[test]
    fn durations_print_as_go_prints_them() {
        assert_eq!(format(Duration::from_secs(86400)), "24h0m0s");
        assert_eq!(format(Duration::from_secs(90)), "1m30s");
        assert_eq!(format(Duration::from_millis(1500)), "1.5s");
        assert_eq!(format(Duration::from_millis(250)), "250ms");
        assert_eq!(format(Duration::ZERO), "0s");
        for d in ["24h0m0s", "1m30s", "250ms", "1.5s"] {
            assert_eq!(format(parse(d).unwrap()), d);
        }
    }
}
