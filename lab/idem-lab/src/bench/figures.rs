//! What a bench run reports: every figure it measures, keyed by [`Figure`], and every ratio,
//! each defined in one row of [`RATIOS`] with what it divides ([`Of`]) and its target.

/// Declares [`Figure`]: for each, its variant, its key in the report, whether it is sampled
/// (the figure is the median of its samples; `spread` keeps min, median and max), its unit
/// and its label (`{n}`, `{b}`, `{r}` and `{p}` stand for the connections, the consumer
/// batch size, the relay batch size and the partitions).
macro_rules! figures {
    ($($name:ident = $key:literal, $how:ident, $unit:literal, $label:literal;)*) => {
        /// A figure a bench run measures.
        #[derive(Clone, Copy, Debug, PartialEq, Eq)]
        pub(super) enum Figure {
            $($name,)*
        }

        impl Figure {
            /// Every figure, in the report's order.
            pub(super) const ALL: &[Figure] = &[$(Figure::$name,)*];

            /// Its key in the report's JSON.
            pub(super) const fn key(self) -> &'static str {
                match self {
                    $(Figure::$name => $key,)*
                }
            }

            /// Whether it is sampled (its value is the median of its samples).
            pub(super) const fn sampled(self) -> bool {
                match self {
                    $(Figure::$name => figures!(@$how),)*
                }
            }

            /// Its unit.
            pub(super) const fn unit(self) -> &'static str {
                match self {
                    $(Figure::$name => $unit,)*
                }
            }

            /// What it is, with the run's placeholders.
            pub(super) const fn label(self) -> &'static str {
                match self {
                    $(Figure::$name => $label,)*
                }
            }
        }
    };
    (@sampled) => { true };
    (@once) => { false };
}

