//! The store conformance suite against SQLite files.

idem_conformance::conformance_tests!(idem_conformance::backend::Lite::new().await);
