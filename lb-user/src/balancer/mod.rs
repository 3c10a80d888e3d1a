//! The server state machine of one service (`machine.rs`, with its table
//! of states and transitions), the decisions of a step as functions over
//! the servers (`decide.rs`), a new server list applied
//! (`membership.rs`), and the values it takes and gives
//! (`types.rs`). Sans-I/O and tested with simulated time.

mod decide;
mod machine;
mod membership;
mod types;

pub use self::{
    machine::{Balancer, FIRST_ELECTION_WAIT, PREFERRED_FOR},
    types::{
        Checks, CloseReason, Effect, Health, KernelReport, KernelValue, Readiness, Selection,
        Server, State,
    },
};
