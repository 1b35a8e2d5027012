//! Topics that cannot take records until an operator acts.
//!
//! A topic that does not exist (a cluster that does not create topics on first use, a new
//! aggregate type, a `topic` override) or that the relay's principal may not write (an ACL)
//! fails every message sent to it with a transient error: the cluster's state, which can
//! change. Retried in place for ever, such an event holds back its aggregate (the polling
//! relay) or, since the CDC relay confirms nothing past an unacknowledged message, every later
//! event of every aggregate and the slot's WAL. [`Unwritable`] wraps a relay's publisher: once
//! messages to a topic have failed for `grace` without a success in between, it asks the
//! cluster about the topic at each failed attempt; when the cluster answers that the topic is
//! missing or not writable, and answers so again [`CONFIRM_PAUSE`] later, those failures
//! become [`FailureKind::Unwritable`], so the relay parks the rows with the reason and the
//! others flow. A cluster that does not answer is an outage, not a topic's problem: its
//! failures stay transient and are retried without end.
//!
//! The clock is this process's: with several relays taking turns at a failing row, each sees
//! only its own attempts, so a row is parked at the first attempt of a relay that has seen
//! the topic fail for `grace` — two of its own failures `grace` apart. Both answers are asked
//! at that one attempt, so the number of relays adds turns of the retry backoff to the time a
//! row takes to park, never a requirement that one relay win several turns in a row.
//!
//! A parked row keeps the whole event: `idem outbox retry` publishes it once the topic exists.
//! The CDC relay's message mode has no table: there the record is dead-lettered whole, and
//! `idem cdc replay-dead-letters` publishes it once the topic exists.

use std::collections::{BTreeSet, HashMap};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use idem_core::publish::{FailureKind, Message, PublishError, Publisher, TopicState};

/// A publisher whose transient failures on a topic the cluster says is unwritable become
/// [`FailureKind::Unwritable`] once the topic has failed for `grace` (`None`: never, the
/// failures pass as they are).
pub struct Unwritable<P> {
    inner: P,
    grace: Option<Duration>,
    /// Per topic, when its failures began and when the last one happened.
    failing: Mutex<HashMap<String, Failing>>,
}

impl<P> std::fmt::Debug for Unwritable<P> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Unwritable")
            .field("grace", &self.grace)
            .finish_non_exhaustive()
    }
}

impl<P> Unwritable<P> {
    /// Wraps `inner`.
    pub fn new(inner: P, grace: Option<Duration>) -> Self {
        Unwritable {
            inner,
            grace,
            failing: Mutex::default(),
        }
    }

    /// The wrapped publisher.
    pub fn inner(&self) -> &P {
        &self.inner
    }
}

impl<P: Publisher> Unwritable<P> {
    /// The cluster's answer about each of `topics`, asked all at once: an outage makes each
    /// wait its timeout.
    async fn ask(&self, topics: &[String]) -> Vec<TopicState> {
        futures::future::join_all(topics.iter().map(|t| self.inner.topic_state(t))).await
    }
}

impl<P: Publisher> Publisher for Unwritable<P> {
    async fn publish(&self, messages: &[Message]) -> Vec<Result<(), PublishError>> {
        let mut results = self.inner.publish(messages).await;
        let Some(grace) = self.grace else {
            return results;
        };
        let due = {
            let mut failing = self.failing.lock().unwrap_or_else(|p| p.into_inner());
            failing_for(&mut failing, messages, &results, Instant::now(), grace)
        };
        // The questions come after every delivery report: a lease they outlast fences only
        // the mark (a republish the inbox absorbs), never the per-aggregate order.
        let suspects = unwritable(&due, self.ask(&due).await);
        if suspects.is_empty() {
            return results;
        }
        tokio::time::sleep(CONFIRM_PAUSE).await;
        let again = self.ask(&suspects).await;
        for (topic, state) in suspects.into_iter().zip(again) {
            if state.is_unwritable() {
                set_aside(messages, &mut results, &topic, state, grace);
            }
        }
        results
    }

    fn longest_publish(&self) -> Option<Duration> {
        self.inner.longest_publish()
    }

