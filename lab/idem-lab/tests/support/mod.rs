//! What several test binaries of the lab share.

pub(crate) mod browser;
pub(crate) mod controls;
