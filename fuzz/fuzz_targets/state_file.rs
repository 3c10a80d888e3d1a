//! The state file (`state_dir/servers.json`) from any text, used as the
//! daemon uses it at start: parsed (never panics), each saved list held
//! to the one server-list check (against an IPv4 and an IPv6 VIP), and a
//! list that passes made into a balancer with its drained servers, whose
//! first selection holds every server once. What parses survives the
//! file's own encoding unchanged.
#![no_main]

use std::{collections::HashSet, net::SocketAddr, time::Instant};

use lb_user::{
    balancer::{Balancer, Checks, Effect, Readiness},
    config::{Policy, validate_servers},
    state::SavedState,
};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|text: &str| {
    let Ok(state) = serde_json::from_str::<SavedState>(text) else { return };
    let vips: [SocketAddr; 2] =
        ["127.0.0.1:6443".parse().unwrap(), "[fd00::1]:6443".parse().unwrap()];
    let now = Instant::now();
    for (name, list) in &state.services {
        assert_eq!(state.list_for(name, &list.configured, list.configured_default), Some(list));
        for vip in vips {
            let owner = |addr: SocketAddr| (addr == vip).then(|| name.clone());
            if let Err(problems) = validate_servers(vip, &list.servers, list.default, owner) {
                assert!(!problems.is_empty());
                continue;
            }
            for policy in [Policy::Failover, Policy::Spread] {
                let checks = Checks { rise: 1, fall: 1, passive_only: false };
                let (mut balancer, effects) =
                    Balancer::new(policy, checks, &list.servers, list.default, now);
                for &addr in &list.drained {
                    balancer.set_readiness(addr, Readiness::Serving, now);
                }
                let expected: HashSet<SocketAddr> =
                    list.servers.iter().copied().chain(list.default).collect();
                let selection = balancer.selection();
                assert_eq!(selection.servers.len(), expected.len(), "{selection:?}");
                assert_eq!(
                    selection.servers.iter().copied().collect::<HashSet<_>>(),
                    expected,
                    "{selection:?}"
                );
                assert!(
                    selection.spread >= 1 && selection.spread <= selection.servers.len().max(1),
                    "{selection:?}"
                );
                for effect in effects {
                    if let Effect::WriteSelection { value, .. } = effect {
                        let written = &value.selection;
                        assert_eq!(written.servers.len(), expected.len(), "{written:?}");
                        assert_eq!(value.states.len(), written.servers.len(), "{value:?}");
                    }
                }
            }
        }
    }
    // `SavedState::save` writes it this way.
    let saved = serde_json::to_vec_pretty(&state).expect("a parsed state encodes");
    assert_eq!(
        serde_json::from_slice::<SavedState>(&saved).expect("its own encoding decodes"),
        state
    );
});
