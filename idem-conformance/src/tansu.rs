//! A Tansu broker process for end-to-end tests.
