//! The streaming comparison: both sides arrive sorted by key, and one pass over them finds the
//! missing, unexpected, duplicated and mismatched keys with memory bounded by the batch size.

use std::collections::{BTreeMap, VecDeque};

use tokio::sync::mpsc;

use crate::VerifyError;
use crate::db::{Batch, KeyRow};
use crate::report::{
    CheckReport, CurrencyMismatch, Duplicate, Loss, Mismatch, SAMPLES, Stage, TypeTotals,
};

/// One side, read in order.
pub(crate) struct Cursor {
    rx: mpsc::Receiver<Batch>,
    buf: VecDeque<KeyRow>,
    last: Option<String>,
    side: &'static str,
    done: bool,
}

impl Cursor {
    pub(crate) fn new(rx: mpsc::Receiver<Batch>, side: &'static str) -> Self {
        Cursor {
            rx,
            buf: VecDeque::new(),
            last: None,
            side,
            done: false,
        }
    }

    async fn fill(&mut self) -> Result<(), VerifyError> {
        while self.buf.is_empty() && !self.done {
            match self.rx.recv().await {
                Some(batch) => self.buf.extend(batch?),
                None => self.done = true,
            }
        }
        Ok(())
    }

    /// The next key, without taking it.
    pub(crate) async fn peek(&mut self) -> Result<Option<&str>, VerifyError> {
        self.fill().await?;
        Ok(self.buf.front().map(|r| r.key.as_str()))
    }

    /// Takes every row with key `key` (the next ones).
    pub(crate) async fn take(&mut self, key: &str) -> Result<Vec<KeyRow>, VerifyError> {
        let mut group = Vec::with_capacity(1);
        loop {
            self.fill().await?;
            match self.buf.front() {
                Some(r) if r.key == key => {
                    if let Some(r) = self.buf.pop_front() {
                        group.push(r);
                    }
                }
                _ => break,
            }
        }
        if let Some(last) = &self.last
            && last.as_str() >= key
        {
            return Err(VerifyError::Unordered {
                side: self.side,
                key: key.to_owned(),
            });
        }
        self.last = Some(key.to_owned());
        Ok(group)
    }
}

/// Accumulates one check's findings.
pub(crate) struct Tally {
    default_type: String,
    by_type: BTreeMap<String, TypeTotals>,
    pub report: CheckReport,
    /// Missing keys still to be located (at most `locate_limit`).
    pub to_locate: Vec<Loss>,
    locate_limit: usize,
    /// Compare each target row's currency with its source row's.
    pub compare_currency: bool,
}

impl Tally {
    pub(crate) fn new(name: &str, default_type: &str, locate_limit: usize) -> Self {
        Tally {
            default_type: default_type.to_owned(),
            by_type: BTreeMap::new(),
            report: CheckReport {
                name: name.to_owned(),
                ..CheckReport::default()
            },
            to_locate: Vec::new(),
            locate_limit,
            compare_currency: false,
        }
    }

    /// Records one key's source rows and target rows.
    pub(crate) fn key(&mut self, key: &str, source: &[KeyRow], target: &[KeyRow]) {
        let sum = |rows: &[KeyRow]| rows.iter().map(|r| i128::from(r.amount.unwrap_or(0))).sum();
        let (s_sum, t_sum): (i128, i128) = (sum(source), sum(target));
        let event_type = match source.first() {
            Some(r) => r
                .event_type
                .clone()
                .unwrap_or_else(|| self.default_type.clone()),
            None => self.default_type.clone(),
        };
        let t = self
            .by_type
            .entry(event_type.clone())
            .or_insert_with(|| TypeTotals {
                event_type,
                ..TypeTotals::default()
            });
        t.source_rows += u64::try_from(source.len()).unwrap_or(u64::MAX);
        t.source_sum += s_sum;
        t.target_rows += u64::try_from(target.len()).unwrap_or(u64::MAX);
        t.target_sum += t_sum;
        match (source.len(), target.len()) {
            (0, _) => {
                t.unexpected += 1;
                if self.report.unexpected.len() < SAMPLES {
                    self.report.unexpected.push(key.to_owned());
                }
                return;
            }
            (_, 0) => {
                t.missing += 1;
                if self.to_locate.len() < self.locate_limit {
                    self.to_locate.push(Loss {
                        key: key.to_owned(),
                        aggregate_id: source[0].aggregate_id.clone(),
                        event_id: None,
                        stage: Stage::NotLocated,
                        detail: None,
                    });
                }
                return;
            }
            _ => {}
        }
        if source.len() > 1 {
            t.duplicate_source_keys += 1;
        }
        if target.len() > 1 {
            t.duplicate_effects += 1;
            if self.report.duplicates.len() < SAMPLES {
                self.report.duplicates.push(Duplicate {
                    key: key.to_owned(),
                    rows: u64::try_from(target.len()).unwrap_or(u64::MAX),
                });
            }
        }
        let currency = &source[0].currency;
        if self.compare_currency && target.iter().any(|r| &r.currency != currency) {
            t.currency_mismatches += 1;
            if self.report.currency_mismatches.len() < SAMPLES {
                self.report.currency_mismatches.push(CurrencyMismatch {
                    key: key.to_owned(),
                    source: currency.clone(),
                    target: target.iter().map(|r| r.currency.clone()).collect(),
                });
            }
        }
        let expected = source[0].amount;
        if expected.is_some() && target.iter().any(|r| r.amount != expected) {
            t.amount_mismatches += 1;
            if self.report.mismatches.len() < SAMPLES {
                self.report.mismatches.push(Mismatch {
                    key: key.to_owned(),
                    source: i128::from(expected.unwrap_or(0)),
                    target: t_sum,
                });
            }
        }
    }

