//! The fault timeline of a run (`faults.log`): one stamped line per fault, window and lock.

use std::path::Path;

/// Appends `what`, stamped with the time, to the fault timeline at `path`.
pub(crate) fn append_timeline(path: &Path, what: &str) {
    let line = format!("{} {what}\n", chrono::Utc::now().format("%H:%M:%S%.3f"));
    let appended = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .and_then(|mut f| std::io::Write::write_all(&mut f, line.as_bytes()));
    if let Err(e) = appended {
        tracing::warn!(error = %e, path = %path.display(), "cannot write the fault timeline");
    }
}