    fn topic_state(&self, topic: &str) -> impl Future<Output = TopicState> + Send {
        self.inner.topic_state(topic)
    }
}

/// How long without a failure ends a topic's run of failures (or the grace, when longer): far
/// beyond any retry backoff (the CDC relay's waits reach 10 s, the polling relay's and the
/// drain's claim cycle's a minute), so a topic failing at every attempt stays one run.
const RUN_GAP: Duration = Duration::from_secs(300);

/// A topic's run of failures: when it began and when the last one happened. A run ends with a
/// success, or with a gap longer than [`RUN_GAP`] (failures that far apart are not one outage
/// of the topic).
#[derive(Clone, Copy, Debug)]
struct Failing {
    since: Instant,
    last: Instant,
}

/// The wait between the cluster's two answers about a topic before its messages are set
/// aside: one answer may come from a broker whose metadata lags a topic just created or a
/// write just granted.
pub const CONFIRM_PAUSE: Duration = Duration::from_secs(1);

/// The topics of `asked` the cluster answered are unwritable.
fn unwritable(asked: &[String], answers: Vec<TopicState>) -> Vec<String> {
    asked
        .iter()
        .zip(answers)
        .filter(|(_, state)| state.is_unwritable())
        .map(|(topic, _)| topic.clone())
        .collect()
}

/// Whether `result` is a failure that says nothing of the message itself.
fn is_retryable(result: &Result<(), PublishError>) -> bool {
    matches!(result, Err(e) if matches!(e.kind, FailureKind::Transient | FailureKind::NotSent))
}

/// Records this call's results in `failing` (a success clears its topic; a retryable failure
/// starts its topic's clock, or carries it on) and returns the topics that failed in this call
/// and have been failing for at least `grace`.
fn failing_for(
    failing: &mut HashMap<String, Failing>,
    messages: &[Message],
    results: &[Result<(), PublishError>],
    now: Instant,
    grace: Duration,
) -> Vec<String> {
    let mut ok = BTreeSet::new();
    let mut failed = BTreeSet::new();
    for (m, r) in messages.iter().zip(results) {
        if r.is_ok() {
            ok.insert(m.topic.as_str());
        } else if is_retryable(r) {
            failed.insert(m.topic.as_str());
        }
    }
    for topic in &ok {
        failing.remove(*topic);
    }
    failed
        .into_iter()
        .filter(|t| !ok.contains(t))
        .filter(|t| {
            let run = failing.entry((*t).to_owned()).or_insert(Failing {
                since: now,
                last: now,
            });
            if now.duration_since(run.last) > RUN_GAP.max(grace) {
                run.since = now;
            }
            run.last = now;
            now.duration_since(run.since) >= grace
        })
        .map(str::to_owned)
        .collect()
}

