//! Helpers every command shares: durations on the command line and graceful shutdown.

use std::time::Duration;

use anyhow::Context;

/// Parses `500ms`, `30s`, `5m`, `1h`, `7d`, or a bare number of seconds: the one duration syntax
/// of every flag.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let split = s
        .find(|c: char| !c.is_ascii_digit() && c != '.')
        .unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let n: f64 = num
        .parse()
        .map_err(|_| format!("invalid duration {s:?}: expected e.g. 500ms, 30s, 5m, 1h, 7d"))?;
    let secs = match unit {
        "ms" => n / 1000.0,
        "" | "s" => n,
        "m" => n * 60.0,
        "h" => n * 3600.0,
        "d" => n * 86_400.0,
        _ => {
            return Err(format!(
                "invalid duration unit in {s:?}: use ms, s, m, h or d"
            ));
        }
    };
    Duration::try_from_secs_f64(secs).map_err(|e| format!("invalid duration {s:?}: {e}"))
}

/// `d` as [`parse_duration`] reads it, in the largest unit that divides it (`500ms`, `60s`,
/// `1h`, `7d`): how a flag shows a library default in `--help`.
pub fn duration_text(d: Duration) -> String {
    let ms = d.as_millis();
    let secs = d.as_secs();
    if d.subsec_nanos() != 0 || secs == 0 {
        return format!("{ms}ms");
    }
    for (unit, size) in [("d", 86_400), ("h", 3600), ("m", 60)] {
        if secs.is_multiple_of(size) {
            return format!("{}{unit}", secs / size);
        }
    }
    format!("{secs}s")
}

/// Installs the SIGTERM and SIGINT handlers now and returns a future that resolves on either.
pub fn shutdown_signal() -> anyhow::Result<impl std::future::Future<Output = ()>> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate()).context("installing the SIGTERM handler")?;
    let mut int = signal(SignalKind::interrupt()).context("installing the SIGINT handler")?;
    Ok(async move {
        tokio::select! {
            _ = term.recv() => tracing::info!("SIGTERM: finishing in-flight work, then stopping"),
            _ = int.recv() => tracing::info!("SIGINT: finishing in-flight work, then stopping"),
        }
    })
}

#[cfg(test)]
mod tests {
    use super::{duration_text, parse_duration};
    use std::time::Duration;

    #[test]
    fn a_duration_is_written_in_its_largest_unit_and_reads_back() {
        for (d, text) in [
            (Duration::from_millis(500), "500ms"),
            (Duration::from_millis(2), "2ms"),
            (Duration::from_secs(60), "1m"),
            (Duration::from_secs(90), "90s"),
            (Duration::from_secs(3600), "1h"),
            (Duration::from_secs(14 * 86_400), "14d"),
            (Duration::from_millis(1500), "1500ms"),
            (Duration::ZERO, "0ms"),
        ] {
            assert_eq!(duration_text(d), text);
            assert_eq!(parse_duration(text), Ok(d), "{text}");
        }
    }

    #[test]
    fn durations() {
        assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_duration("2"), Ok(Duration::from_secs(2)));
        assert_eq!(parse_duration("5m"), Ok(Duration::from_secs(300)));
        assert_eq!(parse_duration("7d"), Ok(Duration::from_secs(7 * 86_400)));
        assert_eq!(parse_duration("168h"), parse_duration("7d"));
        assert!(parse_duration("xd").is_err());
        assert!(parse_duration("5 parsecs").is_err());
        assert!(parse_duration("-1s").is_err());
    }
}
