//! Retention of the inbox and of done effect intents on a real database.

use idem_conformance::backend::Pg;
use idem_conformance::retention;

#[tokio::test]
async fn retention_prunes_old_rows_and_keeps_young_ones() {
    retention::retention_prunes_old_rows_and_keeps_young_ones(&Pg::new().await).await;
}
