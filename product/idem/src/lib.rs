#![doc = include_str!("../../../README.md")]
//!
//! # The facade
//!
//! `idem` is the one dependency a user needs (and `sqlx` for one's own queries). Each stage is
//! a Cargo feature and a module:
//!
//! | feature | module | what |
//! |---|---|---|
//! | `postgres` (default) | [`postgres`] | the PostgreSQL stores |
//! | `sqlite` (default) | [`sqlite`] | the SQLite stores |
//! | `relay` | `relay` | outbox rows to a broker |
//! | `consumer` | `consumer` | the consumer runtime: inbox, [`Handler`](consumer::Handler)s, dead letters |
//! | `kafka` | `kafka` | the Kafka source and publisher, the embedded mock cluster |
//! | `http` | `http` | the server-side `Idempotency-Key` layer (axum) |
//! | `effects` | `effects` | recording effect intents in a handler, the dispatcher |
//! | `verify` | `verify` | reconciliation |
//! | `full` | | all of them |
//!
//! [`prelude`] holds what a handler is written with. The root holds the types every stage
//! shares: the [`Event`] a writer enqueues, the [`InboundEvent`] a handler reads, the
//! [`Error`] every call returns, and the [`TableNames`] of idem's tables. [`store`] and
//! [`publish`] hold what a store or a broker client implements (a user reaches their methods
//! through them, `store::OutboxStore::status`); [`trace`] the W3C trace context carried from
//! the writer to the handler.
#![cfg_attr(docsrs, feature(doc_cfg))]

pub use idem_core::{
    BoxError, Error, ErrorKind, Event, EventBuilder, EventId, InboundEvent, Result, TableNames,
};
pub use idem_core::{publish, store, trace};

pub mod prelude;

/// The SQL store, written once over a dialect: [`sql::AnyStore`] opens whichever database a
/// URL names (`postgres://…`, `sqlite://…`) and hands out the relay store, the inbox, the key
/// store, the effect intents and the outbox writer.
#[cfg(any(feature = "postgres", feature = "sqlite"))]
#[cfg_attr(docsrs, doc(cfg(any(feature = "postgres", feature = "sqlite"))))]
pub mod sql {
    pub use idem_sql::*;
}

/// The PostgreSQL stores (production), under their PostgreSQL names (`PgStore`, …).
#[cfg(feature = "postgres")]
#[cfg_attr(docsrs, doc(cfg(feature = "postgres")))]
pub use idem_sql::postgres;

/// The SQLite stores (embedded default).
#[cfg(feature = "sqlite")]
#[cfg_attr(docsrs, doc(cfg(feature = "sqlite")))]
pub use idem_sql::sqlite;

/// The relay: claims outbox rows and publishes them, at least once.
#[cfg(feature = "relay")]
#[cfg_attr(docsrs, doc(cfg(feature = "relay")))]
pub mod relay {
    pub use idem_relay::*;
}

/// The consumer runtime: at-least-once delivery in, the handler's writes applied once (inbox in
/// the handler's transaction, offsets committed after it).
#[cfg(feature = "consumer")]
#[cfg_attr(docsrs, doc(cfg(feature = "consumer")))]
pub mod consumer {
    pub use idem_consumer::*;
    pub use idem_core::InboundEvent;
    pub use idem_core::store::{
        DeadLetter, Dedup, Delivery, InboxEntry, InboxStore, LagProbe, Source,
    };
}

#[cfg(feature = "effects")]
#[cfg_attr(docsrs, doc(cfg(feature = "effects")))]
pub mod effects;

/// Kafka: the source a consumer reads, the publisher a relay writes with, topics, and
/// librdkafka's mock cluster for tests and embedded runs.
#[cfg(feature = "kafka")]
#[cfg_attr(docsrs, doc(cfg(feature = "kafka")))]
pub mod kafka {
    pub use idem_kafka::*;
}

/// The server side of `Idempotency-Key`: an axum layer that executes a keyed request once and
/// replays its response.
#[cfg(feature = "http")]
#[cfg_attr(docsrs, doc(cfg(feature = "http")))]
pub mod http {
    pub use idem_core::idempotency::{
        ClaimToken, IdempotencyKey, IdempotencyStore, KeyClaim, KeyError, StoredResponse,
    };
    pub use idem_http::*;
}

/// Reconciliation: compares the outbox, the inbox and the business tables and names what was
/// lost or applied twice.
#[cfg(feature = "verify")]
#[cfg_attr(docsrs, doc(cfg(feature = "verify")))]
pub mod verify {
    pub use idem_verify::*;
}

/// The operator console: [`console::Console::router`] serves it from a service, `idem console`
/// from the command line.
#[cfg(feature = "console")]
#[cfg_attr(docsrs, doc(cfg(feature = "console")))]
pub mod console {
    pub use idem_console::*;
}

/// Metrics: the registry the stages' metrics are registered into.
#[cfg(any(feature = "relay", feature = "consumer"))]
#[cfg_attr(docsrs, doc(cfg(any(feature = "relay", feature = "consumer"))))]
pub mod metrics {
    pub use prometheus::{Encoder, Registry, TextEncoder};
}

/// The Rust blocks of the integrating guides, compiled (and run unless marked `no_run`) as
/// doc tests of the facade with every feature: a guide's example imports only `idem` (and
/// sqlx, tokio, axum, serde_json), so what it shows is what a user can write.
#[cfg(all(doctest, feature = "full"))]
mod guides {
    #[doc = include_str!("../../../docs/integrating/consumer.md")]
    struct Consumer;
    #[doc = include_str!("../../../docs/integrating/https-remotes.md")]
    struct HttpsRemotes;
    #[doc = include_str!("../../../docs/integrating/idempotency-key.md")]
    struct IdempotencyKey;
    #[doc = include_str!("../../../docs/integrating/outbox-contract.md")]
    struct OutboxContract;
    #[doc = include_str!("../../../docs/integrating/wire-contract.md")]
    struct WireContract;
    #[doc = include_str!("../../../docs/integrating/walkthrough.md")]
    struct Walkthrough;
}
