//! Named crash points and negative controls: the fault seam of the engines.
//!
//! A crash point marks a place where a crash leaves a duplicate window open, for example
//! between a Kafka delivery report and the outbox `UPDATE` that records it. Tests and the chaos
//! runner arm a point to prove that the window is absorbed downstream. A negative control
//! ([`BREAKABLE`]) switches one at-least-once mechanism off on purpose, to prove that the harness
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

use crate::error::{Error, Result};

/// Every crash point idem defines. Arming any other name is an error.
pub const CRASH_POINTS: &[&str] = &[
    RELAY_AFTER_CLAIM_BEFORE_PUBLISH,
    RELAY_AFTER_PUBLISH_BEFORE_MARK,
    CONSUMER_AFTER_DEDUP_BEFORE_HANDLER,
    CONSUMER_AFTER_DB_COMMIT_BEFORE_OFFSET_COMMIT,
    EFFECT_BEFORE_HTTP,
    EFFECT_AFTER_HTTP_SUCCESS_BEFORE_RECORD,
];

/// Crash points of the CDC relay (`idem cdc relay`), kept apart from [`CRASH_POINTS`] while
/// the chaos runner and the demo, which fire every point of that list, run the polling relay.
pub const CDC_CRASH_POINTS: &[&str] = &[CDC_AFTER_PUBLISH_BEFORE_CONFIRM];

/// The CDC relay published a batch of whole transactions and Kafka acknowledged every message;
/// the batch's `end_lsn` is not confirmed to the slot. Recovery: the next session streams from
/// the slot's confirmed position, so the batch is published again (duplicates in Kafka that the
/// consumer inbox absorbs).
pub const CDC_AFTER_PUBLISH_BEFORE_CONFIRM: &str = "cdc.after_publish_before_confirm";

/// The relay has claimed a batch but produced nothing yet. Recovery: the lease expires and
/// another claim takes the rows again (attempt number + 1, no duplicate in Kafka).
pub const RELAY_AFTER_CLAIM_BEFORE_PUBLISH: &str = "relay.after_claim_before_publish";
/// Kafka acknowledged the batch but the rows are not marked published. Recovery: the rows are
/// published again (a republish, a duplicate in Kafka that the consumer inbox absorbs).
pub const RELAY_AFTER_PUBLISH_BEFORE_MARK: &str = "relay.after_publish_before_mark";

/// The consumer recorded the batch in the inbox, inside its open transaction, and has not run
/// the handler. Recovery: the transaction rolls back with the process; the offset was not
/// committed, so the batch is delivered again and processed as new.
pub const CONSUMER_AFTER_DEDUP_BEFORE_HANDLER: &str = "consumer.after_dedup_before_handler";
/// The consumer's transaction (inbox rows and business writes) committed; the Kafka offset is
/// not committed. Recovery: the batch is delivered again, every event is a duplicate in the
/// inbox and is skipped (`idem_duplicate_skip_total`), then the offset moves on.
pub const CONSUMER_AFTER_DB_COMMIT_BEFORE_OFFSET_COMMIT: &str =
    "consumer.after_db_commit_before_offset_commit";

/// The dispatcher claimed an intent and has not sent it. Recovery: after the lease, the intent
/// is sent with the same key.
pub const EFFECT_BEFORE_HTTP: &str = "effect.before_http";
/// The remote answered 2xx; the outcome is not recorded. Recovery: the intent is sent again with
/// the same key and the remote replays its stored response (one effect).
pub const EFFECT_AFTER_HTTP_SUCCESS_BEFORE_RECORD: &str = "effect.after_http_success_before_record";

