//! The external path under discovery: MetalLB issue 474's rolling update,
//! from a client on another machine, through a `[[service]]` with
//! `[service.discovery]` (`lb_tests::rolling_update` says how). Needs
//! root; see `lb_tests::privileged`.

use lb_tests::{
    in_new_netns, privileged_test,
    rolling_update::{Vip, metallb_474},
};

/// MetalLB 474 through the external path: a 2-replica rolling update
/// where each new pod, not ready yet, lands on the node of the remaining
/// old, ready pod (first on its IP with another port, then with its own
/// IP). A client on another machine connects through the VIP for the
/// whole update. Not one connect may fail; while a new pod was not ready,
/// the old ready pod on its node kept getting connects (the MetalLB bug
/// withdrew that node); the new pods get connects once ready.
#[privileged_test]
fn metallb_474_rolling_update_from_another_machine() {
    in_new_netns(|| metallb_474(Vip::Configured));
}