figures! {
    RoundTrip = "round_trip_us", sampled, "µs",
        "round trip of one statement (SELECT 1, 1 connection)";
    PgInsert1 = "pg_insert_1conn_per_s", once, "rows/s",
        "PostgreSQL durable single-row insert, 1 connection";
    PgInsertN = "pg_insert_nconn_per_s", once, "rows/s",
        "PostgreSQL durable single-row insert, {n} connections";
    BusinessTx1 = "business_tx_1conn_per_s", sampled, "tx/s",
        "business transaction, 1 connection";
    BusinessTxOutbox1 = "business_tx_outbox_1conn_per_s", sampled, "tx/s",
        "business transaction + outbox insert, 1 connection";
    BusinessTxPlain1 = "business_tx_plain_1conn_per_s", sampled, "tx/s",
        "business transaction + plain second row, 1 connection";
    BusinessTxMessage1 = "business_tx_message_1conn_per_s", sampled, "tx/s",
        "business transaction + logical decoding message in the order's statement (CDC message mode, enqueue_with), 1 connection";
    BusinessTxMessageSeparate1 = "business_tx_message_separate_1conn_per_s", sampled, "tx/s",
        "business transaction + logical decoding message in a statement of its own (enqueue), 1 connection";
    BusinessTxN = "business_tx_nconn_per_s", sampled, "tx/s",
        "business transaction, {n} connections";
    BusinessTxOutboxN = "business_tx_outbox_nconn_per_s", sampled, "tx/s",
        "business transaction + outbox insert, {n} connections";
    BusinessTxPlainN = "business_tx_plain_nconn_per_s", sampled, "tx/s",
        "business transaction + plain second row, {n} connections";
    BusinessTxMessageN = "business_tx_message_nconn_per_s", sampled, "tx/s",
        "business transaction + logical decoding message in the order's statement (CDC message mode, enqueue_with), {n} connections";
    BusinessTxMessageSeparateN = "business_tx_message_separate_nconn_per_s", sampled, "tx/s",
        "business transaction + logical decoding message in a statement of its own (enqueue), {n} connections";
    CeilingRelay = "ceiling_relay_per_s", sampled, "rows/s",
        "ceiling: lean claim-and-mark, batch {r}, 1 connection";
    KafkaProduce = "kafka_produce_per_s", sampled, "records/s",
        "ceiling: raw rdkafka produce (idempotent, acks=all)";
    RelayDrain = "relay_drain_per_s", once, "rows/s",
        "relay drain of the backlog (idem relay)";
    RelayPeakRss = "relay_peak_rss_mib", once, "MiB",
        "relay peak RSS while draining";
    CeilingCdcProduce = "ceiling_cdc_produce_per_s", sampled, "records/s",
        "ceiling: raw rdkafka produce, on each side of the CDC drain";
    CeilingCdcDecode = "ceiling_cdc_decode_per_s", sampled, "rows/s",
        "ceiling: the server's pgoutput decoding of the backlog (one statement, no client)";
    CdcDrain = "cdc_drain_per_s", once, "rows/s",
        "CDC relay drain of a backlog from its slot (idem cdc relay)";
    CdcPeakRss = "cdc_peak_rss_mib", once, "MiB",
        "CDC relay peak RSS while draining";
    CeilingCdcProduceCpu = "ceiling_cdc_produce_cpu_us_per_row", sampled, "µs",
        "ceiling: raw produce's CPU time per record, every core (client and broker)";
    CdcDrainCpu = "cdc_drain_cpu_us_per_row", once, "µs",
        "CDC relay drain's CPU time per row, every core (relay, walsender, broker, marks, the bench's polling)";
    CdcRelayCpu = "cdc_relay_cpu_us_per_row", once, "µs",
        "of which the relay process";
    CdcWalsenderCpu = "cdc_walsender_cpu_us_per_row", once, "µs",
        "of which the walsender";
    CdcDrainCpuBound = "cdc_drain_cpu_bound_per_s", once, "rows/s",
        "CDC relay drain's bound on this machine: its cores ÷ the drain's CPU per row";
    KafkaConsume = "kafka_consume_per_s", once, "records/s",
        "raw rdkafka consume";
    CeilingConsumer1 = "ceiling_consumer_1conn_per_s", sampled, "events/s",
        "ceiling: set-based inbox + settlement, batch {b}, 1 connection";
    CeilingConsumerPartitions = "ceiling_consumer_partitions_per_s", sampled, "events/s",
        "ceiling: the same on {p} connections (one per partition)";
    ConsumerDrain = "consumer_drain_per_s", once, "events/s",
        "consumer drain of the backlog (idem-lab settlement)";
    ConsumerPeakRss = "consumer_peak_rss_mib", once, "MiB",
        "consumer peak RSS while draining";
    ConsumerNoInboxDrain = "consumer_no_inbox_drain_per_s", once, "events/s",
        "consumer drain without the inbox";
    DuplicatesDrain = "duplicates_drain_per_s", once, "events/s",
        "consumer drain of 100 % redelivered duplicates";
    CeilingWriters = "ceiling_writers_per_s", sampled, "orders/s",
        "ceiling: {n} writers alone (business tx + outbox, no events flowing)";
    E2eWriters = "e2e_writers_per_s", once, "orders/s",
        "orders written during the sustained run ({n} writers)";
    E2eSustained = "e2e_sustained_per_s", once, "orders/s",
        "sustained end to end (order committed → settled)";
}

/// Load levels of the latency runs, percent of the sustained rate.
pub(super) const LOADS: [u32; 3] = [25, 50, 80];

/// A ratio's target.
#[derive(Clone, Copy, Debug)]
pub(super) enum Target {
    AtLeast(f64),
    AtMost(f64),
    /// Explains another figure; no target.
    Info,
}

impl Target {
    pub(super) fn met(self, v: f64) -> bool {
        match self {
            Target::AtLeast(t) => v >= t,
            Target::AtMost(t) => v <= t,
            Target::Info => true,
        }
    }

    pub(super) fn text(self) -> String {
        match self {
            Target::AtLeast(t) => format!(">= {t}"),
            Target::AtMost(t) => format!("<= {t}"),
            Target::Info => "-".to_owned(),
        }
    }
}