/// Turns the retryable failures of `topic` into unwritable ones, with what to do.
fn set_aside(
    messages: &[Message],
    results: &mut [Result<(), PublishError>],
    topic: &str,
    state: TopicState,
    grace: Duration,
) {
    let why = match state {
        TopicState::NotAuthorized => format!(
            "the relay may not write topic {topic} (the cluster refuses the principal: an ACL)"
        ),
        _ => format!("topic {topic} does not exist and the cluster does not create it"),
    };
    for (m, r) in messages.iter().zip(results.iter_mut()) {
        if m.topic == topic && is_retryable(r) {
            let last = r
                .as_ref()
                .err()
                .map(|e| e.reason.clone())
                .unwrap_or_default();
            *r = Err(PublishError {
                kind: FailureKind::Unwritable,
                reason: format!(
                    "{why}; its events failed for {} s or more. Create the topic or grant \
                     the write, then `idem outbox retry`. Last error: {last}",
                    grace.as_secs()
                ),
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msg(topic: &str) -> Message {
        Message {
            topic: topic.to_owned(),
            key: "k".to_owned(),
            payload: String::new(),
            headers: vec![],
        }
    }

    fn transient() -> Result<(), PublishError> {
        Err(PublishError {
            kind: FailureKind::Transient,
            reason: "Message production error: UnknownTopicOrPartition".to_owned(),
        })
    }

    #[test]
    fn a_topic_is_due_only_after_failing_for_the_grace_without_a_success() {
        let grace = Duration::from_secs(60);
        let t0 = Instant::now();
        let mut failing = HashMap::new();
        let messages = [msg("missing"), msg("fine")];
        let results = [transient(), Ok(())];
        let due = failing_for(&mut failing, &messages, &results, t0, grace);
        assert!(due.is_empty(), "the first failure starts the clock");
        let due = failing_for(&mut failing, &messages, &results, t0 + grace / 2, grace);
        assert!(due.is_empty());
        let due = failing_for(&mut failing, &messages, &results, t0 + grace, grace);
        assert_eq!(due.into_iter().collect::<Vec<_>>(), vec!["missing"]);
        // One success on the topic clears it: the clock starts again at the next failure.
        let ok = failing_for(&mut failing, &messages[..1], &[Ok(())], t0 + grace, grace);
        assert!(ok.is_empty());
        let later = t0 + grace * 3;
        assert!(failing_for(&mut failing, &messages, &results, later, grace).is_empty());
    }

    #[test]
    fn only_failures_further_apart_than_a_run_gap_start_the_clock_again() {
        let grace = Duration::from_secs(2);
        let t0 = Instant::now();
        let mut failing = HashMap::new();
        let messages = [msg("missing")];
        let results = [transient()];
        assert!(failing_for(&mut failing, &messages, &results, t0, grace).is_empty());
        // The next attempt after a 10 s backoff, longer than the grace: one run, due.
        let retry = t0 + Duration::from_secs(10);
        let due = failing_for(&mut failing, &messages, &results, retry, grace);
        assert_eq!(due.len(), 1, "failures spaced by backoffs add up");
        let later = retry + RUN_GAP * 2;
        assert!(
            failing_for(&mut failing, &messages, &results, later, grace).is_empty(),
            "one failure long after the last is a new run"
        );
        let due = failing_for(&mut failing, &messages, &results, later + grace, grace);
        assert_eq!(due.len(), 1);
    }

    #[test]
    fn only_the_topics_the_cluster_calls_unwritable_are_suspects() {
        let asked = [
            "gone".to_owned(),
            "denied".to_owned(),
            "fine".to_owned(),
            "down".to_owned(),
        ];
        let answers = vec![
            TopicState::Missing,
            TopicState::NotAuthorized,
            TopicState::Writable,
            TopicState::Unknown,
        ];
        assert_eq!(unwritable(&asked, answers), ["gone", "denied"]);
    }

    #[test]
    fn a_topic_with_a_success_in_the_same_call_is_never_due() {
        let grace = Duration::ZERO;
        let mut failing = HashMap::new();
        let messages = [msg("t"), msg("t")];
        let due = failing_for(
            &mut failing,
            &messages,
            &[transient(), Ok(())],
            Instant::now(),
            grace,
        );
        assert!(due.is_empty());
    }

    #[test]
    fn only_the_retryable_failures_of_the_topic_are_set_aside() {
        let messages = [msg("missing"), msg("other"), msg("missing")];
        let too_large = Err(PublishError {
            kind: FailureKind::Permanent,
            reason: "too large".to_owned(),
        });
        let mut results = vec![transient(), transient(), too_large.clone()];
        set_aside(
            &messages,
            &mut results,
            "missing",
            TopicState::Missing,
            Duration::from_secs(60),
        );
        let first = results[0].as_ref().unwrap_err();
        assert_eq!(first.kind, FailureKind::Unwritable);
        assert!(
            first.reason.contains("topic missing does not exist"),
            "{}",
            first.reason
        );
        assert!(
            first.reason.contains("UnknownTopicOrPartition"),
            "{}",
            first.reason
        );
        assert_eq!(results[1], transient(), "another topic keeps its retry");
        assert_eq!(
            results[2], too_large,
            "a permanent failure keeps its own reason"
        );
        let mut results = vec![transient()];
        set_aside(
            &messages[..1],
            &mut results,
            "missing",
            TopicState::NotAuthorized,
            Duration::from_secs(60),
        );
        assert!(
            results[0]
                .as_ref()
                .unwrap_err()
                .reason
                .contains("may not write")
        );
    }
}