/// Negative controls: mechanisms the chaos runner breaks on purpose, one at a time, to prove
/// that it notices (a harness that cannot fail proves nothing). Broken with
/// [`break_mechanism`]; honoured only by builds with the `failpoints` feature.
pub const BREAKABLE: &[&str] = &[
    BREAK_MARK_BEFORE_REPORT,
    BREAK_OFFSET_BEFORE_COMMIT,
    BREAK_SELECT_THEN_INSERT,
    BREAK_NEW_KEY_PER_RETRY,
    BREAK_INBOX_IGNORES_GROUP,
    BREAK_ID_WATERMARK,
    BREAK_KAFKA_TRANSACTIONS,
    BREAK_NEVER_PARK,
    BREAK_KEY_LOCK_RENEWAL,
    BREAK_TRANSIENT_DEAD_LETTERS,
    BREAK_SKIP_SENDING_MARK,
];
/// The relay marks a batch published right after claiming it, before any delivery report.
pub const BREAK_MARK_BEFORE_REPORT: &str = "mark-before-report";
/// The consumer commits the batch's offsets before its database transaction.
pub const BREAK_OFFSET_BEFORE_COMMIT: &str = "offset-before-commit";
/// The consumer checks the inbox before the transaction and records it after the commit.
pub const BREAK_SELECT_THEN_INSERT: &str = "select-then-insert";
/// The effect dispatcher sends a new idempotency key on every retry.
pub const BREAK_NEW_KEY_PER_RETRY: &str = "new-key-per-retry";
/// The inbox is keyed by event id alone, not by (consumer group, event id).
pub const BREAK_INBOX_IGNORES_GROUP: &str = "inbox-ignores-group";
/// The relay keeps an id watermark and treats rows below it as already published.
pub const BREAK_ID_WATERMARK: &str = "id-watermark";
/// The effect dispatcher sends to a remote that ignores keys without the durable sending mark, so
/// an attempt that died after sending is sent again blindly.
pub const BREAK_SKIP_SENDING_MARK: &str = "skip-sending-mark";
/// Kafka transactions instead of the inbox: only the lab's `idem-lab kafka-txn-settlement` has this
/// mechanism (read_committed, no inbox, offsets committed in a Kafka transaction after the
/// database commit), and it refuses to run unless it is named here.
pub const BREAK_KAFKA_TRANSACTIONS: &str = "kafka-transactions";
/// The Idempotency-Key layer (`idem-http`) never renews a claim's lock while the handler runs,
/// so a request slower than the lock is taken over by a retry and executes beside it.
pub const BREAK_KEY_LOCK_RENEWAL: &str = "key-lock-renewal";

/// The relay never parks a row that fails permanently (too large, unpublishable): it retries
/// it forever, so a foreign writer's hostile row wedges its aggregate.
pub const BREAK_NEVER_PARK: &str = "never-park";

/// The consumer dead-letters an event after a few transient failures of its handler, so that a
/// lock held on the business tables for seconds loses events.
/// The chaos runner's long-lock window (`idem-lab settlement --lock-timeout-ms` and a lock held on
/// `settlements`) makes it visible.
pub const BREAK_TRANSIENT_DEAD_LETTERS: &str = "transient-dead-letters";

/// Transient failures of one event after which [`BREAK_TRANSIENT_DEAD_LETTERS`] dead-letters it.
pub const BROKEN_TRANSIENT_BUDGET: u32 = 3;