/// What a ratio's value is.
#[derive(Clone, Copy, Debug)]
pub(super) enum Of {
    /// A figure divided by another.
    Div(Figure, Figure),
    /// A figure divided by the smaller of two (the slower of two ceilings bounds it).
    DivMin(Figure, Figure, Figure),
    /// A figure itself, against an absolute target.
    Plain(Figure),
    /// The commit → settlement p99 of the latency run at this load (percent), ms.
    LatencyP99(u32),
    /// The rate of a CDC relay costing nothing beyond raw produce on this machine, divided by
    /// raw produce (`Report::cdc_floor`).
    CdcFloorVsProduce,
}

impl Of {
    /// What the value is divided by, for the report: a sampled figure by its median.
    pub(super) fn bound(self) -> String {
        let of = |f: Figure| {
            if f.sampled() {
                format!("median of {}", f.key())
            } else {
                f.key().to_owned()
            }
        };
        match self {
            Of::Div(_, b) => of(b),
            Of::DivMin(_, a, b) => format!("min({}, {})", of(a), of(b)),
            Of::Plain(_) | Of::LatencyP99(_) => "-".to_owned(),
            Of::CdcFloorVsProduce => of(Figure::CeilingCdcProduce),
        }
    }
}

/// A ratio: its key, what it is, its value, its target.
pub(super) struct RatioDef {
    pub(super) key: &'static str,
    pub(super) what: &'static str,
    pub(super) of: Of,
    pub(super) target: Target,
}

const fn ratio(key: &'static str, what: &'static str, of: Of, target: Target) -> RatioDef {
    RatioDef {
        key,
        what,
        of,
        target,
    }
}

use Figure as F;
use Target::{AtLeast, AtMost, Info};

