//! idem's cross-crate proofs at library level, in `tests/`: the relay against librdkafka's mock
//! cluster (`mock_cluster.rs`), the consumer with the reference handlers (`consumer.rs`), the
//! exported metrics against scripted numbers (`metrics.rs`), and the `deploy/` files against the
//! code (`deploy.rs`). Tests that start idem processes live with the lab (`lab/idem-lab/tests`);
//! tests of the operator binary alone with it (`product/idem-cli/tests`). This crate has no code.
