//! A service's servers after a new list: removed servers forgotten (their
//! connections closed), a removed default kept as the standby last
//! resort, new ones added in state `first`, in configured order (the list
//! first, the standby default last). A function over plain data; the
//! machine (`machine.rs`) applies it.

use std::{net::SocketAddr, time::Instant};

use super::types::{CloseReason, Effect, Server, State};

/// `servers` after the list `list` (duplicates ignored) with `default`:
/// the state changes and closes it calls for go to `effects`, servers that
/// left the list to `demoted`.
pub(super) fn replaced(
    servers: Vec<Server>,
    list: &[SocketAddr],
    default: Option<SocketAddr>,
    first: State,
    now: Instant,
    effects: &mut Vec<Effect>,
    demoted: &mut Vec<SocketAddr>,
) -> Vec<Server> {
    let mut unique: Vec<SocketAddr> = Vec::with_capacity(list.len());
    for addr in list {
        if !unique.contains(addr) {
            unique.push(*addr);
        }
    }

    // Forget removed servers (a removed default stays as standby). The
    // list ends with at most the listed servers and the default: sized
    // for that, as 10,000 services hold one each.
    let mut kept = Vec::with_capacity(unique.len() + usize::from(default.is_some()));
    for mut server in servers {
        let listed = unique.contains(&server.addr);
        let is_default = Some(server.addr) == default;
        if listed {
            if !server.in_list {
                // The standby default joins the list: checked like any server.
                effects.push(Effect::StateChanged {
                    server: server.addr,
                    from: server.state,
                    to: first,
                    why: "added to the server list",
                });
                server.state = first;
                server.since = now;
                server.in_list = true;
            }
            server.is_default = is_default;
            kept.push(server);
        } else if is_default {
            if server.in_list {
                effects.push(Effect::StateChanged {
                    server: server.addr,
                    from: server.state,
                    to: State::Standby,
                    why: "removed from the list; kept as the default",
                });
                server.state = State::Standby;
                server.since = now;
                server.in_list = false;
                demoted.push(server.addr);
            }
            server.is_default = true;
            kept.push(server);
        } else {
            effects.push(Effect::StateChanged {
                server: server.addr,
                from: server.state,
                to: State::Invalid,
                why: "removed",
            });
            effects.push(Effect::CloseConnections {
                server: server.addr,
                reason: CloseReason::Removed,
            });
        }
    }
    let mut servers = kept;
    for addr in &unique {
        if !servers.iter().any(|s| s.addr == *addr) {
            let mut server = Server::new(*addr, first, true, now);
            server.is_default = Some(*addr) == default;
            effects.push(Effect::StateChanged {
                server: *addr,
                from: State::Invalid,
                to: first,
                why: "added",
            });
            servers.push(server);
        }
    }
    if let Some(addr) = default
        && !servers.iter().any(|s| s.addr == addr)
    {
        let mut server = Server::new(addr, State::Standby, false, now);
        server.is_default = true;
        effects.push(Effect::StateChanged {
            server: addr,
            from: State::Invalid,
            to: State::Standby,
            why: "set as the default",
        });
        servers.push(server);
    }
    // Configured order: the list first, the standby default last.
    servers.sort_by_key(|s| (!s.in_list, unique.iter().position(|a| *a == s.addr)));
    servers
}