/// The ratios, in the report's order.
pub(super) const RATIOS: &[RatioDef] = &[
    ratio(
        "consumer_drain_vs_ceiling",
        "consumer drain / its ceiling at batch {b}, 1 connection",
        Of::Div(F::ConsumerDrain, F::CeilingConsumer1),
        AtLeast(0.5),
    ),
    ratio(
        "consumer_drain_vs_ceiling_partitions",
        "consumer drain / its ceiling at batch {b}, {p} connections (one per partition)",
        Of::Div(F::ConsumerDrain, F::CeilingConsumerPartitions),
        Info,
    ),
    ratio(
        "relay_drain_vs_ceiling",
        "relay drain / min(lean claim-and-mark, raw produce) at batch {r}",
        Of::DivMin(F::RelayDrain, F::CeilingRelay, F::KafkaProduce),
        AtLeast(0.5),
    ),
    ratio(
        "cdc_drain_vs_produce",
        "CDC relay drain / raw produce",
        Of::Div(F::CdcDrain, F::CeilingCdcProduce),
        AtLeast(0.8),
    ),
    ratio(
        "cdc_drain_vs_ceiling",
        "CDC relay drain / min(pgoutput decode, raw produce)",
        Of::DivMin(F::CdcDrain, F::CeilingCdcDecode, F::CeilingCdcProduce),
        Info,
    ),
    ratio(
        "cdc_cpu_bound_vs_produce",
        "CDC drain's CPU bound on this machine / raw produce: the most CDC drain / raw produce can be here",
        Of::Div(F::CdcDrainCpuBound, F::CeilingCdcProduce),
        Info,
    ),
    ratio(
        "cdc_floor_vs_produce",
        "a CDC relay costing nothing on this machine / raw produce: cores ÷ (raw produce's CPU per record + the server's decode per row), the most any CDC drain / raw produce can be here",
        Of::CdcFloorVsProduce,
        Info,
    ),
    ratio(
        "cdc_drain_vs_cpu_bound",
        "CDC relay drain / its CPU bound on this machine",
        Of::Div(F::CdcDrain, F::CdcDrainCpuBound),
        Info,
    ),
    ratio(
        "message_tx_nconn",
        "business tx with a logical decoding message in the order's statement / order alone, {n} connections",
        Of::Div(F::BusinessTxMessageN, F::BusinessTxN),
        AtLeast(0.9),
    ),
    ratio(
        "sustained_vs_writers_alone",
        "sustained end to end / {n} writers alone",
        Of::Div(F::E2eSustained, F::CeilingWriters),
        AtLeast(0.9),
    ),
    ratio(
        "outbox_tx_nconn",
        "business tx with outbox / order alone, {n} connections",
        Of::Div(F::BusinessTxOutboxN, F::BusinessTxN),
        AtLeast(0.75),
    ),
    ratio(
        "latency_p99_at_50pct_ms",
        "commit → settlement p99 at 50 % load, ms",
        Of::LatencyP99(50),
        AtMost(50.0),
    ),
    ratio(
        "relay_peak_rss_mib",
        "relay peak RSS while draining, MiB",
        Of::Plain(F::RelayPeakRss),
        AtMost(150.0),
    ),
    ratio(
        "consumer_peak_rss_mib",
        "consumer peak RSS while draining, MiB",
        Of::Plain(F::ConsumerPeakRss),
        AtMost(150.0),
    ),
    ratio(
        "cdc_peak_rss_mib",
        "CDC relay peak RSS while draining, MiB",
        Of::Plain(F::CdcPeakRss),
        AtMost(150.0),
    ),
    ratio(
        "message_tx_1conn",
        "business tx with a logical decoding message / order alone, 1 connection",
        Of::Div(F::BusinessTxMessage1, F::BusinessTx1),
        Info,
    ),
    ratio(
        "message_separate_tx_nconn",
        "business tx with the message in a statement of its own / order alone, {n} connections",
        Of::Div(F::BusinessTxMessageSeparateN, F::BusinessTxN),
        Info,
    ),
    ratio(
        "outbox_tx_1conn",
        "business tx with outbox / order alone, 1 connection",
        Of::Div(F::BusinessTxOutbox1, F::BusinessTx1),
        Info,
    ),
    ratio(
        "outbox_vs_plain_row_1conn",
        "business tx with outbox / with a plain second row, 1 connection",
        Of::Div(F::BusinessTxOutbox1, F::BusinessTxPlain1),
        Info,
    ),
    ratio(
        "outbox_vs_plain_row_nconn",
        "business tx with outbox / with a plain second row, {n} connections",
        Of::Div(F::BusinessTxOutboxN, F::BusinessTxPlainN),
        Info,
    ),
    ratio(
        "dedup_vs_no_dedup",
        "consumer drain with inbox / without (what the inbox costs)",
        Of::Div(F::ConsumerDrain, F::ConsumerNoInboxDrain),
        Info,
    ),
    ratio(
        "duplicates_vs_drain",
        "consumer drain of duplicates / of new events",
        Of::Div(F::DuplicatesDrain, F::ConsumerDrain),
        Info,
    ),
];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn figure_keys_and_ratio_keys_are_each_unique() {
        let unique = |mut keys: Vec<&str>| {
            let n = keys.len();
            keys.sort_unstable();
            keys.dedup();
            keys.len() == n
        };
        assert!(unique(Figure::ALL.iter().map(|f| f.key()).collect()));
        assert!(unique(RATIOS.iter().map(|r| r.key).collect()));
    }

    #[test]
    fn a_bound_says_when_it_is_a_median() {
        assert_eq!(
            Of::Div(F::ConsumerDrain, F::CeilingConsumer1).bound(),
            "median of ceiling_consumer_1conn_per_s"
        );
        assert_eq!(
            Of::Div(F::ConsumerDrain, F::ConsumerNoInboxDrain).bound(),
            "consumer_no_inbox_drain_per_s"
        );
        assert_eq!(
            Of::DivMin(F::RelayDrain, F::CeilingRelay, F::KafkaProduce).bound(),
            "min(median of ceiling_relay_per_s, median of kafka_produce_per_s)"
        );
    }
}
