//! What the sources share: the `Signal`s a source sends, the ranking of
//! its endpoints (`rank`), and `forward`, which debounces signals into the
//! daemon's [`Update`]s the same way for every source.

use std::{cmp::Reverse, collections::HashMap, net::SocketAddr, time::Duration};

use tokio::{sync::mpsc, time::Instant};

use super::{Endpoint, MAX_SERVERS, Source, Update};
use crate::balancer::Readiness;

/// What a source tells the forwarder.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Signal {
    /// The whole current list (ranked by [`rank`]).
    List {
        endpoints: Vec<Endpoint>,
        truncated: usize,
        /// Send it even if it equals the last list sent: a full sync
        /// (relist, resolution) that the daemon should hear of.
        confirm: bool,
    },
    /// A sync failed: sent at once.
    Failed(String),
}

/// Orders endpoints best first (ready before serving, then by address),
/// keeps one per address (the best readiness), and keeps at most
/// [`MAX_SERVERS`]: returns the list and how many were left out.
pub(crate) fn rank(endpoints: impl IntoIterator<Item = Endpoint>) -> (Vec<Endpoint>, usize) {
    let mut best: HashMap<SocketAddr, Readiness> = HashMap::new();
    for Endpoint { addr, readiness } in endpoints {
        let slot = best.entry(addr).or_insert(readiness);
        *slot = (*slot).max(readiness);
    }
    let mut list: Vec<Endpoint> =
        best.into_iter().map(|(addr, readiness)| Endpoint { addr, readiness }).collect();
    list.sort_by_key(|e| (Reverse(e.readiness), e.addr));
    let truncated = list.len().saturating_sub(MAX_SERVERS);
    list.truncate(MAX_SERVERS);
    (list, truncated)
}

/// Turns a source's signals into updates: a failure goes out at once; a
/// list that differs from the last one sent (or a confirmation) opens a
/// window of `debounce`, and when it closes the latest list goes out once,
/// if it still differs or a confirmation is due. A burst inside the window
/// (an endpoint added, removed and re-added) is one update, and an update
/// is never later than `debounce` after the first change. The first
/// success after a failure is always sent.
///
/// Returns when the daemon closes `tx` or the source closes `signals`.
pub(crate) async fn forward(
    service: String,
    source: Source,
    debounce: Duration,
    mut signals: mpsc::Receiver<Signal>,
    tx: mpsc::Sender<Update>,
) {
    let mut sent: Option<(Vec<Endpoint>, usize)> = None;
    let mut latest: Option<(Vec<Endpoint>, usize)> = None;
    let mut confirm = true; // the first list always goes out
    let mut window: Option<Instant> = None;
    loop {
        let signal = tokio::select! {
            signal = signals.recv() => signal,
            () = sleep_until(window) => {
                window = None;
                if let Some(list) = latest.take()
                    && (confirm || sent.as_ref() != Some(&list))
                {
                    confirm = false;
                    let (endpoints, truncated) = list.clone();
                    sent = Some(list);
                    if tx.send(Update { service: service.clone(), source, result: Ok(endpoints), truncated }).await.is_err() {
                        return;
                    }
                }
                continue;
            }
            () = tx.closed() => return,
        };
        let Some(signal) = signal else { return };
        match signal {
            Signal::List { endpoints, truncated, confirm: c } => {
                let list = (endpoints, truncated);
                confirm |= c;
                if window.is_none() && (confirm || sent.as_ref() != Some(&list)) {
                    window = Some(Instant::now() + debounce);
                }
                latest = Some(list);
            }
            Signal::Failed(error) => {
                confirm = true;
                let update =
                    Update { service: service.clone(), source, result: Err(error), truncated: 0 };
                if tx.send(update).await.is_err() {
                    return;
                }
            }
        }
    }
}

async fn sleep_until(deadline: Option<Instant>) {
    match deadline {
        Some(deadline) => tokio::time::sleep_until(deadline).await,
        None => std::future::pending().await,
    }
}

#[cfg(test)]
mod tests {
    use tokio::task::JoinHandle;

    use super::*;

