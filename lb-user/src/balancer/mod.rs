//! The server state machine of one service (`machine.rs`, with its table
//! of states and transitions) and the values it takes and gives
//! (`types.rs`). Sans-I/O and tested with simulated time.

mod machine;
mod types;

pub use self::{
    machine::{Balancer, FIRST_ELECTION_WAIT, PREFERRED_FOR},
    types::{
        Checks, CloseReason, Effect, Health, KernelReport, KernelValue, Readiness, Selection,
        Server, State,
    },
};
