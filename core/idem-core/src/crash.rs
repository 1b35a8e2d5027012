//! Named crash points and negative controls: the fault seam of the engines.
//!
//! A crash point ([`CrashPoint`]) marks a place where a crash leaves a duplicate window open, for example
//! between a Kafka delivery report and the outbox `UPDATE` that records it. Tests and the chaos
//! runner arm a point to prove that the window is absorbed downstream. A negative control
//! ([`Mechanism`]) switches one at-least-once mechanism off on purpose, to prove that the harness
//! notices.
//!
//! Both are compiled in only with the `failpoints` cargo feature, which the product binary `idem`
//! never enables; without it [`crash_point`] is an inlined `Ok(())` and [`broken`] an inlined
//! `false`. They are armed only through functions: [`arm`] (a crash point), [`break_mechanism`]
//! (a negative control) and [`set_crash_log`] (where an aborting point records that it fired).
//! This crate reads no environment variable; the lab binary `idem-lab` arms faults from its
//! environment at start (see `docs/reference/crash-points.md`).
//!
//! When an armed point fires in [`Action::Abort`] mode, idem writes `idem: crash point NAME
//! fired` to standard error, appends `NAME` to the crash log set by [`set_crash_log`] (synced, so
//! a test can prove the crash happened), and calls [`std::process::abort`].

use std::fmt;
use std::str::FromStr;

use crate::error::{Error, Result};