    fn ep(addr: &str, readiness: Readiness) -> Endpoint {
        Endpoint { addr: addr.parse().unwrap(), readiness }
    }

    fn ready(addr: &str) -> Endpoint {
        ep(addr, Readiness::Ready)
    }

    #[test]
    fn rank_puts_ready_first_then_orders_by_address() {
        let (list, truncated) = rank([
            ep("127.10.0.3:80", Readiness::Serving),
            ready("127.10.0.9:80"),
            ready("127.10.0.1:80"),
            ep("127.10.0.2:80", Readiness::Serving),
        ]);
        assert_eq!(
            list,
            [
                ready("127.10.0.1:80"),
                ready("127.10.0.9:80"),
                ep("127.10.0.2:80", Readiness::Serving),
                ep("127.10.0.3:80", Readiness::Serving)
            ]
        );
        assert_eq!(truncated, 0);
    }

    #[test]
    fn rank_keeps_one_entry_per_address_with_the_best_readiness() {
        // The same endpoint in two slices (a slice being replaced).
        let (list, _) = rank([ep("127.10.0.1:80", Readiness::Serving), ready("127.10.0.1:80")]);
        assert_eq!(list, [ready("127.10.0.1:80")]);
    }

    #[test]
    fn rank_keeps_the_best_sixteen_and_counts_the_rest() {
        // 10 serving with low addresses, 10 ready with high ones: the 10
        // ready stay, then the 6 lowest serving.
        let serving = (1..=10).map(|i| ep(&format!("127.10.0.{i}:80"), Readiness::Serving));
        let readies = (101..=110).map(|i| ready(&format!("127.10.0.{i}:80")));
        let (list, truncated) = rank(serving.chain(readies));
        assert_eq!(list.len(), MAX_SERVERS);
        assert_eq!(truncated, 4);
        assert!(list[..10].iter().all(|e| e.readiness == Readiness::Ready));
        assert_eq!(list[10], ep("127.10.0.1:80", Readiness::Serving));
        assert_eq!(list[15], ep("127.10.0.6:80", Readiness::Serving));
        // Stable: the same input in another order gives the same list.
        let again: Vec<_> = list.iter().rev().copied().collect();
        assert_eq!(rank(again).0, list);
    }

    struct Harness {
        signals: mpsc::Sender<Signal>,
        updates: mpsc::Receiver<Update>,
        task: JoinHandle<()>,
    }

    const DEBOUNCE: Duration = Duration::from_secs(1);

    fn harness() -> Harness {
        let (signals, signal_rx) = mpsc::channel(16);
        let (tx, updates) = mpsc::channel(16);
        let task = tokio::spawn(forward("api".into(), Source::Kubernetes, DEBOUNCE, signal_rx, tx));
        Harness { signals, updates, task }
    }

    fn list(endpoints: &[Endpoint], confirm: bool) -> Signal {
        Signal::List { endpoints: endpoints.to_vec(), truncated: 0, confirm }
    }

    fn ok(endpoints: &[Endpoint]) -> Update {
        Update {
            service: "api".into(),
            source: Source::Kubernetes,
            result: Ok(endpoints.to_vec()),
            truncated: 0,
        }
    }

    impl Harness {
        async fn send(&self, signal: Signal) {
            self.signals.send(signal).await.unwrap();
            // Let the forwarder take it before time moves.
            tokio::task::yield_now().await;
        }

        /// The next update, and how long (simulated) it took.
        async fn next(&mut self) -> (Update, Duration) {
            let start = Instant::now();
            let update = tokio::time::timeout(Duration::from_secs(60), self.updates.recv())
                .await
                .expect("no update")
                .unwrap();
            (update, start.elapsed())
        }

        /// No update within `within`.
        async fn quiet(&mut self, within: Duration) {
            if let Ok(update) = tokio::time::timeout(within, self.updates.recv()).await {
                panic!("unexpected update {update:?}");
            }
        }
    }

    #[tokio::test(start_paused = true)]
    async fn the_first_list_goes_out_after_the_window_even_if_empty() {
        let mut h = harness();
        h.send(list(&[], true)).await;
        let (update, took) = h.next().await;
        assert_eq!(update, ok(&[]));
        assert_eq!(took, DEBOUNCE);
        h.task.abort();
    }

