//! Retention of the inbox and of done effect intents on a real database.

use idem_conformance::backend::Pg;

idem_conformance::retention_scenarios!(Pg::new().await);