/// Declares a fieldless enum whose variants each have one name: `as_str`, `Display`, `FromStr`
/// (refusing an unknown name with the known ones) and `ALL`, in declaration order. `Debug` (and
/// so `Error`'s messages) go through `shown`, which names nothing in a build without the
/// `failpoints` feature: the operator binary holds no fault name (`scripts/test` checks).
macro_rules! named {
    (
        $(#[$meta:meta])*
        pub enum $name:ident as $what:literal {
            $( $(#[$vmeta:meta])* $variant:ident = $text:literal, )+
        }
    ) => {
        $(#[$meta])*
        #[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub enum $name {
            $( $(#[$vmeta])* $variant, )+
        }

        impl $name {
            /// Every value, in declaration order.
            pub const ALL: &'static [$name] = &[$($name::$variant),+];

            /// The name a person writes (`IDEM_CRASH_POINTS`, `IDEM_BREAK`, the crash log).
            pub const fn as_str(self) -> &'static str {
                match self {
                    $($name::$variant => $text,)+
                }
            }

            /// Its name in an error or a debug print: the name with the `failpoints` feature;
            /// without it nothing can fire, and no name reaches the binary.
            pub(crate) fn shown(self) -> &'static str {
                #[cfg(feature = "failpoints")]
                {
                    self.as_str()
                }
                #[cfg(not(feature = "failpoints"))]
                {
                    let _ = self;
                    "(a fault this build does not have)"
                }
            }

            /// Its position in [`Self::ALL`].
            #[cfg_attr(not(feature = "failpoints"), allow(dead_code))]
            const fn index(self) -> usize {
                self as usize
            }
        }

        impl fmt::Debug for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(self.shown())
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(self.as_str())
            }
        }

        impl FromStr for $name {
            type Err = Error;

            fn from_str(name: &str) -> Result<Self> {
                $name::ALL
                    .iter()
                    .copied()
                    .find(|v| v.as_str() == name)
                    .ok_or_else(|| Error::InvalidArgument {
                        argument: $what,
                        reason: format!(
                            "{name:?} is none of {}",
                            $name::ALL
                                .iter()
                                .map(|v| v.as_str())
                                .collect::<Vec<_>>()
                                .join(", ")
                        ),
                    })
            }
        }
    };
}

named! {
    /// A named crash point: a place where a crash leaves a duplicate window open, and the
    /// mechanism that absorbs it (in each variant's documentation).
    pub enum CrashPoint as "crash point" {
        /// The relay has claimed a batch but produced nothing yet. Recovery: the lease expires
        /// and another claim takes the rows again (attempt number + 1, no duplicate in Kafka).
        RelayAfterClaimBeforePublish = "relay.after_claim_before_publish",
        /// Kafka acknowledged the batch but the rows are not marked published. Recovery: the
        /// rows are published again (a republish, a duplicate in Kafka that the consumer inbox
        /// absorbs).
        RelayAfterPublishBeforeMark = "relay.after_publish_before_mark",
        /// The consumer recorded the batch in the inbox, inside its open transaction, and has
        /// not run the handler. Recovery: the transaction rolls back with the process; the
        /// offset was not committed, so the batch is delivered again and processed as new.
        ConsumerAfterDedupBeforeHandler = "consumer.after_dedup_before_handler",
        /// The consumer's transaction (inbox rows and business writes) committed; the Kafka
        /// offset is not committed. Recovery: the batch is delivered again, every event is a
        /// duplicate in the inbox and is skipped (`idem_duplicate_skip_total`), then the offset
        /// moves on.
        ConsumerAfterDbCommitBeforeOffsetCommit = "consumer.after_db_commit_before_offset_commit",
        /// The dispatcher claimed an intent and has not sent it. Recovery: after the lease, the
        /// intent is sent with the same key.
        EffectBeforeHttp = "effect.before_http",
        /// The remote answered 2xx; the outcome is not recorded. Recovery: the intent is sent
        /// again with the same key and the remote replays its stored response (one effect).
        EffectAfterHttpSuccessBeforeRecord = "effect.after_http_success_before_record",
        /// The CDC relay published a batch of whole transactions and Kafka acknowledged every
        /// message; the batch's `end_lsn` is not confirmed to the slot. Recovery: the next
        /// session streams from the slot's confirmed position, so the batch is published again
        /// (duplicates in Kafka that the consumer inbox absorbs).
        CdcAfterPublishBeforeConfirm = "cdc.after_publish_before_confirm",
    }
}

impl CrashPoint {
    /// The points of the pipeline with the polling relay, which the chaos runner and the demo
    /// fire: every point but the CDC relay's.
    pub const POLLING_PIPELINE: &'static [CrashPoint] = &[
        CrashPoint::RelayAfterClaimBeforePublish,
        CrashPoint::RelayAfterPublishBeforeMark,
        CrashPoint::ConsumerAfterDedupBeforeHandler,
        CrashPoint::ConsumerAfterDbCommitBeforeOffsetCommit,
        CrashPoint::EffectBeforeHttp,
        CrashPoint::EffectAfterHttpSuccessBeforeRecord,
    ];
}

named! {
    /// Negative controls: mechanisms the chaos runner breaks on purpose, one at a time, to prove
    /// that it notices (a harness that cannot fail proves nothing). Broken with
    /// [`break_mechanism`]; honoured only by builds with the `failpoints` feature.
    pub enum Mechanism as "mechanism" {
        /// The relay marks a batch published right after claiming it, before any delivery
        /// report.
        MarkBeforeReport = "mark-before-report",
        /// The consumer commits the batch's offsets before its database transaction.
        OffsetBeforeCommit = "offset-before-commit",
        /// The consumer checks the inbox before the transaction and records it after the
        /// commit.
        SelectThenInsert = "select-then-insert",
        /// The effect dispatcher sends a new idempotency key on every retry.
        NewKeyPerRetry = "new-key-per-retry",
        /// The inbox is keyed by event id alone, not by (consumer group, event id).
        InboxIgnoresGroup = "inbox-ignores-group",
        /// The relay keeps an id watermark and treats rows below it as already published.
        IdWatermark = "id-watermark",
        /// Kafka transactions instead of the inbox: only the lab's `idem-lab
        /// kafka-txn-settlement` has this mechanism (read_committed, no inbox, offsets committed
        /// in a Kafka transaction after the database commit), and it refuses to run unless it is
        /// named here.
        KafkaTransactions = "kafka-transactions",
        /// The relay never parks a row that fails permanently (too large, unpublishable): it
        /// retries it forever, so a foreign writer's hostile row wedges its aggregate.
        NeverPark = "never-park",
        /// The Idempotency-Key layer (`idem-http`) never renews a claim's lock while the handler
        /// runs, so a request slower than the lock is taken over by a retry and executes beside
        /// it.
        KeyLockRenewal = "key-lock-renewal",
        /// The consumer dead-letters an event after a few transient failures of its handler
        /// ([`BROKEN_TRANSIENT_BUDGET`]), so that a lock held on the business tables for seconds
        /// loses events. The chaos runner's long-lock window (`idem-lab settlement
        /// --lock-timeout` and a lock held on `settlements`) makes it visible.
        TransientDeadLetters = "transient-dead-letters",
        /// The effect dispatcher sends to a remote that ignores keys without the durable
        /// sending mark, so an attempt that died after sending is sent again blindly.
        SkipSendingMark = "skip-sending-mark",
    }
}

