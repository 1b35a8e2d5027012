//! ack