    #[tokio::test(start_paused = true)]
    async fn add_remove_readd_within_the_window_is_one_update() {
        let mut h = harness();
        let a = ready("127.10.0.1:443");
        let b = ready("127.10.0.2:443");
        h.send(list(&[a], true)).await;
        assert_eq!(h.next().await.0, ok(&[a]));

        h.send(list(&[a, b], false)).await;
        tokio::time::sleep(Duration::from_millis(300)).await;
        h.send(list(&[a], false)).await;
        tokio::time::sleep(Duration::from_millis(300)).await;
        h.send(list(&[a, b], false)).await;
        let (update, took) = h.next().await;
        assert_eq!(update, ok(&[a, b]));
        // The window opened with the first change: 1 s after it.
        assert_eq!(took, DEBOUNCE - Duration::from_millis(600));
        h.quiet(Duration::from_secs(10)).await;
        h.task.abort();
    }

    #[tokio::test(start_paused = true)]
    async fn a_change_undone_within_the_window_sends_nothing() {
        let mut h = harness();
        let a = ready("127.10.0.1:443");
        let b = ready("127.10.0.2:443");
        h.send(list(&[a], true)).await;
        h.next().await;
        h.send(list(&[a, b], false)).await;
        h.send(list(&[a], false)).await;
        h.quiet(Duration::from_secs(10)).await;
        h.task.abort();
    }

    #[tokio::test(start_paused = true)]
    async fn an_unchanged_list_is_not_resent_unless_confirmed() {
        let mut h = harness();
        let a = ready("127.10.0.1:443");
        h.send(list(&[a], true)).await;
        h.next().await;
        h.send(list(&[a], false)).await;
        h.quiet(Duration::from_secs(5)).await;
        // A relist confirms the same list.
        h.send(list(&[a], true)).await;
        assert_eq!(h.next().await.0, ok(&[a]));
        h.task.abort();
    }

    #[tokio::test(start_paused = true)]
    async fn a_failure_goes_out_at_once_and_the_next_success_is_always_sent() {
        let mut h = harness();
        let a = ready("127.10.0.1:443");
        h.send(list(&[a], true)).await;
        h.next().await;
        h.send(Signal::Failed("boom".into())).await;
        let (update, took) = h.next().await;
        assert_eq!(update.result, Err("boom".into()));
        assert_eq!(took, Duration::ZERO);
        // The same list as before, not flagged as a confirmation: still
        // sent, so the daemon knows the source recovered.
        h.send(list(&[a], false)).await;
        assert_eq!(h.next().await.0, ok(&[a]));
        h.task.abort();
    }

    #[tokio::test(start_paused = true)]
    async fn steady_changes_are_sent_every_window_not_held_back() {
        let mut h = harness();
        h.send(list(&[], true)).await;
        h.next().await;
        // A change every 400 ms for 3 s: updates keep coming, each at most
        // one window after the change that opened it.
        let mut updates = 0;
        for i in 1..=8u16 {
            h.send(list(&[ready(&format!("127.10.0.{i}:443"))], false)).await;
            tokio::time::sleep(Duration::from_millis(400)).await;
            while let Ok(u) = h.updates.try_recv() {
                assert!(u.result.is_ok());
                updates += 1;
            }
        }
        assert!(updates >= 2, "{updates} updates");
        h.task.abort();
    }

    #[tokio::test(start_paused = true)]
    async fn truncation_is_reported() {
        let mut h = harness();
        let a = ready("127.10.0.1:443");
        h.send(Signal::List { endpoints: vec![a], truncated: 3, confirm: true }).await;
        let (update, _) = h.next().await;
        assert_eq!(update.truncated, 3);
        h.task.abort();
    }

    #[tokio::test(start_paused = true)]
    async fn the_forwarder_ends_when_the_daemon_goes() {
        let h = harness();
        drop(h.updates);
        tokio::time::timeout(Duration::from_secs(1), h.task).await.expect("still running").unwrap();
    }
}