/// Transient failures of one event after which [`Mechanism::TransientDeadLetters`]
/// dead-letters it.
pub const BROKEN_TRANSIENT_BUDGET: u32 = 3;

/// Is `mechanism` deliberately broken in this process (see [`break_mechanism`])?
#[inline(always)]
pub fn broken(mechanism: Mechanism) -> bool {
    #[cfg(feature = "failpoints")]
    {
        imp::broken(mechanism)
    }
    #[cfg(not(feature = "failpoints"))]
    {
        let _ = mechanism;
        false
    }
}

/// Breaks `mechanism` in this process from now on: a negative control.
///
/// Fails when the build has no `failpoints` feature.
pub fn break_mechanism(mechanism: Mechanism) -> Result<()> {
    #[cfg(feature = "failpoints")]
    {
        imp::break_mechanism(mechanism);
        Ok(())
    }
    #[cfg(not(feature = "failpoints"))]
    {
        let _ = mechanism;
        Err(not_compiled_in("breaking a mechanism", "negative controls"))
    }
}

/// Restores every mechanism [`break_mechanism`] broke.
pub fn repair_all() {
    #[cfg(feature = "failpoints")]
    imp::repair_all();
}

/// Where a crash point firing in [`Action::Abort`] mode appends its name (`None`: nowhere).
pub fn set_crash_log(path: Option<std::path::PathBuf>) {
    #[cfg(feature = "failpoints")]
    imp::set_crash_log(path);
    #[cfg(not(feature = "failpoints"))]
    let _ = path;
}

/// The refusal to arm `what` in a build without the `failpoints` feature.
#[cfg(not(feature = "failpoints"))]
fn not_compiled_in(doing: &'static str, what: &str) -> Error {
    Error::setup(
        doing,
        format!("{what} are not compiled in; build with the `failpoints` feature"),
    )
}

/// What an armed crash point does when it fires.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Action {
    /// Abort the whole process (a real crash: no destructor, no flush, no commit).
    Abort,
    /// Return [`Error::CrashPoint`] to the caller (for in-process restarts).
    Error,
}

/// Whether this build has crash points compiled in.
pub const ENABLED: bool = cfg!(feature = "failpoints");

