//! The repository the docs and tidy tests read.

use std::path::{Path, PathBuf};

/// The repository's root (the folder holding `Cargo.lock`).
pub(crate) fn root() -> PathBuf {
    let here = Path::new(env!("CARGO_MANIFEST_DIR"));
    here.ancestors()
        .find(|p| p.join("Cargo.lock").is_file())
        .map_or_else(|| here.to_owned(), Path::to_owned)
}
