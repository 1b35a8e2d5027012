//! Test support for idem, not shipped: backend-agnostic store scenarios that run once per
//! database ([`scenarios`], one file per store concern, stamped into tests by
//! [`conformance_tests!`]), throwaway PostgreSQL databases ([`pg`]) and Apache Kafka brokers
//! ([`kafka`]), an OAuth 2 identity provider for OAUTHBEARER ([`oidc`]), records to hand a
//! consumer ([`records`]), loopback ports outside the ephemeral range ([`ports`]).
// Fixtures that own processes, pools and temporary directories; none is printed.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    missing_docs,
    missing_debug_implementations
)]

pub mod backend;
pub mod kafka;
pub mod oidc;
pub mod pg;
pub mod ports;
pub mod private_pg;
pub mod process;
pub mod records;
pub mod scenarios;