#[cfg(feature = "failpoints")]
mod imp {
    use super::*;
    use std::io::Write;
    use std::path::PathBuf;
    use std::sync::Mutex;
    use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};

    #[derive(Clone, Copy)]
    struct Armed {
        action: Action,
        /// Fire on this hit (1 = first).
        fire_on: u64,
        hits: u64,
    }

    /// The arming of each point, in [`CrashPoint::ALL`] order.
    static ARMED: Mutex<[Option<Armed>; CrashPoint::ALL.len()]> =
        Mutex::new([None; CrashPoint::ALL.len()]);
    /// Set while any point is armed: unarmed builds pay one relaxed load per pass.
    static ANY_ARMED: AtomicBool = AtomicBool::new(false);
    /// Fires per point, in [`CrashPoint::ALL`] order.
    static FIRED: [AtomicU64; CrashPoint::ALL.len()] =
        [const { AtomicU64::new(0) }; CrashPoint::ALL.len()];

    /// Bit `i` set: [`Mechanism::ALL`]`[i]` is broken.
    static BROKEN: AtomicU32 = AtomicU32::new(0);
    const _: () = assert!(
        Mechanism::ALL.len() <= 32,
        "BROKEN holds one bit per mechanism"
    );
    /// Where an aborting crash point records its name.
    static CRASH_LOG: Mutex<Option<PathBuf>> = Mutex::new(None);

    fn bit(mechanism: Mechanism) -> u32 {
        1 << mechanism.index()
    }

    pub(super) fn broken(mechanism: Mechanism) -> bool {
        BROKEN.load(Ordering::Acquire) & bit(mechanism) != 0
    }

    pub(super) fn break_mechanism(mechanism: Mechanism) {
        BROKEN.fetch_or(bit(mechanism), Ordering::AcqRel);
    }

    pub(super) fn repair_all() {
        BROKEN.store(0, Ordering::Release);
    }

    pub(super) fn set_crash_log(path: Option<PathBuf>) {
        *CRASH_LOG.lock().unwrap_or_else(|p| p.into_inner()) = path;
    }

    fn crash_log() -> Option<PathBuf> {
        CRASH_LOG.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    pub(super) fn fired() -> Vec<(CrashPoint, u64)> {
        CrashPoint::ALL
            .iter()
            .zip(FIRED.iter())
            .map(|(p, c)| (*p, c.load(Ordering::Relaxed)))
            .collect()
    }

    pub(super) fn arm(point: CrashPoint, action: Action, fire_on: u64) {
        let mut armed = ARMED.lock().unwrap_or_else(|p| p.into_inner());
        armed[point.index()] = Some(Armed {
            action,
            fire_on: fire_on.max(1),
            hits: 0,
        });
        ANY_ARMED.store(true, Ordering::Release);
    }

    pub(super) fn is_armed(point: CrashPoint) -> bool {
        ARMED.lock().unwrap_or_else(|p| p.into_inner())[point.index()].is_some()
    }

    pub(super) fn disarm_all() {
        let mut armed = ARMED.lock().unwrap_or_else(|p| p.into_inner());
        *armed = [None; CrashPoint::ALL.len()];
        ANY_ARMED.store(false, Ordering::Release);
    }

    /// The action `point` takes on this hit, if it fires now (disarming it).
    fn hit(point: CrashPoint) -> Option<Action> {
        let mut all = ARMED.lock().unwrap_or_else(|p| p.into_inner());
        let armed = all[point.index()].as_mut()?;
        armed.hits += 1;
        if armed.hits != armed.fire_on {
            return None;
        }
        let action = armed.action;
        all[point.index()] = None;
        if all.iter().all(Option::is_none) {
            ANY_ARMED.store(false, Ordering::Release);
        }
        FIRED[point.index()].fetch_add(1, Ordering::Relaxed);
        Some(action)
    }

    pub(super) fn crash_point(point: CrashPoint) -> Result<()> {
        if !ANY_ARMED.load(Ordering::Acquire) {
            return Ok(());
        }
        match hit(point) {
            None => Ok(()),
            Some(Action::Error) => Err(Error::CrashPoint(point)),
            Some(Action::Abort) => {
                eprintln!("idem: crash point {point} fired");
                if let Some(path) = crash_log()
                    && let Ok(mut f) = std::fs::OpenOptions::new()
                        .create(true)
                        .append(true)
                        .open(path)
                {
                    let _ = writeln!(f, "{point}");
                    let _ = f.sync_all();
                }
                std::process::abort()
            }
        }
    }
}