/// Is `mechanism` deliberately broken in this process (see [`break_mechanism`])?
#[inline(always)]
pub fn broken(mechanism: &str) -> bool {
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

/// Breaks `mechanism` (one of [`BREAKABLE`]) in this process from now on: a negative control.
///
/// Fails on an unknown name, or when the build has no `failpoints` feature.
pub fn break_mechanism(mechanism: &str) -> Result<()> {
    let index = breakable(mechanism)?;
    #[cfg(feature = "failpoints")]
    {
        imp::break_mechanism(index);
        Ok(())
    }
    #[cfg(not(feature = "failpoints"))]
    {
        let _ = index;
        Err(Error::Config(
            "negative controls are not compiled in; build with the `failpoints` feature".to_owned(),
        ))
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

fn breakable(mechanism: &str) -> Result<usize> {
    BREAKABLE
        .iter()
        .position(|b| *b == mechanism)
        .ok_or_else(|| {
            Error::Config(format!(
                "unknown mechanism {mechanism:?}; known: {}",
                BREAKABLE.join(", ")
            ))
        })
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
    use std::collections::HashMap;
    use std::io::Write;
    use std::path::PathBuf;
    use std::sync::Mutex;
    use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};

    struct Armed {
        action: Action,
        /// Fire on this hit (1 = first).
        fire_on: u64,
        hits: u64,
    }

    static ARMED: Mutex<Option<HashMap<&'static str, Armed>>> = Mutex::new(None);
    /// Set while any point is armed: unarmed builds pay one relaxed load per pass.
    static ANY_ARMED: AtomicBool = AtomicBool::new(false);
    /// Fires per point, in [`CRASH_POINTS`] order.
    static FIRED: [AtomicU64; CRASH_POINTS.len()] =
        [const { AtomicU64::new(0) }; CRASH_POINTS.len()];

    /// Bit `i` set: [`BREAKABLE`]`[i]` is broken.
    static BROKEN: AtomicU32 = AtomicU32::new(0);
    const _: () = assert!(BREAKABLE.len() <= 32, "BROKEN holds one bit per mechanism");
    /// Where an aborting crash point records its name.
    static CRASH_LOG: Mutex<Option<PathBuf>> = Mutex::new(None);

    pub(super) fn broken(mechanism: &str) -> bool {
        let mask = BROKEN.load(Ordering::Acquire);
        mask != 0
            && BREAKABLE
                .iter()
                .position(|b| *b == mechanism)
                .is_some_and(|i| mask & (1 << i) != 0)
    }

    pub(super) fn break_mechanism(index: usize) {
        BROKEN.fetch_or(1 << index, Ordering::AcqRel);
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

    pub(super) fn fired() -> Vec<(&'static str, u64)> {
        CRASH_POINTS
            .iter()
            .zip(FIRED.iter())
            .map(|(n, c)| (*n, c.load(Ordering::Relaxed)))
            .collect()
    }

    pub(super) fn arm(name: &str, action: Action, fire_on: u64) -> Result<()> {
        let known = known(name)?;
        let mut guard = ARMED.lock().unwrap_or_else(|p| p.into_inner());
        guard.get_or_insert_with(HashMap::new).insert(
            known,
            Armed {
                action,
                fire_on: fire_on.max(1),
                hits: 0,
            },
        );
        ANY_ARMED.store(true, Ordering::Release);
        Ok(())
    }

    pub(super) fn is_armed(name: &str) -> bool {
        let guard = ARMED.lock().unwrap_or_else(|p| p.into_inner());
        guard.as_ref().is_some_and(|m| m.contains_key(name))
    }

    pub(super) fn disarm_all() {
        let mut guard = ARMED.lock().unwrap_or_else(|p| p.into_inner());
        *guard = None;
        ANY_ARMED.store(false, Ordering::Release);
    }

    pub(super) fn crash_point(name: &'static str) -> Result<()> {
        if !ANY_ARMED.load(Ordering::Acquire) {
            return Ok(());
        }
        let action = {
            let mut guard = ARMED.lock().unwrap_or_else(|p| p.into_inner());
            let Some(map) = guard.as_mut() else {
                return Ok(());
            };
            let Some(armed) = map.get_mut(name) else {
                return Ok(());
            };
            armed.hits += 1;
            if armed.hits != armed.fire_on {
                return Ok(());
            }
            let action = armed.action;
            map.remove(name);
            if map.is_empty() {
                ANY_ARMED.store(false, Ordering::Release);
            }
            if let Some(i) = CRASH_POINTS.iter().position(|p| *p == name) {
                FIRED[i].fetch_add(1, Ordering::Relaxed);
            }
            action
        };
        match action {
            Action::Error => Err(Error::CrashPoint(name)),
            Action::Abort => {
                eprintln!("idem: crash point {name} fired");
                if let Some(path) = crash_log()
                    && let Ok(mut f) = std::fs::OpenOptions::new()
                        .create(true)
                        .append(true)
                        .open(path)
                {
                    let _ = writeln!(f, "{name}");
                    let _ = f.sync_all();
                }
                std::process::abort()
            }
        }
    }
}

fn known(name: &str) -> Result<&'static str> {
    CRASH_POINTS
        .iter()
        .chain(CDC_CRASH_POINTS)
        .copied()
        .find(|p| *p == name)
        .ok_or_else(|| {
            Error::Config(format!(
                "unknown crash point {name:?}; known points: {}, {}",
                CRASH_POINTS.join(", "),
                CDC_CRASH_POINTS.join(", ")
            ))
        })
}

/// Arms `name` to perform `action` on its `fire_on`-th hit (1 = first).
///
/// Fails on an unknown name, or when the build has no `failpoints` feature.
pub fn arm(name: &str, action: Action, fire_on: u64) -> Result<()> {
    #[cfg(feature = "failpoints")]
    {
        imp::arm(name, action, fire_on)
    }
    #[cfg(not(feature = "failpoints"))]
    {
        let _ = (known(name)?, action, fire_on);
        Err(Error::Config(
            "crash points are not compiled in; build with the `failpoints` feature".to_owned(),
        ))
    }
}

/// Disarms every crash point.
pub fn disarm_all() {
    #[cfg(feature = "failpoints")]
    imp::disarm_all();
}

/// How many times each point has fired in this process (all zero without `failpoints`).
pub fn fired() -> Vec<(&'static str, u64)> {
    #[cfg(feature = "failpoints")]
    {
        imp::fired()
    }
    #[cfg(not(feature = "failpoints"))]
    {
        CRASH_POINTS.iter().map(|n| (*n, 0)).collect()
    }
}

/// Is `name` armed right now? (For a supervisor re-arming points between restarts.)
pub fn is_armed(name: &str) -> bool {
    #[cfg(feature = "failpoints")]
    {
        imp::is_armed(name)
    }
    #[cfg(not(feature = "failpoints"))]
    {
        let _ = name;
        false
    }
}

/// Passes through crash point `name`: does nothing unless the point is armed.
#[inline(always)]
pub fn crash_point(name: &'static str) -> Result<()> {
    #[cfg(feature = "failpoints")]
    {
        imp::crash_point(name)
    }
    #[cfg(not(feature = "failpoints"))]
    {
        let _ = name;
        Ok(())
    }
}

#[cfg(all(test, feature = "failpoints"))]
mod tests {
    use super::*;

    #[test]
    fn error_mode_fires_on_the_chosen_hit_once() {
        arm(RELAY_AFTER_CLAIM_BEFORE_PUBLISH, Action::Error, 2).unwrap();
        assert!(crash_point(RELAY_AFTER_CLAIM_BEFORE_PUBLISH).is_ok());
        assert!(matches!(
            crash_point(RELAY_AFTER_CLAIM_BEFORE_PUBLISH),
            Err(Error::CrashPoint(RELAY_AFTER_CLAIM_BEFORE_PUBLISH))
        ));
        assert!(crash_point(RELAY_AFTER_CLAIM_BEFORE_PUBLISH).is_ok());
    }

    #[test]
    fn a_broken_mechanism_stays_broken_until_repaired() {
        assert!(!broken(BREAK_NEVER_PARK));
        break_mechanism(BREAK_NEVER_PARK).unwrap();
        assert!(broken(BREAK_NEVER_PARK));
        assert!(!broken(BREAK_ID_WATERMARK), "only the named mechanism");
        repair_all();
        assert!(!broken(BREAK_NEVER_PARK));
    }

    #[test]
    fn unknown_mechanisms_are_refused() {
        let e = break_mechanism("no-such-thing").unwrap_err().to_string();
        assert!(
            e.contains("unknown mechanism") && e.contains(BREAK_NEVER_PARK),
            "{e}"
        );
    }

    #[test]
    fn unknown_points_are_refused() {
        assert!(arm("relay.nowhere", Action::Error, 1).is_err());
    }
}
