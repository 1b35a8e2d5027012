//! The one error type of idem's libraries.

/// A boxed error from a lower layer (database driver, Kafka client, I/O).
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// Result with idem's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// What kind of failure an [`Error`] is: what its caller can do about it ([`Error::kind`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ErrorKind {
    /// The input is wrong (an event, an identifier, a stored row): the same input fails the
    /// same way again.
    Invalid,
    /// The input conflicts with what is stored (an event id already in the outbox).
    Conflict,
    /// The database's schema is not the one this build needs: run `idem migrate`, or upgrade
    /// idem when the schema is newer.
    NotMigrated,
    /// Retrying later may succeed: a connection, a lock, a broker that does not answer.
    Transient,
    /// A setting, or an argument the program passes, is unusable: the configuration or the
    /// program must change. The input (an event) is not at fault, so a consumer keeps it and
    /// retries rather than dead-lettering it.
    Config,
    /// The component's client is broken for good: stop it and start a new one.
    Fatal,
}

/// Everything that can go wrong in idem's libraries.
///
/// Every message names what was wrong and, where there is one, what to do about it;
/// [`Error::kind`] says what a caller can do about it.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// An event failed validation before anything was written.
    #[error("invalid event: {field} {reason}")]
    InvalidEvent {
        /// The envelope field that was rejected (`event_type`, `aggregate_id`, `payload`, ...).
        field: &'static str,
        /// Why it was rejected, with the allowed form.
        reason: String,
    },

    /// The input conflicts with what is stored: an event id already in the outbox.
    #[error("conflict: {what} {reason}")]
    Conflict {
        /// What conflicts (`event_id`).
        what: &'static str,
        /// With what, as the store says it.
        reason: String,
    },

    /// A configured SQL identifier (schema or table prefix) was rejected.
    #[error("invalid SQL identifier {value:?} for {what}: {reason}")]
    InvalidIdentifier {
        /// What the identifier names (`schema`, `table prefix`).
        what: &'static str,
        /// The rejected value.
        value: String,
        /// The rule it broke.
        reason: &'static str,
    },

    /// A configuration value is unusable: the setting must change. Only settings (a URL, a
    /// topic, a file path, a duration) are reported here; what fails at run time has its own
    /// variant.
    #[error("configuration error: {0}")]
    Config(String),

    /// An argument a program passed is unusable (a statement without a placeholder): the
    /// calling code must change. Its kind is [`ErrorKind::Config`]: the event being handled is
    /// not at fault.
    #[error("invalid {argument}: {reason}")]
    InvalidArgument {
        /// Which argument (`business statement`, ...).
        argument: &'static str,
        /// Why it was refused, with the allowed form.
        reason: String,
    },

    /// A component could not be set up: its metrics could not be registered (a registry that
    /// already holds them), its HTTP client could not be built.
    #[error("{what}: {source}")]
    Setup {
        /// What was being set up (`registering relay metrics`, ...).
        what: &'static str,
        /// The library's error.
        #[source]
        source: BoxError,
    },

    /// The database refused or failed an operation.
    #[error("database error while {context}: {source}")]
    Database {
        /// What the error is, as the store that saw it classified it.
        kind: ErrorKind,
        /// What idem was doing (`claiming outbox rows`, `running migration 1`, ...).
        context: String,
        /// The driver's error.
        #[source]
        source: BoxError,
    },

    /// The database holds a schema newer than this build understands.
    #[error(
        "the database schema is at version {found}, newer than the {supported} this idem build knows; \
         upgrade idem before running it against this database"
    )]
    SchemaTooNew {
        /// Version found in the migrations table.
        found: i64,
        /// Highest version this build ships.
        supported: i64,
    },

    /// The database holds an older schema than this build needs (version 0: idem's tables
    /// were never created).
    #[error(
        "the database schema is at version {found}, older than the {needed} this idem build \
         needs; migrate the database first (`idem migrate`, or `idem_sql::migrate`)"
    )]
    SchemaTooOld {
        /// Version found in the migrations table (0 when there is none).
        found: i64,
        /// Highest version this build ships.
        needed: i64,
    },

    /// A row read back from the outbox could not be decoded.
    #[error("outbox row {id} is corrupt: {reason}")]
    CorruptRow {
        /// The row's `id` column.
        id: i64,
        /// What could not be decoded.
        reason: String,
    },

    /// The broker client failed in a way that is not about one message.
    #[error("broker error while {context}: {source}")]
    Broker {
        /// What idem was doing.
        context: String,
        /// The client's error.
        #[source]
        source: BoxError,
    },

    /// The broker client hit a fatal error and can never work again: for example a static group
    /// member fenced by another with the same `group.instance.id`. Retrying with the same
    /// client would idle forever; the process must stop (and be restarted), and a new client
    /// resumes from the committed offsets.
    #[error(
        "fatal broker client error while {context}: {source}; the client cannot recover, so this \
         process stops: restart it (it resumes from the committed offsets), and if another \
         process uses the same group.instance.id, give each one its own"
    )]
    BrokerFatal {
        /// What idem was doing.
        context: String,
        /// The client's error.
        #[source]
        source: BoxError,
    },

    /// A named crash point fired in error mode (in-process fault injection).
    #[error("crash point {} fired", .0.shown())]
    CrashPoint(crate::crash::CrashPoint),
}

