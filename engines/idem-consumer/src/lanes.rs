//! A fetched set of records cut into lanes, planned before any I/O: one lane per partition, in
//! offset order, each cut into transactions of at most the batch size. Lanes of different
//! partitions are applied concurrently, each on its own connection; the transactions of one
//! lane run one after another, so a partition's records are applied in offset order. Pure.

use idem_core::store::Delivery;

/// One partition's records of a fetched set, as the transactions that apply them in order.
#[derive(Debug, PartialEq)]
pub(crate) struct Lane<'r> {
    /// Each transaction's records: one partition's, contiguous, in offset order.
    pub(crate) chunks: Vec<&'r [Delivery]>,
}

/// Orders `records` by partition, keeping the order of each partition's records (the stable
/// sort the lanes are cut from).
pub(crate) fn sort_by_partition(records: &mut [Delivery]) {
    records.sort_by(|a, b| (&a.topic, a.partition).cmp(&(&b.topic, b.partition)));
}

/// The lanes of `records` (already [`sort_by_partition`]ed), each cut into transactions of at
/// most `batch_size` records (at least one).
pub(crate) fn lanes(records: &[Delivery], batch_size: usize) -> Vec<Lane<'_>> {
    let size = batch_size.max(1);
    records
        .chunk_by(|a, b| a.topic == b.topic && a.partition == b.partition)
        .map(|partition| Lane {
            chunks: partition.chunks(size).collect(),
        })
        .collect()
}

/// How many records one fetch collects: enough for a full transaction on each of the
/// `concurrency` lanes.
pub(crate) fn fetch_size(batch_size: usize, concurrency: usize) -> usize {
    batch_size.max(1).saturating_mul(concurrency.max(1))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(topic: &str, partition: i32, offset: i64) -> Delivery {
        Delivery {
            topic: topic.to_owned(),
            partition,
            offset,
            key: None,
            payload: None,
            headers: vec![],
            timestamp: None,
        }
    }

    fn positions(lane: &Lane<'_>) -> Vec<Vec<(String, i32, i64)>> {
        lane.chunks
            .iter()
            .map(|c| {
                c.iter()
                    .map(|d| (d.topic.clone(), d.partition, d.offset))
                    .collect()
            })
            .collect()
    }

    #[test]
    fn each_partition_is_one_lane_in_offset_order_cut_at_the_batch_size() {
        let mut records = vec![
            record("t", 1, 10),
            record("t", 0, 5),
            record("t", 1, 11),
            record("u", 0, 1),
            record("t", 0, 6),
            record("t", 1, 12),
            record("t", 0, 7),
        ];
        sort_by_partition(&mut records);
        let lanes = lanes(&records, 2);
        let got: Vec<_> = lanes.iter().map(positions).collect();
        let p = |t: &str, part: i32, offsets: &[i64]| -> Vec<(String, i32, i64)> {
            offsets.iter().map(|o| (t.to_owned(), part, *o)).collect()
        };
        assert_eq!(
            got,
            vec![
                vec![p("t", 0, &[5, 6]), p("t", 0, &[7])],
                vec![p("t", 1, &[10, 11]), p("t", 1, &[12])],
                vec![p("u", 0, &[1])],
            ]
        );
    }

    #[test]
    fn a_zero_batch_size_still_makes_progress_and_nothing_is_left_out() {
        let mut records: Vec<_> = (0..5).map(|o| record("t", 0, o)).collect();
        sort_by_partition(&mut records);
        let lanes = lanes(&records, 0);
        assert_eq!(lanes.len(), 1);
        assert_eq!(lanes[0].chunks.len(), 5);
        assert!(super::lanes(&[], 10).is_empty());
        assert_eq!(fetch_size(200, 4), 800);
        assert_eq!(fetch_size(0, 0), 1);
        assert_eq!(fetch_size(usize::MAX, 4), usize::MAX);
    }
}