/// Arms `point` to perform `action` on its `fire_on`-th hit (1 = first).
///
/// Fails when the build has no `failpoints` feature.
pub fn arm(point: CrashPoint, action: Action, fire_on: u64) -> Result<()> {
    #[cfg(feature = "failpoints")]
    {
        imp::arm(point, action, fire_on);
        Ok(())
    }
    #[cfg(not(feature = "failpoints"))]
    {
        let _ = (point, action, fire_on);
        Err(not_compiled_in("arming a crash point", "crash points"))
    }
}

/// Disarms every crash point.
pub fn disarm_all() {
    #[cfg(feature = "failpoints")]
    imp::disarm_all();
}

/// How many times each point has fired in this process, in [`CrashPoint::ALL`] order (all zero
/// without `failpoints`).
pub fn fired() -> Vec<(CrashPoint, u64)> {
    #[cfg(feature = "failpoints")]
    {
        imp::fired()
    }
    #[cfg(not(feature = "failpoints"))]
    {
        CrashPoint::ALL.iter().map(|p| (*p, 0)).collect()
    }
}

/// Is `point` armed right now? (For a supervisor re-arming points between restarts.)
pub fn is_armed(point: CrashPoint) -> bool {
    #[cfg(feature = "failpoints")]
    {
        imp::is_armed(point)
    }
    #[cfg(not(feature = "failpoints"))]
    {
        let _ = point;
        false
    }
}

/// Passes through `point`: does nothing unless the point is armed.
#[inline(always)]
pub fn crash_point(point: CrashPoint) -> Result<()> {
    #[cfg(feature = "failpoints")]
    {
        imp::crash_point(point)
    }
    #[cfg(not(feature = "failpoints"))]
    {
        let _ = point;
        Ok(())
    }
}

#[cfg(test)]
mod names {
    use super::*;

    #[test]
    fn every_name_reads_back_as_its_value_and_an_unknown_one_lists_the_known() {
        for p in CrashPoint::ALL {
            assert_eq!(p.as_str().parse::<CrashPoint>().unwrap(), *p);
        }
        for m in Mechanism::ALL {
            assert_eq!(m.to_string().parse::<Mechanism>().unwrap(), *m);
        }
        let e = "relay.nowhere".parse::<CrashPoint>().unwrap_err();
        assert_eq!(e.kind(), crate::ErrorKind::Config);
        let e = e.to_string();
        assert!(
            e.contains("invalid crash point: \"relay.nowhere\" is none of")
                && e.contains(CrashPoint::CdcAfterPublishBeforeConfirm.as_str()),
            "{e}"
        );
        let e = "no-such-thing"
            .parse::<Mechanism>()
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("invalid mechanism: \"no-such-thing\"")
                && e.contains(Mechanism::NeverPark.as_str()),
            "{e}"
        );
    }
}

#[cfg(all(test, feature = "failpoints"))]
mod tests {
    use super::*;

    #[test]
    fn error_mode_fires_on_the_chosen_hit_once() {
        let point = CrashPoint::RelayAfterClaimBeforePublish;
        arm(point, Action::Error, 2).unwrap();
        assert!(is_armed(point));
        assert!(crash_point(point).is_ok());
        assert!(matches!(crash_point(point), Err(Error::CrashPoint(p)) if p == point));
        assert!(!is_armed(point));
        assert!(crash_point(point).is_ok());
    }

    #[test]
    fn a_broken_mechanism_stays_broken_until_repaired() {
        assert!(!broken(Mechanism::NeverPark));
        break_mechanism(Mechanism::NeverPark).unwrap();
        assert!(broken(Mechanism::NeverPark));
        assert!(!broken(Mechanism::IdWatermark), "only the named mechanism");
        repair_all();
        assert!(!broken(Mechanism::NeverPark));
    }
}