impl Error {
    /// Wraps a database driver error with what idem was doing, as a transient failure (a store
    /// that can tell more uses [`Error::database_as`]).
    pub fn database(context: impl Into<String>, source: impl Into<BoxError>) -> Self {
        Error::database_as(ErrorKind::Transient, context, source)
    }

    /// Wraps a database driver error of a known kind with what idem was doing.
    pub fn database_as(
        kind: ErrorKind,
        context: impl Into<String>,
        source: impl Into<BoxError>,
    ) -> Self {
        Error::Database {
            kind,
            context: context.into(),
            source: source.into(),
        }
    }

    /// What kind of failure this is: whether the same call can succeed later
    /// ([`ErrorKind::Transient`]), the input or the configuration must change, the database
    /// needs `idem migrate`, or the component must be replaced.
    pub fn kind(&self) -> ErrorKind {
        match self {
            Error::InvalidEvent { .. }
            | Error::InvalidIdentifier { .. }
            | Error::CorruptRow { .. } => ErrorKind::Invalid,
            Error::Conflict { .. } => ErrorKind::Conflict,
            Error::Config(_) | Error::Setup { .. } | Error::InvalidArgument { .. } => {
                ErrorKind::Config
            }
            Error::Database { kind, .. } => *kind,
            Error::SchemaTooNew { .. } | Error::SchemaTooOld { .. } => ErrorKind::NotMigrated,
            // A crash point in error mode stands for a failure at that point, which is retried.
            Error::Broker { .. } | Error::CrashPoint(_) => ErrorKind::Transient,
            Error::BrokerFatal { .. } => ErrorKind::Fatal,
        }
    }

    /// Whether retrying later may succeed ([`ErrorKind::Transient`]).
    pub fn is_transient(&self) -> bool {
        self.kind() == ErrorKind::Transient
    }

    /// Wraps a broker client error with what idem was doing.
    pub fn broker(context: impl Into<String>, source: impl Into<BoxError>) -> Self {
        Error::Broker {
            context: context.into(),
            source: source.into(),
        }
    }

    /// Wraps a broker client's fatal error ([`Error::BrokerFatal`]) with what idem was doing.
    pub fn broker_fatal(context: impl Into<String>, source: impl Into<BoxError>) -> Self {
        Error::BrokerFatal {
            context: context.into(),
            source: source.into(),
        }
    }

    /// Whether retrying cannot help because the component's client is broken for good
    /// ([`Error::BrokerFatal`]): its owner must stop and be replaced.
    pub fn is_fatal(&self) -> bool {
        self.kind() == ErrorKind::Fatal
    }

    /// Wraps a failure to set a component up (its metrics, its client) with what was being set
    /// up.
    pub fn setup(what: &'static str, source: impl Into<BoxError>) -> Self {
        Error::Setup {
            what,
            source: source.into(),
        }
    }

    pub(crate) fn invalid(field: &'static str, reason: impl Into<String>) -> Self {
        Error::InvalidEvent {
            field,
            reason: reason.into(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_error_has_the_kind_its_caller_acts_on() {
        let io = || std::io::Error::other("x");
        let cases = [
            (
                Error::invalid("payload", "must be an object"),
                ErrorKind::Invalid,
            ),
            (
                Error::Conflict {
                    what: "event_id",
                    reason: "is already in the outbox".into(),
                },
                ErrorKind::Conflict,
            ),
            (Error::Config("x".into()), ErrorKind::Config),
            (Error::setup("registering metrics", io()), ErrorKind::Config),
            (
                Error::InvalidArgument {
                    argument: "business statement",
                    reason: "x".into(),
                },
                ErrorKind::Config,
            ),
            (Error::database("claiming", io()), ErrorKind::Transient),
            (
                Error::database_as(ErrorKind::NotMigrated, "claiming", io()),
                ErrorKind::NotMigrated,
            ),
            (
                Error::SchemaTooNew {
                    found: 99,
                    supported: 21,
                },
                ErrorKind::NotMigrated,
            ),
            (
                Error::SchemaTooOld {
                    found: 0,
                    needed: 21,
                },
                ErrorKind::NotMigrated,
            ),
            (
                Error::CorruptRow {
                    id: 1,
                    reason: "x".into(),
                },
                ErrorKind::Invalid,
            ),
            (Error::broker("producing", io()), ErrorKind::Transient),
            (Error::broker_fatal("polling", io()), ErrorKind::Fatal),
        ];
        for (e, kind) in cases {
            assert_eq!(e.kind(), kind, "{e}");
            assert_eq!(e.is_fatal(), kind == ErrorKind::Fatal, "{e}");
            assert_eq!(e.is_transient(), kind == ErrorKind::Transient, "{e}");
        }
    }
}
