//! `idem-lab chaos --pipeline pipeline.toml`: the chaos runner on a pipeline it did not write.
//! The file (`file.rs`) names the databases, Kafka, the components as command lines and the
//! verify config; the runner starts the components (and a Kafka cluster and a PostgreSQL
//! server of its own when asked: `postgres.rs`), puts fault proxies between each component and
//! its dependencies, injects a seeded schedule of signals, broker kills, PostgreSQL crashes and
//! network faults for `--duration`, stops the load, waits until the pipeline settles or
//! `--settle-deadline` passes, and runs `idem verify`'s checks: lost events with the stage
//! where each stopped, duplicate effects, and stalls, next to the timeline.

mod arm;
mod drive;
mod file;
mod foreign;
mod lock;
pub(super) mod postgres;
mod redeliver;
mod secrets;
mod secured;
mod window;

pub(crate) use drive::run;