    pub(crate) fn finish(mut self) -> (CheckReport, Vec<Loss>) {
        self.report.by_event_type = self.by_type.into_values().collect();
        (self.report, self.to_locate)
    }
}

/// Merges the two sides into `tally`.
pub(crate) async fn merge(
    source: &mut Cursor,
    target: &mut Cursor,
    tally: &mut Tally,
) -> Result<(), VerifyError> {
    loop {
        let s = source.peek().await?.map(str::to_owned);
        let t = target.peek().await?.map(str::to_owned);
        let key = match (s, t) {
            (None, None) => return Ok(()),
            (Some(s), None) => s,
            (None, Some(t)) => t,
            (Some(s), Some(t)) => {
                if s.as_bytes() <= t.as_bytes() {
                    s
                } else {
                    t
                }
            }
        };
        let src = if source.peek().await? == Some(key.as_str()) {
            source.take(&key).await?
        } else {
            Vec::new()
        };
        let tgt = if target.peek().await? == Some(key.as_str()) {
            target.take(&key).await?
        } else {
            Vec::new()
        };
        tally.key(&key, &src, &tgt);
    }
}

/// Counts keys that repeat in one sorted stream.
pub(crate) async fn repeats(
    cursor: &mut Cursor,
    report: &mut crate::report::UniqueReport,
) -> Result<(), VerifyError> {
    while let Some(key) = cursor.peek().await?.map(str::to_owned) {
        let rows = u64::try_from(cursor.take(&key).await?.len()).unwrap_or(u64::MAX);
        report.rows += rows;
        if rows > 1 {
            report.duplicated_keys += 1;
            if report.duplicates.len() < SAMPLES {
                report.duplicates.push(Duplicate { key, rows });
            }
        }
    }
    Ok(())
}

/// Counts a must-be-empty query's rows, keeping the first keys.
pub(crate) async fn rows(
    cursor: &mut Cursor,
    report: &mut crate::report::EmptyReport,
) -> Result<(), VerifyError> {
    while let Some(key) = cursor.peek().await?.map(str::to_owned) {
        let rows = u64::try_from(cursor.take(&key).await?.len()).unwrap_or(u64::MAX);
        report.rows += rows;
        if report.keys.len() < SAMPLES {
            report.keys.push(key);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(key: &str, amount: i64) -> KeyRow {
        KeyRow {
            key: key.to_owned(),
            amount: Some(amount),
            event_type: None,
            aggregate_id: Some(format!("agg-{key}")),
            currency: None,
        }
    }

    /// A cursor fed `rows` in batches of two.
    fn cursor(rows: Vec<KeyRow>, side: &'static str) -> Cursor {
        let (tx, rx) = mpsc::channel(100);
        for chunk in rows.chunks(2) {
            tx.try_send(Ok(chunk.to_vec())).unwrap();
        }
        Cursor::new(rx, side)
    }

    #[tokio::test]
    async fn one_pass_finds_missing_unexpected_duplicate_and_mismatched_keys() {
        let mut s = cursor(
            vec![
                row("a", 1),
                row("b", 2),
                row("c", 3),
                row("d", 4),
                row("e", 5),
            ],
            "source",
        );
        let mut t = cursor(
            vec![
                row("a", 1),
                row("c", 3),
                row("c", 3),
                row("d", 40),
                row("e", 5),
                row("z", 9),
            ],
            "target",
        );
        let mut tally = Tally::new("x", "order.paid", 10);
        merge(&mut s, &mut t, &mut tally).await.unwrap();
        let (report, lost) = tally.finish();
        let totals = report.total();
        assert_eq!(
            (
                totals.source_rows,
                totals.target_rows,
                totals.missing,
                totals.unexpected,
                totals.duplicate_effects,
                totals.amount_mismatches
            ),
            (5, 6, 1, 1, 1, 1)
        );
        assert_eq!((totals.source_sum, totals.target_sum), (15, 61));
        assert_eq!(lost.len(), 1);
        assert_eq!(
            (lost[0].key.as_str(), lost[0].aggregate_id.as_deref()),
            ("b", Some("agg-b"))
        );
        assert_eq!(report.unexpected, vec!["z".to_owned()]);
        assert_eq!(
            report.duplicates,
            vec![Duplicate {
                key: "c".into(),
                rows: 2
            }]
        );
        assert_eq!(report.mismatches[0].key, "d");
    }

    #[tokio::test]
    async fn equal_sides_are_clean_and_out_of_order_input_is_an_error() {
        let rows = || vec![row("a", 1), row("b", 2), row("c", 3)];
        let mut tally = Tally::new("x", "t", 10);
        merge(
            &mut cursor(rows(), "source"),
            &mut cursor(rows(), "target"),
            &mut tally,
        )
        .await
        .unwrap();
        assert_eq!(tally.finish().0.total().violations(), 0);

        let mut tally = Tally::new("x", "t", 10);
        let err = merge(
            &mut cursor(vec![row("b", 1), row("a", 1)], "source"),
            &mut cursor(vec![], "target"),
            &mut tally,
        )
        .await
        .unwrap_err();
        assert!(
            matches!(err, VerifyError::Unordered { side: "source", .. }),
            "{err}"
        );
    }
}
