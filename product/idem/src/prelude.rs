//! What a handler, an enqueue or an effect is written with: `use idem::prelude::*;`.

pub use idem_core::store::OutboxStore;
pub use idem_core::{Event, EventId, InboundEvent, TableNames};

#[cfg(feature = "consumer")]
#[cfg_attr(docsrs, doc(cfg(feature = "consumer")))]
pub use idem_consumer::{BatchContext, BatchError, Handler, HandlerContext, HandlerError};
